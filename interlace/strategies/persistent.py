"""``persistent``: the whole MoE layer in one persistent Triton launch (issue 30, phase 1: world
size 1).

An inference call runs gate (router logits, top-k, weights) → dispatch index → GEMM0 +
activation → GEMM1 → combine as tasks of one kernel (:mod:`interlace.kernels.persistent`): one
launch and no host sync per call, so decode-sized calls are not bound by the host's launches.
The router runs inside the kernel, so the layer hands this strategy the router's weights
(:meth:`PersistentStrategy.forward_layer`) instead of routing itself first.

What runs ``sequential``'s path instead (the layer routes, then :meth:`__call__`):
* training calls (grad enabled and the input or a weight requires grad; the kernel has no
  backward yet), and calls in training mode with a balance loss (it needs the logits);
* calls with user-given ``expert_indices``;
* calls traced by ``torch.compile`` (the kernel is not a custom op yet).

Refused in this phase, each with a one-line ``ValueError`` when the strategy is built (before any
weight): world size > 1, a capacity factor (dropless only), group-limited routing
(``n_group``/``topk_group``), ``softmax_after_topk``, fp64 tensors or an fp64 router, fp16
activations with ``router_gemm="input"``.

Errors: a bounded wait that times out leaves an error record on the device; on CUDA it is copied
to the host behind the call (no sync) and raised at a later call once the copy has landed, or
by :meth:`PersistentStrategy.synchronize_and_check`; on the CPU (interpreter) at once.

Options (``strategy_options``): ``kernel`` (a
:class:`~interlace.kernels.persistent.launch.PersistentKernelConfig`), ``max_spins`` (polls
before a wait gives up), ``task_order`` (``"normal"``; ``"combine_first"`` breaks the order on
purpose, for tests).
"""

from __future__ import annotations

import torch

from interlace.kernels.persistent.launch import (
    DEFAULT_SPINS, PersistentKernelConfig, PersistentState, persistent_moe, router_pieces,
)
from interlace.kernels.persistent.tasks import TASK_ORDERS, describe_error
from interlace.strategies.base import Strategy, register_strategy
from interlace.strategies.sequential import SequentialStrategy


def unsupported(config, world: int) -> str | None:
    """Why phase 1 of the persistent kernel cannot run this layer, in one line, or None."""
    if world > 1:
        return "persistent: world size 1 only in this phase (issue 30)"
    if config.capacity_factor is not None:
        return "persistent: dropless only in this phase (capacity_factor must be None; issue 30)"
    if config.group_limited:
        return "persistent: group-limited routing (n_group/topk_group) is not in the kernel's gate yet (issue 30)"
    if config.softmax_after_topk:
        return "persistent: softmax_after_topk is not in the kernel's gate yet (issue 30)"
    if config.dtype not in (torch.bfloat16, torch.float16, torch.float32) or config.router_dtype != torch.float32:
        return (f"persistent: bf16/fp16/fp32 tensors and an fp32 router only (got dtype {config.dtype}, "
                f"router_dtype {config.router_dtype})")
    if config.dtype == torch.float16 and config.router_gemm == "input":
        return "persistent: router_gemm='input' with fp16 activations is not in the kernel's gate (use 'split')"
    return None


@register_strategy
class PersistentStrategy(Strategy):
    name = "persistent"
    fused_routing = True
    needs_triton = True
    routes_itself = True

    def __init__(self, config, ep, kernel: PersistentKernelConfig | None = None, max_spins: int = DEFAULT_SPINS,
                 task_order: str = "normal"):
        super().__init__(config, ep)
        reason = unsupported(config, ep.world)
        if reason:
            raise ValueError(reason)
        if kernel is not None and not isinstance(kernel, PersistentKernelConfig):
            raise TypeError(f"strategy option 'kernel' must be a PersistentKernelConfig, got {type(kernel).__name__}")
        if isinstance(max_spins, bool) or not isinstance(max_spins, int) or max_spins < 0:
            raise ValueError(f"strategy option 'max_spins' must be an int >= 0, got {max_spins!r}")
        if task_order not in TASK_ORDERS:
            raise ValueError(f"strategy option 'task_order' must be one of {TASK_ORDERS}, got {task_order!r}")
        self.kernel = kernel or PersistentKernelConfig()
        self.max_spins = max_spins
        self.task_order = task_order
        self.fallback = SequentialStrategy(config, ep)
        self.state = PersistentState()
        self._record_host: torch.Tensor | None = None  # pinned copy of the error record (CUDA)
        self._record_event = None

    def routes_call(self, x: torch.Tensor, router, w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
        """Whether this call runs the kernel (routing inside) rather than ``sequential``'s path:
        not when it builds an autograd graph (see the module)."""
        if not torch.is_grad_enabled():
            return True
        return not (x.requires_grad or router.weight.requires_grad or w_up.requires_grad or w_down.requires_grad)

    def forward_layer(self, x: torch.Tensor, router, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        """x (T, N) → (T, N) in x's dtype: routing by ``router`` (its ``weight`` (E, N) fp32 and
        ``expert_bias`` (E,) or None) and the experts ``w_up`` (E, up_width, N), ``w_down``
        (E, N, K), in one launch."""
        self._raise_landed_error()
        cfg = self.config
        out = persistent_moe(
            x, router.weight.detach(), router.expert_bias, w_up.detach(), w_down.detach(), self.state,
            top_k=cfg.top_k, softmax=cfg.router == "softmax", renormalize=cfg.renormalize,
            route_scale=cfg.route_scale, activation=cfg.activation, w_pieces=router_pieces(x.dtype, cfg.router_gemm),
            config=self.kernel, max_spins=self.max_spins, order=self.task_order,
        )
        self._fetch_error_record()
        return out

    def __call__(self, x, topk_idx, topk_weight, w_up, w_down):
        """Routing given by the layer (training, forced indices, compiled): ``sequential``."""
        return self.fallback(x, topk_idx, topk_weight, w_up, w_down)

    # ---- error records ---------------------------------------------------------------------
    def _fetch_error_record(self) -> None:
        record = self.state.error_record()
        if record is None:
            return
        if record.device.type != "cuda":
            self.state.check()  # (CPU: reading it costs nothing)
            return
        if torch.cuda.is_current_stream_capturing():
            return  # (inside a caller's CUDA-graph capture: synchronize_and_check after replays)
        if self._record_event is not None and not self._record_event.query():
            return  # the last copy is still on its way; the record stays set until raised
        if self._record_host is None:
            self._record_host = torch.empty(record.numel(), dtype=record.dtype, pin_memory=True)
        self._record_host.copy_(record, non_blocking=True)
        self._record_event = torch.cuda.Event()
        self._record_event.record()

    def _raise_landed_error(self) -> None:
        if self._record_event is None or torch.cuda.is_current_stream_capturing() or not self._record_event.query():
            return
        self._record_event = None
        message = describe_error(self._record_host.tolist())
        if message:
            self.state.error_record().zero_()
            raise RuntimeError(message)

    def synchronize_and_check(self) -> None:
        """Wait for the device and raise ``RuntimeError`` if a call's wait timed out."""
        if self.state.buffer is not None and self.state.buffer.is_cuda:
            torch.cuda.synchronize(self.state.buffer.device)
        self._record_event = None
        self.state.check()
