"""CUDA-graph recording for the fused strategy's calls (inference and ``fused:train``).

:class:`CudaGraphRecorder` captures a call's device work once and replays it; the outputs of
the capture are static buffers that every replay rewrites. :class:`EagerRecorder` keeps the
same static-buffer contract without CUDA, so the logic that depends on it is tested on the CPU.
"""

from __future__ import annotations

import torch


class CudaGraphRecorder:
    """Captures ``fn()`` into one CUDA graph; its outputs become static buffers that every
    :meth:`replay` rewrites in place. Capture records without running: replay after it.

    The graph holds the call's collectives too (the count exchange, the backward's ordering
    all-reduce). A live graph with a captured NCCL collective keeps ``ncclCommDestroy`` waiting
    (pytorch/pytorch#115388), so
    :func:`interlace.parallel.release_shared_buffers` drops every graph first and must run
    before ``destroy_process_group()``. (Keeping the collectives out, as eager steps between
    graph segments, invalidated backward captures now and then.)"""

    def capture(self, fn, device):
        self.graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(device)  # a capture syncs once (the first graph call of a token count)
        with torch.cuda.graph(self.graph):
            out = fn()
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

    def capture(self, fn, device):
        self.fn, self.fresh = fn, True
        self.out = fn()
        return self.out

    def replay(self) -> None:
        if self.fresh:
            self.fresh = False
            return
        _copy_into(self.out, self.fn())
