"""CUDA-graph recording for the ``fused`` and ``persistent`` strategies' calls (inference and
``fused:train``).

:class:`CudaGraphRecorder` captures a call's device work once and replays it; the outputs of
the capture are static buffers that every replay rewrites. :class:`EagerRecorder` keeps the
same static-buffer contract without CUDA, so the logic that depends on it is tested on the CPU.

**Memory.** A graph keeps the memory of everything allocated during its capture, temporaries
included, for as long as it lives. With a pool per graph, a model of L layers, each with graphs
for a few token counts, would hold L × (token counts) copies of a call's largest temporaries
(``fused``: layer0's output, W·cap rows). Graphs whose outputs are read before any other graph
replays capture into one pool per device instead (:func:`device_pool`, ``shared_pool=True``) and
share that memory: the ``fused`` and ``persistent`` inference graphs (the caller clones the output
at once) and ``fused:train``'s backward graphs (dx and the routing weights' gradient are cloned,
d(pre-activation) is read by the weight-gradient kernels right after). A ``fused:train`` forward
graph keeps a pool of its own: its outputs are the saves its backward reads after other layers'
graphs have run. Static inputs and the outputs copied out at once are shared by every layer's
graphs too (:func:`shared_static`).
"""

from __future__ import annotations

import torch

from interlace.kernels import alloc
from interlace.parallel import symmetric

_POOLS: dict = {}  # CUDA device index → the shared graph pool's handle


def device_pool(device):
    """The memory pool that graphs captured with ``shared_pool=True`` share, one per device.

    Sharing is safe under three conditions, which every user in interlace meets: the graphs of
    the pool replay one at a time in stream order (interlace's layers of a process share their
    peer buffers and never run concurrently); a graph's outputs are read before any other graph
    of the pool replays (another graph's temporaries may lie in their memory, and the reverse);
    and no graph keeps data in its temporaries from one replay to the next."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _POOLS:
        _POOLS[index] = torch.cuda.graph_pool_handle()
    return _POOLS[index]


def shared_static(name: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A graph's static input or output buffer, one per (name, shape, dtype, device) in the
    process while some graph holds it (:func:`interlace.kernels.alloc.shared`): the graphs of
    every layer that copy their inputs in just before a replay, or read their outputs just after
    it, use the same buffer rather than one each (a model of L layers would hold L copies of its
    activations otherwise). Safe under :func:`device_pool`'s conditions."""
    return alloc.shared(f"graph.{name}", shape, dtype, device)


def capture_for(strategy, recorder, fn, device, shared_pool: bool = False) -> tuple:
    """A new ``recorder()`` with ``fn`` captured (``shared_pool``: see :meth:`CudaGraphRecorder.capture`),
    counted in ``strategy.captures`` (``auto`` leaves a call that captured out of its timings):
    ``(recorder, fn's outputs)``."""
    strategy.captures += 1
    rec = recorder()
    return rec, rec.capture(fn, device, shared_pool=shared_pool)


def static_copies(name: str, *tensors: torch.Tensor) -> tuple:
    """:func:`shared_static` buffers ``name.0``, ``name.1``, ... holding copies of ``tensors``."""
    out = tuple(shared_static(f"{name}.{i}", t.shape, t.dtype, t.device) for i, t in enumerate(tensors))
    for buf, t in zip(out, tensors):
        buf.copy_(t.detach())
    return out


class CudaGraphRecorder:
    """Captures ``fn()`` into one CUDA graph; its outputs become static buffers that every
    :meth:`replay` rewrites in place. Capture records without running: replay after it.

    The graph holds the call's collectives too (the count exchange, the backward's ordering
    all-reduce). A live graph with a captured NCCL collective keeps ``ncclCommDestroy`` waiting
    (pytorch/pytorch#115388), so
    :func:`interlace.parallel.release_shared_buffers` drops every graph first and must run
    before ``destroy_process_group()``. (Keeping the collectives out, as eager steps between
    graph segments, invalidated backward captures now and then.)"""

    def capture(self, fn, device, shared_pool: bool = False):
        """Capture ``fn()``; ``shared_pool``: into the device's shared pool (:func:`device_pool`:
        the outputs must be read before another graph of the pool replays), else a private one."""
        self.graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(device)  # a capture syncs once (the first graph call of a token count)
        with torch.cuda.graph(self.graph, pool=device_pool(device) if shared_pool else None):
            out = fn()
        symmetric.free_unowned()  # (what died during the capture: see interlace.parallel.symmetric)
        return out

    def replay(self) -> None:
        self.graph.replay()


def _copy_into(dst, src) -> None:
    """Copy every tensor of ``src`` into the same place of ``dst`` (dataclasses, tuples, lists)."""
    if isinstance(dst, torch.Tensor):
        if dst is not src:
            dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for a, b in zip(dst, src):
            _copy_into(a, b)
    elif hasattr(dst, "__dataclass_fields__"):
        for name in dst.__dataclass_fields__:
            _copy_into(getattr(dst, name), getattr(src, name))


class EagerRecorder:
    """:class:`CudaGraphRecorder`'s contract without CUDA (tests on the CPU): the outputs of the
    capture are the static buffers, and each later replay runs ``fn`` again and copies its
    results into them, so a call that reads them after another call's replay sees that
    call's values, as it would with a real graph. The capture itself runs ``fn`` (a real
    capture does not), so the replay right after it is skipped."""

    def capture(self, fn, device, shared_pool: bool = False):
        self.fn, self.fresh = fn, True
        self.out = fn()
        return self.out

    def replay(self) -> None:
        if self.fresh:
            self.fresh = False
            return
        _copy_into(self.out, self.fn())
