"""CUDA-graph recording for the fused strategy's calls (inference and ``fused:train``).

:class:`CudaGraphRecorder` captures a call's device work once and replays it; the outputs of
the capture are static buffers that every replay rewrites. Collectives stay out of the graphs
(:func:`collective`): see the recorder's docstring. :class:`EagerRecorder` keeps the same
static-buffer contract without CUDA, so the logic that depends on it is tested on the CPU.
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import torch


_CAPTURING = threading.local()  # .recorder: the CudaGraphRecorder capturing on this thread


def collective(fn) -> None:
    """Run the collective ``fn()`` now, or, while a :class:`CudaGraphRecorder` captures on this
    thread, make it a step of the recording that every replay runs eagerly (its tensors must
    exist before the call and stay the same; the strategy's bodies pass them in)."""
    recorder = getattr(_CAPTURING, "recorder", None)
    if recorder is None:
        fn()
    else:
        recorder.cut(fn)


class CudaGraphRecorder:
    """Captures ``fn()`` once; its outputs become static buffers that every :meth:`replay`
    rewrites in place. Capture records without running: replay after it.

    Collectives (:func:`collective`) stay out of the graphs: the recording is a list of CUDA
    graph segments sharing one memory pool, with each collective run eagerly between two of
    them. A graph that captured an NCCL collective keeps ``ncclCommDestroy`` waiting for as long
    as it lives (pytorch/pytorch#115388; 2× H200, docs/benchmarks.md run 151), so
    ``destroy_process_group()`` would hang while any layer holds one."""

    def __init__(self, new_graph=None, new_pool=None):
        self._new_graph = new_graph or torch.cuda.CUDAGraph  # tests pass fakes
        self._new_pool = new_pool or torch.cuda.graph_pool_handle
        self.steps: list = []  # ("graph", CUDAGraph) | ("host", callable), in replay order

    def capture(self, fn, device):
        self.steps, self._pool = [], self._new_pool()
        if self._new_graph is torch.cuda.CUDAGraph:
            torch.cuda.synchronize(device)  # a capture syncs once (the first graph call of a token count)
            stream = torch.cuda.Stream(device)  # capture is not allowed on the default stream
            stream.wait_stream(torch.cuda.current_stream(device))
            context = torch.cuda.stream(stream)
        else:
            stream, context = None, contextlib.nullcontext()
        with context:
            self._begin()
            _CAPTURING.recorder = self
            try:
                out = fn()
            finally:
                _CAPTURING.recorder = None
                self._end()
        if stream is not None:
            torch.cuda.current_stream(device).wait_stream(stream)
        return out

    def _begin(self) -> None:
        self._graph = self._new_graph()
        if self._new_graph is torch.cuda.CUDAGraph:
            # "thread_local": a call another thread makes meanwhile (NCCL's watchdog querying
            # the events of an eager collective) must not invalidate this capture.
            self._graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
        else:
            self._graph.capture_begin(pool=self._pool)

    def _end(self) -> None:
        with warnings.catch_warnings():  # a segment of a rank with no tokens may hold no kernel
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            self._graph.capture_end()
        self.steps.append(("graph", self._graph))

    def cut(self, fn) -> None:
        """End the current segment, record ``fn`` as an eager step, start the next segment."""
        self._end()
        self.steps.append(("host", fn))
        self._begin()

    def replay(self) -> None:
        for kind, step in self.steps:
            if kind == "graph":
                step.replay()
            else:
                step()


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
