"""The expert FFN's backward on the Triton kernels: d(pre-activation), dW_down, dW_up, dx_rows.

From dy (R, N) in expert-major order, the stored pre-activation h (R, up_width) and the
activations act (R, K) of the forward (:func:`interlace.kernels.expert_gemm.forward.expert_ffn_triton`):

1. d_h = act'(h) ⊙ (dy @ W_down[e]) — :func:`launch_d_pre_act`, the derivative in the GEMM's
   epilogue, or (SwiGLU, ``unfused_act``) in one elementwise pass after a plain GEMM;
2. dW_down[e] = dyᵀ act over the expert's rows (:func:`interlace.kernels.expert_gemm.wgrad.launch_wgrad`);
3. dW_up[e] = d_hᵀ x[g] over a gathered copy of x's rows (:func:`launch_dw_up`);
4. dx_rows = d_h @ W_up[e] (the grouped GEMM).

``dx_rows[r]`` is the gradient of the input row that row r read; returning it to x (a gather or
a fixed-order sum) is the caller's deterministic job (:class:`~interlace.kernels.expert_gemm.autograd.TritonExpertFFN`).
"""

from __future__ import annotations

import torch

from interlace.kernels import alloc
from interlace.kernels.expert_gemm.configs import ExpertKernelOptions, choose_backward_configs
from interlace.kernels.expert_gemm.grouped import launch_gemm
from interlace.kernels.expert_gemm.schedule import TileSchedule, tile_schedule
from interlace.kernels.expert_gemm.tile import ACTIVATION_ID
from interlace.kernels.expert_gemm.wgrad import launch_wgrad
from interlace.kernels.tma import ensure_allocator, use_tma
from interlace.tuning.tables import GemmConfig


def launch_d_pre_act(dy, w_down, d_h, h, ends, R, N, K, activation, config: GemmConfig, sched: TileSchedule,
                     tma: bool) -> torch.Tensor:
    """d_h (R, up_width) = act'(h) ⊙ (dy (R, N) @ W_down[e] (N, K)) per expert. By default the
    derivative runs in the GEMM's epilogue. ``config.unfused_act`` (SwiGLU): the GEMM stores
    d(act) plainly and one elementwise pass applies the derivative — the fused epilogue's two h
    loads and two stores per tile are not overlapped with the short main loop of this K = hidden
    reduction, and can cost more than the pass's extra R·K round trip."""
    if config.unfused_act and activation == "swiglu":
        from interlace.kernels.activation import swiglu_backward

        d_act = alloc.empty((R, K), dy.dtype, dy.device)
        launch_gemm(dy, w_down, d_act, None, ends, R, cols=K, red=N, b_trans=False, epilogue=0, config=config,
                    schedule=sched, tma=tma)
        return swiglu_backward(h, d_act, out=d_h)
    return launch_gemm(dy, w_down, d_h, h, ends, R, cols=K, red=N, b_trans=False,
                       epilogue=1 + ACTIVATION_ID[activation], config=config, schedule=sched, tma=tma)


def launch_dw_up(d_h, x, gather, divisor, out, ends, P, Q, config: GemmConfig, tma: bool = False) -> torch.Tensor:
    """dW_up = d_hᵀ x[gather // divisor] per expert. x's rows are gathered into a contiguous
    buffer first: an indirect load along the reduction is far slower than the weight-gradient
    kernel on contiguous rows, and one gather copy of x's rows (R × N) costs far less."""
    if gather is not None:
        from interlace.kernels.rows import gather_rows

        x = gather_rows(x, gather[: d_h.shape[0]], divisor)  # entries past R are unspecified
    return launch_wgrad(d_h, x, out, ends, P, Q, config, tma=tma)


