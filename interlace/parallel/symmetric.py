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

import itertools
import weakref

import torch

_HELD: dict[int, tuple[torch.Tensor, object]] = {}  # key → (allocation, rendezvous handle), owner alive
_WAITING: list[tuple[torch.Tensor, object]] = []  # owner died during a capture: freed at the next free_unowned
_KEYS = itertools.count()


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
    key = next(_KEYS)
    _HELD[key] = (raw, handle)
    weakref.finalize(owner, _owner_died, key).atexit = False


def _owner_died(key: int) -> None:
    entry = _HELD.pop(key, None)
    if entry is not None and capturing():
        _WAITING.append(entry)  # (freeing it now would abort the process)
    # else: the last references go with ``entry``, here


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
    return len(_HELD), len(_WAITING)
