"""interlace.parallel.symmetric: an allocation outlives an owner that dies during a CUDA-graph
capture (freeing it there aborts the process) and goes at the next point outside one. Stand-ins
for the allocation and handle: the hold logic is what is tested; the GPU runs it for real."""

import gc
import weakref

import torch

from interlace.parallel import symmetric


class Stand:
    """A stand-in for a buffer owner or a rendezvous handle (weakly referenceable)."""


def _owned(monkeypatch, capturing: bool):
    monkeypatch.setattr(symmetric, "capturing", lambda: capturing)
    owner, handle = Stand(), Stand()
    symmetric.hold(owner, torch.zeros(4), handle)
    return owner, weakref.ref(handle)


def test_owner_dying_outside_a_capture_frees_at_once(monkeypatch):
    held = symmetric.held()
    owner, handle = _owned(monkeypatch, capturing=False)
    assert symmetric.held() == (held[0] + 1, held[1])
    del owner
    gc.collect()
    assert handle() is None
    assert symmetric.held() == held


def test_owner_dying_during_a_capture_waits_for_the_next_safe_point(monkeypatch):
    held = symmetric.held()
    owner, handle = _owned(monkeypatch, capturing=True)
    cycle = Stand()
    cycle.owner, owner.cycle = owner, cycle  # collected by the cycle collector, as it can be mid-capture
    del owner, cycle
    gc.collect()
    assert handle() is not None, "freed during a capture"
    assert symmetric.held() == (held[0], held[1] + 1)
    assert symmetric.free_unowned() == 0 and handle() is not None  # still capturing
    monkeypatch.setattr(symmetric, "capturing", lambda: False)
    assert symmetric.free_unowned() == 1
    assert handle() is None
    assert symmetric.held() == held
