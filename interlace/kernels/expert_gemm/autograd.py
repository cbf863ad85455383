"""The expert block as an autograd Function on the Triton kernels (forward and backward)."""

from __future__ import annotations

import torch

from interlace.kernels.expert_gemm.backward import expert_ffn_triton_backward
from interlace.kernels.expert_gemm.configs import ExpertKernelOptions
from interlace.kernels.expert_gemm.forward import expert_ffn_triton
from interlace.kernels.rows import use_triton


def supports(x: torch.Tensor, w_up: torch.Tensor) -> bool:
    """The Triton expert path runs on CUDA (or the interpreter) for bf16/fp16/fp32."""
    return use_triton(x) and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and w_up.dtype == x.dtype


class TritonExpertFFN(torch.autograd.Function):
    """The expert block on the Triton kernels, forward and backward.

    ``apply(x (T, N), w_up (E, up_width, N), w_down (E, N, K), gather (R,) int32 or None, divisor,
    num_rows R, ends (E,) int32, activation, ungather, options=None)`` → y (R, N) in expert-major
    order, row r computed from ``x[gather[r] // divisor]``.

    ``ungather`` maps the gradients of the rows back onto x: with ``divisor == 1`` it is the
    inverse of the bijection ``gather`` (dx = dx_rows[ungather]); with ``divisor == k`` it is
    ``row_of_assignment`` (T, k) and dx[t] = Σ_j dx_rows[row[t, j]] (no atomics either way).
    ``options`` (:class:`~interlace.kernels.expert_gemm.configs.ExpertKernelOptions`): configs
    and TMA for forward and backward (None: the tuning tables, TMA by device).
    """

    @staticmethod
    def forward(ctx, x, w_up, w_down, gather, divisor, num_rows, ends, activation, ungather,
                options: ExpertKernelOptions | None = None):
        needs_grad = any(ctx.needs_input_grad[:3])
        y, h, act, sched = expert_ffn_triton(x, gather, divisor, num_rows, w_up, w_down, ends, activation,
                                             store_h=needs_grad, return_act=True, return_schedule=True,
                                             options=options)
        if needs_grad:
            ctx.save_for_backward(x, w_up, w_down, gather, ends, h, act, ungather)
            ctx.schedule = sched  # device lists the backward reuses (read only)
        ctx.divisor, ctx.activation, ctx.options = divisor, activation, options
        return y

    @staticmethod
    def backward(ctx, grad):
        from interlace.kernels.rows import combine_rows, gather_rows

        x, w_up, w_down, gather, ends, h, act, ungather = ctx.saved_tensors
        dx_rows, dw_up, dw_down = expert_ffn_triton_backward(grad, x, gather, ctx.divisor, w_up, w_down, ends,
                                                             ctx.activation, h, act, schedule=ctx.schedule,
                                                             options=ctx.options)
        if gather is None:
            dx = dx_rows
        elif ctx.divisor == 1:
            dx = gather_rows(dx_rows, ungather)
        else:
            dx = combine_rows(dx_rows, ungather, None, x.dtype)
        return dx, dw_up, dw_down, None, None, None, None, None, None, None