def expert_ffn_triton_backward(dy, x, gather, divisor, w_up, w_down, ends, activation, h, act,
                               configs: tuple[GemmConfig, GemmConfig, GemmConfig] | None = None,
                               schedule: TileSchedule | None = None, options: ExpertKernelOptions | None = None):
    """Gradients of :func:`~interlace.kernels.expert_gemm.forward.expert_ffn_triton` from dy (R, N)
    in expert-major order.

    Returns ``(dx_rows (R, N), dw_up, dw_down)``: ``dx_rows[r]`` is the gradient of the input
    row that row r read (``x[gather[r] // divisor]``); summing or permuting it back to x is the
    caller's (deterministic) job. Four kernels (:func:`backward_steps`). ``configs`` =
    (d(pre-activation) GEMM, dx GEMM, wgrad) forces the configs (the tuner); else ``options``
    and the tuning tables choose them (:func:`~interlace.kernels.expert_gemm.configs.choose_backward_configs`).
    ``schedule``: the forward's tile schedule of these rows, reused where the tile heights match.
    """
    outputs, steps = backward_steps(dy, x, gather, divisor, w_up, w_down, ends, activation, h, act, configs,
                                    schedule, options)
    for _, _, run_step in steps:
        run_step()
    return tuple(outputs)


def backward_steps(dy, x, gather, divisor, w_up, w_down, ends, activation, h, act,
                   configs: tuple[GemmConfig, GemmConfig, GemmConfig] | None = None,
                   schedule: TileSchedule | None = None, options: ExpertKernelOptions | None = None):
    """The backward's outputs ``[dx_rows, dw_up, dw_down]`` (a list: the weight gradients
    allocated, not yet written; ``dx_rows`` set by its step) and its kernels in order as
    ``(name, FLOPs, launch)`` (the bench times them one by one).

    dW_up runs before dx and dx_rows is allocated at its step: dW_up reads a gathered copy of
    x's rows (R × N), which is freed before dx_rows (R × N) exists, so the two never coexist
    (R × N is 1.9 GB at dsv3-like 16384 tokens)."""
    R, N = dy.shape
    E, up_width, _ = w_up.shape
    K = w_down.shape[2]
    c_act, c_dx, c_w = configs if configs is not None else choose_backward_configs(dy, w_down, R, activation,
                                                                                   options)[:3]
    dw_up = alloc.empty(w_up.shape, w_up.dtype, w_up.device)
    dw_down = alloc.empty(w_down.shape, w_down.dtype, w_down.device)
    outputs = [None, dw_up, dw_down]
    if R == 0:
        return [alloc.empty((R, N), dy.dtype, dy.device), dw_up.zero_(), dw_down.zero_()], []
    d_h = alloc.empty((R, up_width), dy.dtype, dy.device)
    dy = dy.contiguous()
    tma = use_tma(w_up, w_down, force=options.tma if options is not None else None)
    if tma:
        ensure_allocator()
    # The forward's schedule if it has these tiles: one launch and allocation less (host time).
    reuse = schedule is not None and schedule.block_m == c_act.block_m
    sched = schedule if reuse else tile_schedule(ends, R, c_act.block_m)
    sched_dx = sched if c_dx.block_m == c_act.block_m else tile_schedule(ends, R, c_dx.block_m)

    def dx_step():
        # dx_rows = d_h @ W_up[e]  (W_up[e] is (up, N) row-major)
        outputs[0] = alloc.empty((R, N), dy.dtype, dy.device)
        launch_gemm(d_h, w_up, outputs[0], None, ends, R, cols=N, red=up_width, b_trans=False, epilogue=0,
                    config=c_dx, schedule=sched_dx, tma=tma)

    steps = [
        # d_act = dy @ W_down[e]  (W_down[e] is (N, K) row-major) → d_h through the activation
        ("d_pre_act", 2 * R * N * K, lambda: launch_d_pre_act(dy, w_down, d_h, h, ends, R, N, K, activation, c_act,
                                                              sched, tma)),
        ("dw_down", 2 * R * N * K, lambda: launch_wgrad(dy, act, dw_down, ends, N, K, c_w, tma=tma)),  # dyᵀ act
        ("dw_up", 2 * R * up_width * N,  # d_hᵀ x[g]
         lambda: launch_dw_up(d_h, x, gather, divisor, dw_up, ends, up_width, N, c_w, tma)),
        ("dx", 2 * R * up_width * N, dx_step),
    ]
    return outputs, steps
