"""Shared-expert overlap: the always-on experts on a side CUDA stream, beside the routed experts.

The shared expert (DeepSeek's shared experts, Qwen2-MoE's gated shared expert) needs no
communication and does not depend on the routing, so its GEMMs can run while the current stream
routes, dispatches (all-to-all, or the fused kernels' peer stores), computes and combines the
routed experts. This is Megatron-core's shared-expert overlap, done once around the whole
strategy call (a strategy need not know about it):

    fork:  side.wait_stream(current)          the input (and the weights) are ready
           with torch.cuda.stream(side): y = shared(x)
           x.record_stream(side)              x's memory is read on the side stream
    ...    routed experts on the current stream
    join:  current.wait_stream(side)          y is complete
           y.record_stream(current)           y, made on the side stream, is read here

Backward overlaps too, with no code here: autograd runs each op's backward on the stream its
forward ran on and synchronizes where a gradient crosses streams (the shared branch's dx meets
the routed branch's dx; the caller's stream waits for the side stream at the end of backward).
The output is the same sum ``routed + shared`` as without overlap, bit for bit.

Nothing changes on a CPU, with the option off (``MoEConfig.shared_overlap``), or while
``torch.compile`` traces (Inductor schedules the graph on one stream): :func:`start` then runs
the branch at once, and :meth:`SharedBranch.join` returns its result.
"""

from __future__ import annotations

from typing import Callable

import torch

# One side stream per CUDA device, shared by every layer: consecutive layers' shared experts are
# ordered anyway (each waits for its own input on the current stream).
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of CUDA ``device`` (created on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


class SharedBranch:
    """A started shared-expert branch: :meth:`join` gives its output on the current stream."""

    def __init__(self, out: torch.Tensor, stream: torch.cuda.Stream | None):
        self._out = out
        self._stream = stream

    @property
    def overlapped(self) -> bool:
        """Whether the branch runs on a side stream (False: it already ran inline)."""
        return self._stream is not None

    def join(self) -> torch.Tensor:
        """The branch's output, safe to use on the current stream (which now waits for it)."""
        out, stream = self._out, self._stream
        if stream is not None:
            current = torch.cuda.current_stream(out.device)
            current.wait_stream(stream)
            out.record_stream(current)
            self._stream = None
        return out


def start(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor, overlap: bool = True) -> SharedBranch:
    """Start ``fn(*inputs)`` (→ one tensor) on the side stream of the inputs' CUDA device, or run
    it now where there is nothing to overlap (CPU tensors, ``overlap=False``, under
    ``torch.compile``). Call :meth:`SharedBranch.join` before using the output."""
    first = inputs[0]
    if not overlap or not first.is_cuda or torch.compiler.is_compiling():
        return SharedBranch(fn(*inputs), None)
    current = torch.cuda.current_stream(first.device)
    stream = side_stream(first.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        out = fn(*inputs)
    for tensor in inputs:
        tensor.record_stream(stream)
    return SharedBranch(out, stream)
