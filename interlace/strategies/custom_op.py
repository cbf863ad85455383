"""A strategy call as one opaque ``torch.library`` custom op, so a layer compiles with
``torch.compile(fullgraph=True)``.

Eagerly the layer calls its strategy directly (:func:`run_strategy` adds one function call).
Under ``torch.compile`` the whole call ``strategy(x, topk_idx, topk_weight, w_up, w_down)``
becomes the op ``interlace::moe_experts``: Dynamo does not trace the strategy's Python logic,
its host-side split sizes or ``torch._grouped_mm`` (whose fake implementation and data-dependent
offsets stop the compiler); the router, the shared expert and everything around the layer stay
ordinary compiled torch code. The op runs the strategy eagerly, exactly as an eager call would.

Forward and backward, without recomputing the forward:

* ``moe_experts(x, topk_idx, topk_weight, w_up, w_down, strategy_key, needs_grad, scales)`` →
  ``(out (T, N) x.dtype, handle (1,) int64 CPU)``. ``strategy_key`` is the strategy's
  ``op_key``, a (1,) int64 CPU tensor naming it in a weak table
  (:func:`interlace.strategies.base.strategy_by_key`): an op takes tensors and numbers, not
  objects, and a tensor (not an int, whose value the compiler would guard) lets layers compiled
  one by one share one graph. ``needs_grad`` says which of (x, topk_weight, w_up, w_down) want a
  gradient, decided where the layer is traced (grad mode and ``requires_grad``). When one does,
  the op runs the strategy on detached leaves with autograd recording, and keeps that eager
  autograd graph (its output and leaves) in a :class:`_SavedCall` that the ``handle`` tensor's
  storage owns (``torch.frombuffer`` holds its buffer object for the storage's lifetime).
* The registered autograd saves ``handle`` for backward, and the forward's inputs, which the
  kept graph may read (compiled code would otherwise reuse their buffers once the forward no
  longer reads them); its backward is the op
  ``interlace::moe_experts_backward(handle, grad_out, ...)``, which finds the call by the key
  written in the handle, runs the autograd engine through the kept graph once (what
  ``torch.autograd.grad`` calls, without its Python argument checks) and drops it.

Why this is correct:

* Handles: each forward writes a fresh key into its own handle, so several layers and several
  micro-batches in flight each find their own graph; the key table holds the calls weakly.
* No leak: the graph lives exactly as long as the handle's storage. The compiled forward saves
  the handle for backward only; when the outer autograd graph is freed without a backward (an
  evaluation loss, an exception) the saved handle dies and the call's graph with it. After its
  backward the call drops its graph at once (as eager autograd frees saved tensors).
* A second backward through the same forward (``retain_graph=True``) raises a clear
  ``RuntimeError``, as does differentiating the backward (double backward: the backward op's own
  autograd raises; ``torch.compile`` refuses ``create_graph=True`` before that).
* Gradients: those of x, topk_weight (the routing weights: the router gets its gradient through
  them), w_up and w_down, the strategy's own backward's; what the strategy leaves without a
  gradient is zeros. Memory: the kept graph holds what the strategy's eager graph holds, plus
  ``x`` and ``topk_idx`` themselves (x, an autograd leaf here, the router's GEMM saves for its
  backward anyway where the router trains).
* The op's output is the strategy's output tensor (no copy): compiled code may reuse its buffer
  in place, which is safe because no strategy's backward reads its own output (each node saves
  its inputs). A strategy that saved its output would have to return a copy.
* ``torch.compile``'s CUDA graphs (``mode="reduce-overhead"``) skip a graph with this op (its
  handle lives on the host); ``fused`` replays its own CUDA graphs inside the op.
* FP8 experts (:class:`~interlace.fp8.BlockFP8Weight`): the op takes the e4m3 weights as
  ``w_up``/``w_down`` and their block scales as ``scales`` (an op takes tensors, not objects) and
  hands the strategy the pairs again. Inference only: a call that wants a gradient raises there.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import Tensor

from interlace import op_keys
from interlace.fp8 import BlockFP8Weight
from interlace.strategies.base import Strategy, outside_inference_mode, strategy_by_key

_CALL_KEYS = itertools.count(1)
_PENDING: weakref.WeakValueDictionary[int, _SavedCall] = weakref.WeakValueDictionary()

# The custom-op machinery calls an implementation below autograd: these keys are excluded in
# the thread's dispatch state, so the strategy's ops would record no graph. The op's two
# implementations lift the exclusion for the strategy's forward and its backward (torch has no
# public switch for it; these dispatcher calls exist in every torch ≥ 2.11). Autocast stays off
# inside, as below any op: the layer runs in config.dtype and its strategies never rely on it.
_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
                  torch._C.DispatchKey.AutogradNestedTensor)


class _AutogradRecording:
    """Lifts the exclusion for the block and turns grad mode on (a plain class: the op runs it on
    every call, and a generator-based context manager costs several times more)."""

    __slots__ = ("excluded", "grad")

    def __enter__(self):
        self.excluded = [k for k in _AUTOGRAD_KEYS if _is_excluded(k)]
        for key in self.excluded:
            _set_excluded(key, False)
        self.grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(True)

    def __exit__(self, *exc):
        torch._C._set_grad_enabled(self.grad)
        for key in self.excluded:
            _set_excluded(key, True)


_is_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_set_excluded = torch._C._dispatch_tls_set_dispatch_key_excluded


def _run_backward(out: Tensor, leaves: tuple[Tensor, ...], grad_out: Tensor) -> tuple[Tensor | None, ...]:
    """``torch.autograd.grad(out, leaves, grad_out, allow_unused=True)`` without its Python
    argument handling (the op's fake implementation fixed the shapes and dtypes already): the
    engine call that ``torch.autograd.grad`` ends in."""
    return _ENGINE.run_backward((out,), (grad_out,), False, False, leaves, True, False)


_ENGINE = torch.autograd.Variable._execution_engine


class _SavedCall(bytearray):
    """One forward's eager autograd graph: ``out`` and the ``leaves`` it is differentiated
    against. A bytearray (8 bytes: the call's key) so that a tensor's storage can own it."""

    out: Tensor | None = None
    leaves: tuple[Tensor, ...] | None = None


# This module's ops are registered with torch.library's low-level API, not ``torch.library.custom_op``:
# a compiled step calls them once per layer each, and custom_op's generic wrappers (its autograd
# kernel's metadata, the redispatch and output-aliasing checks in Python, a Dynamo-disable
# wrapper) cost about as much host time again as the calls themselves. Here an eager call is
# one Python kernel below autograd, plus the thin autograd kernel at the top.
_LIB = torch.library.Library("interlace", "FRAGMENT")
_LIB.define("moe_experts(Tensor x, Tensor topk_idx, Tensor topk_weight, Tensor w_up, Tensor w_down, "
            "Tensor strategy_key, bool[] needs_grad, Tensor[] scales) -> (Tensor, Tensor)",
            tags=(torch.Tag.pt2_compliant_tag,))
_LIB.define("moe_experts_backward(Tensor handle, Tensor grad_out, Tensor x, Tensor topk_idx, Tensor topk_weight, "
            "Tensor w_up, Tensor w_down, bool[] needs_grad) -> Tensor[]", tags=(torch.Tag.pt2_compliant_tag,))
_MOE_EXPERTS = torch.ops.interlace.moe_experts.default
_MOE_EXPERTS_BACKWARD = torch.ops.interlace.moe_experts_backward.default


def _moe_experts_impl(x: Tensor, topk_idx: Tensor, topk_weight: Tensor, w_up: Tensor, w_down: Tensor,
                      strategy_key: Tensor, needs_grad: list[bool], scales: list[Tensor]) -> tuple[Tensor, Tensor]:
    """``interlace::moe_experts``: x (T, N), topk_idx (T, k) int64, topk_weight (T, k), w_up
    (E_local, up_width, N), w_down (E_local, N, K), strategy_key (1,) int64 on the CPU, ``scales``:
    [] for dense weights, or FP8 weights' block scales [w_up's, w_down's] → out (T, N) in x.dtype,
    handle (1,) int64 on the CPU."""
    strategy = strategy_by_key(strategy_key.item())
    if scales:
        if any(needs_grad):
            raise RuntimeError(FP8_TRAINING)
        w_up, w_down = BlockFP8Weight(w_up, scales[0]), BlockFP8Weight(w_down, scales[1])
    key = next(_CALL_KEYS)
    saved = _SavedCall(key.to_bytes(8, "little", signed=True))
    handle = torch.frombuffer(saved, dtype=torch.int64)
    if not any(needs_grad):
        with outside_inference_mode():
            return strategy(x, topk_idx, topk_weight, w_up, w_down).contiguous(), handle
    x, topk_weight, w_up, w_down = (t.detach().requires_grad_(need)
                                    for t, need in zip((x, topk_weight, w_up, w_down), needs_grad))
    with _AutogradRecording():
        out = strategy(x, topk_idx, topk_weight, w_up, w_down)
    saved.out, saved.leaves = out, tuple(t for t in (x, topk_weight, w_up, w_down) if t.requires_grad)
    _PENDING[key] = saved
    return out.detach().contiguous(), handle


def _moe_experts_fake(x, topk_idx, topk_weight, w_up, w_down, strategy_key, needs_grad, scales):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty(1, dtype=torch.int64)


def _moe_experts_backward_impl(handle: Tensor, grad_out: Tensor, x: Tensor, topk_idx: Tensor, topk_weight: Tensor,
                               w_up: Tensor, w_down: Tensor, needs_grad: list[bool]) -> list[Tensor]:
    """``interlace::moe_experts_backward``: the gradients of the ``moe_experts`` call that returned
    ``handle``, for the inputs ``needs_grad`` names, in (x, topk_weight, w_up, w_down) order. The
    forward's inputs are passed only to keep their buffers intact until here: the kept graph may
    read them (the Triton expert kernels save ``x`` itself), and compiled code reuses a buffer in
    place once no op of its graph reads it any more. ``topk_weight``, ``w_up`` and ``w_down`` also
    give their shapes to the fake implementation."""
    key = handle.item()
    saved = _PENDING.pop(key, None)
    if saved is None or saved.out is None:
        raise RuntimeError("interlace: a second backward through one compiled MoE layer call (retain_graph=True "
                           "is not supported: the call's autograd graph is freed by its first backward); run the "
                           "forward again")
    out, leaves = saved.out, saved.leaves
    saved.out = saved.leaves = None  # freed now, as eager autograd frees a graph after its backward
    if out.requires_grad:
        with _AutogradRecording():
            grads = _run_backward(out, leaves, grad_out)
    else:
        grads = (None,) * len(leaves)
    return [torch.zeros_like(leaf) if g is None else g.contiguous() for g, leaf in zip(grads, leaves)]


def _moe_experts_backward_fake(handle, grad_out, x, topk_idx, topk_weight, w_up, w_down, needs_grad):
    likes = (grad_out, topk_weight, w_up, w_down)
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t, need in zip(likes, needs_grad) if need]


class _MoEExperts(torch.autograd.Function):
    """The op's autograd: saves ``handle`` for backward, and the forward's inputs, which the kept
    graph may read (compiled code would otherwise reuse their buffers once the forward no longer
    reads them; measured: inductor wrote a later result over x's buffer, and the expert gradients
    of sequential:triton came out wrong, where no other op saved x). Its backward is the op
    ``moe_experts_backward``."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weight, w_up, w_down, strategy_key, needs_grad, scales):
        with torch._C._AutoDispatchBelowAutograd():
            out, handle = _MOE_EXPERTS(x, topk_idx, topk_weight, w_up, w_down, strategy_key, needs_grad, scales)
        ctx.needs_grad = list(needs_grad)
        ctx.mark_non_differentiable(handle)
        ctx.save_for_backward(handle, x, topk_idx, topk_weight, w_up, w_down)
        return out, handle

    @staticmethod
    def backward(ctx, grad_out, _grad_handle):
        handle, x, topk_idx, topk_weight, w_up, w_down = ctx.saved_tensors
        grads = iter(_MOE_EXPERTS_BACKWARD(handle, grad_out, x, topk_idx, topk_weight, w_up, w_down, ctx.needs_grad))
        dx, dweight, dup, ddown = (next(grads) if need else None for need in ctx.needs_grad)
        return dx, None, dweight, dup, ddown, None, None, None


def _moe_experts_autograd(x, topk_idx, topk_weight, w_up, w_down, strategy_key, needs_grad, scales):
    if torch.is_grad_enabled() and torch._C._any_requires_grad(x, topk_weight, w_up, w_down):
        return _MoEExperts.apply(x, topk_idx, topk_weight, w_up, w_down, strategy_key, needs_grad, scales)
    with torch._C._AutoDispatchBelowAutograd():  # a compiled graph's calls (it runs without grad)
        return _MOE_EXPERTS(x, topk_idx, topk_weight, w_up, w_down, strategy_key, needs_grad, scales)


class _NoDoubleBackward(torch.autograd.Function):
    """The backward op called with grad mode on (``create_graph=True``): its gradients, whose own
    backward raises."""

    @staticmethod
    def forward(ctx, *args):
        with torch._C._AutoDispatchBelowAutograd():
            return tuple(_MOE_EXPERTS_BACKWARD(*args))

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("interlace: double backward (create_graph=True) through a compiled MoE layer is not "
                           "supported")


def _moe_experts_backward_autograd(handle, grad_out, x, topk_idx, topk_weight, w_up, w_down, needs_grad):
    args = (handle, grad_out, x, topk_idx, topk_weight, w_up, w_down, needs_grad)
    if torch.is_grad_enabled() and torch._C._any_requires_grad(*args[1:7]):
        return list(_NoDoubleBackward.apply(*args))
    with torch._C._AutoDispatchBelowAutograd():
        return _MOE_EXPERTS_BACKWARD(*args)


_LIB.impl("moe_experts", _moe_experts_impl, "CompositeExplicitAutograd")
_LIB.impl("moe_experts", _moe_experts_autograd, "Autograd")
_LIB.impl("moe_experts_backward", _moe_experts_backward_impl, "CompositeExplicitAutograd")
_LIB.impl("moe_experts_backward", _moe_experts_backward_autograd, "Autograd")
torch.library.register_fake("interlace::moe_experts", _moe_experts_fake, lib=_LIB)
torch.library.register_fake("interlace::moe_experts_backward", _moe_experts_backward_fake, lib=_LIB)


# An inference call handed over with its router (a ``routes_itself`` strategy: ``persistent``,
# ``auto``), as an eager layer hands it: the strategy may route inside its kernel. Inference only
# (the layer calls it where no gradient is wanted), so no autograd kernel.
_LIB.define("moe_routed(Tensor x, Tensor w_up, Tensor w_down, Tensor strategy_key, Tensor router_key, "
            "Tensor[] scales, Tensor[] router_tensors) -> Tensor", tags=(torch.Tag.pt2_compliant_tag,))
_MOE_ROUTED = torch.ops.interlace.moe_routed.default


def _moe_routed_impl(x: Tensor, w_up: Tensor, w_down: Tensor, strategy_key: Tensor, router_key: Tensor,
                     scales: list[Tensor], router_tensors: list[Tensor]) -> Tensor:
    """``interlace::moe_routed``: x (T, N) → (T, N) in x.dtype, the layer's eager inference path
    from the router on: the strategy's agreement with its peers, then its kernel's routing where it
    takes the call (``routes_call``), else the router and the strategy. ``router_tensors``: the
    router's weight (and bias), inputs only so that compiled code orders the call after any
    change of them; the router itself is found by ``router_key`` (interlace.op_keys)."""
    strategy = strategy_by_key(strategy_key.item())
    router = op_keys.lookup(router_key.item(), "router")
    with outside_inference_mode():
        routed = router.op_may_route() and strategy.routes_call(x, router, w_up, w_down)
        routed = strategy.begin_call(x.shape[0], False, routed)
        if scales:
            w_up, w_down = BlockFP8Weight(w_up, scales[0]), BlockFP8Weight(w_down, scales[1])
        if routed:
            return strategy.forward_layer(x, router, w_up, w_down).contiguous()
        topk_idx, topk_weight = router.op_route(x, strategy.fused_routing)
        return strategy(x, topk_idx, topk_weight, w_up, w_down).contiguous()


def _moe_routed_fake(x, w_up, w_down, strategy_key, router_key, scales, router_tensors):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_LIB.impl("moe_routed", _moe_routed_impl, "CompositeExplicitAutograd")
torch.library.register_fake("interlace::moe_routed", _moe_routed_fake, lib=_LIB)


def run_routed(strategy: Strategy, router, x: Tensor, w_up: Tensor, w_down: Tensor,
               scales: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """A compiled inference call handed over with ``router``: the op ``interlace::moe_routed``.
    Shapes as :func:`strategy_op`. ``router``: what a strategy's ``forward_layer`` takes (``weight``,
    ``expert_bias``; :class:`~interlace.routing.Router`, or interlace.hf's ``KernelRouter``), plus
    ``op_key`` (interlace.op_keys), ``op_tensors()`` (the tensors its routing reads),
    ``op_may_route()`` (whether the kernel may route this call) and ``op_route(x, fused)`` → (topk_idx,
    topk_weight) (the layer's own routing, where the strategy does not take the call)."""
    return _MOE_ROUTED(x, w_up, w_down, strategy.op_key, router.op_key, list(scales or ()), router.op_tensors())


FP8_TRAINING = ("FP8 experts are inference-only: this call would build an autograd graph (grad mode is on and the "
                "input or a parameter requires grad); wrap the call in torch.no_grad() or torch.inference_mode(), "
                "or freeze the layer (layer.requires_grad_(False)) and pass an input without requires_grad")


def strategy_op(strategy: Strategy, x: Tensor, topk_idx: Tensor, topk_weight: Tensor, w_up: Tensor,
                w_down: Tensor, scales: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """``strategy(x, topk_idx, topk_weight, w_up, w_down)`` through the custom op (what a
    compiled layer runs; callable eagerly too, e.g. by tests). Shapes as :class:`Strategy`;
    ``scales``: FP8 weights' block scales (w_up's, w_down's), the weights then e4m3."""
    key = getattr(strategy, "op_key", None)
    if key is None:
        raise TypeError(f"strategy {type(strategy).__name__} has no op_key: its __init__ must call "
                        f"Strategy.__init__ (the compiled layer finds strategies by that key)")
    grad = torch.is_grad_enabled()
    needs_grad = [grad and t.requires_grad for t in (x, topk_weight, w_up, w_down)]
    out, _handle = _MOE_EXPERTS(x, topk_idx, topk_weight, w_up, w_down, key, needs_grad, list(scales or ()))
    return out


def run_strategy(strategy: Strategy, x: Tensor, topk_idx: Tensor, topk_weight: Tensor, w_up: Tensor,
                 w_down: Tensor, scales: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """The layer's strategy call: the strategy itself eagerly, :func:`strategy_op` while
    ``torch.compile`` traces (Dynamo then sees one op instead of the strategy's Python).
    ``scales``: FP8 weights' block scales (w_up's, w_down's; ``w_up``, ``w_down`` are then the
    e4m3 tensors): the strategy gets :class:`~interlace.fp8.BlockFP8Weight` pairs."""
    if torch.compiler.is_compiling():
        return strategy_op(strategy, x, topk_idx, topk_weight, w_up, w_down, scales)
    if scales is not None:
        w_up, w_down = BlockFP8Weight(w_up, scales[0]), BlockFP8Weight(w_down, scales[1])
    return strategy(x, topk_idx, topk_weight, w_up, w_down)
