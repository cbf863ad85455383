"""The expert FFN's forward on the Triton kernels: GEMM0 (gate/up projection, the row gather
fused into its A load, the activation in its epilogue), then GEMM1 (down projection).

Both GEMMs are persistent: a grid of at most (SM count × programs per SM) programs walks the
(tile, column block) work items of one device-built tile schedule, so no launch depends on the
data and nothing syncs with the host.
"""

from __future__ import annotations

import torch

from interlace.kernels import alloc
from interlace.kernels.expert_gemm.configs import ExpertKernelOptions, choose_configs
from interlace.kernels.expert_gemm.gemm0 import launch_gemm0
from interlace.kernels.expert_gemm.grouped import launch_gemm
from interlace.kernels.expert_gemm.schedule import tile_schedule
from interlace.kernels.tma import ensure_allocator, use_tma
from interlace.tuning.tables import GemmConfig


def expert_ffn_triton(x: torch.Tensor, gather: torch.Tensor | None, divisor: int, num_rows: int,
                      w_up: torch.Tensor, w_down: torch.Tensor, ends: torch.Tensor, activation: str,
                      store_h: bool = False, configs: tuple[GemmConfig, GemmConfig] | None = None,
                      return_act: bool = False, return_schedule: bool = False,
                      options: ExpertKernelOptions | None = None):
    """Expert FFN over ``num_rows`` expert-major rows, row r reading ``x[gather[r] // divisor]``
    (or ``x[r]`` without ``gather``); x (T, N), w_up (E, up_width, N), w_down (E, N, K), ``ends``
    (E,) int32 the inclusive row ends per expert.

    Returns ``(y (num_rows, N), h (num_rows, up_width) or None)``; ``store_h`` stores the
    pre-activation h (training). ``configs`` forces the two kernels' configs (the tuner); else
    ``options`` and the tuning tables choose them, and ``options.tma`` whether TMA is used.
    ``return_act``: the activations (num_rows, K) too; ``return_schedule``: the GEMM0 tile
    schedule is appended to the result (None without rows), for a backward over the same rows
    to reuse."""
    N = x.shape[1]
    K = w_down.shape[2]
    up_width = w_up.shape[1]
    c0, c1 = configs if configs is not None else choose_configs(x, w_down, num_rows, activation, store_h,
                                                                options=options)[:2]
    act = alloc.empty((num_rows, K), x.dtype, x.device)
    h = alloc.empty((num_rows, up_width), x.dtype, x.device) if store_h else None
    y = alloc.empty((num_rows, N), x.dtype, x.device)
    if num_rows == 0:
        return ((y, h, act) if return_act else (y, h)) + ((None,) if return_schedule else ())
    tma = use_tma(w_up, w_down, force=options.tma if options is not None else None)
    if tma:
        ensure_allocator()
    sched0 = tile_schedule(ends, num_rows, c0.block_m)
    launch_gemm0(x, gather, divisor, w_up, act, h, sched0, num_rows, activation, c0, tma)
    launch_gemm(act, w_down, y, None, ends, num_rows, cols=N, red=K, b_trans=True, epilogue=0, config=c1,
                schedule=sched0 if c1.block_m == c0.block_m else None, tma=tma)
    return ((y, h, act) if return_act else (y, h)) + ((sched0,) if return_schedule else ())
