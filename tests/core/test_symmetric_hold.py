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


def test_both_buffers_build_through_symmetric_allocate(monkeypatch):
    """PeerBuffer.symmetric and the persistent DistBuffer.symmetric on a stand-in for torch's
    symmetric memory (CPU tensors; every rank's buffer is this one): the construction runs, the
    allocation is held while the buffer lives and let go with it."""
    import sys
    import types

    import torch.distributed as dist

    from interlace.kernels.persistent.dist_launch import DistBuffer, DistSpec
    from interlace.parallel.peer_buffer import BufferSpec, PeerBuffer

    class Handle:
        def __init__(self, raw):
            self.raw = raw

        def get_buffer(self, rank, shape, dtype):
            return self.raw

    fake = types.ModuleType("torch.distributed._symmetric_memory")
    fake.empty = lambda nbytes, dtype, device: torch.full((nbytes,), 7, dtype=dtype, device=device)
    fake.rendezvous = lambda raw, group: Handle(raw)
    fake.set_backend = lambda backend: None
    monkeypatch.setitem(sys.modules, "torch.distributed._symmetric_memory", fake)
    monkeypatch.setattr(dist, "_symmetric_memory", fake, raising=False)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "barrier", lambda group=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    cpu = torch.device("cpu")
    for build, spec in ((PeerBuffer.symmetric, BufferSpec(2, 2, 16, 2, 8, 16, 16, torch.float32)),
                        (DistBuffer.symmetric, DistSpec(2, 2, 16, 2, 8, torch.float32))):
        held = symmetric.held()
        buf = build(spec, None, cpu)
        assert buf.kind == "symmetric" and int(buf.raw.abs().sum()) == 0  # zeroed
        assert {int(t[0]) for t in buf.tables.values()} <= {buf.raw.data_ptr() + off
                                                             for off, _, _ in spec.regions().values()}
        assert symmetric.held() == (held[0] + 1, held[1])
        handle = weakref.ref(buf.handle)
        del buf
        gc.collect()
        assert handle() is None and symmetric.held() == held
