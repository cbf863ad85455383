"""Torch symmetric-memory allocations, freed only outside CUDA-graph captures.

Freeing a symmetric allocation calls the CUDA driver, which a stream capture forbids: the
destructor's error cannot propagate, and the process aborts ("operation not permitted when
stream is capturing", from ``~AllocationRef``). The owner of an allocation (a
:class:`~interlace.parallel.peer_buffer.PeerBuffer` or a persistent ``DistBuffer``) can die while
a capture is under way: ``auto`` drops a candidate strategy, or Python's cycle collector runs
while a layer captures its graphs. So every allocation made here is held with its rendezvous handle,
and let go when its owner dies, unless the current stream is capturing then: it is let go at
the next point that is not, :func:`free_unowned` (the next allocation, the end of each of
interlace's own captures, :class:`~interlace.strategies.graphs.CudaGraphRecorder`, and
:func:`~interlace.parallel.peer_buffer.release_shared_buffers`).
"""

from __future__ import annotations

import weakref

import torch

_OWNERS: weakref.WeakSet = weakref.WeakSet()  # the owners alive (their finalizers hold the allocations)
_WAITING: list[tuple[torch.Tensor, object]] = []  # owner died during a capture: freed at the next free_unowned


def allocate(nbytes: int, group, device: torch.device, owner_factory, backend: str | None = None):
    """One zeroed symmetric allocation of ``nbytes`` bytes and its rendezvous on ``group`` (a
    collective: every rank, same order). ``owner_factory(raw, handle)`` builds the object that
    owns it, which this returns; the allocation is let go when that object dies (later if a
    capture is under way then)."""
    import torch.distributed._symmetric_memory as symm_mem

    free_unowned()
    if backend is not None:
        symm_mem.set_backend(backend)  # must precede the process's first symmetric allocation
    raw = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    # Zeroed on the stream: a peer's first store into it follows a collective every rank reaches
    # only after this.
    raw.zero_()
    handle = symm_mem.rendezvous(raw, group)
    owner = owner_factory(raw, handle)
    hold(owner, raw, handle)
    return owner


def hold(owner, raw: torch.Tensor, handle) -> None:
    """Keep ``raw`` and ``handle`` while ``owner`` lives, and past its death until no capture is
    under way (:func:`allocate` calls this; tests call it with stand-ins)."""
    _OWNERS.add(owner)
    weakref.finalize(owner, _owner_died, raw, handle).atexit = False  # (the finalizer holds both)


def _owner_died(raw: torch.Tensor, handle) -> None:
    if capturing():
        _WAITING.append((raw, handle))  # (freeing it now would abort the process)
    # else: the finalizer's references, the last, go when it returns


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def free_unowned() -> int:
    """Let go of the allocations whose owner died during a capture, unless the current stream is
    capturing now; returns how many."""
    if not _WAITING or capturing():
        return 0
    n = len(_WAITING)
    _WAITING.clear()
    return n


def held() -> tuple[int, int]:
    """(allocations whose owner lives, allocations waiting to be freed)."""
    return len(_OWNERS), len(_WAITING)
