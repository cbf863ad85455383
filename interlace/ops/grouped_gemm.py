"""Grouped GEMMs for the expert FFN in Triton, with the row gather fused into the A load.

Rows are expert-major: expert e owns rows ``[offs[e-1], offs[e])``. Three kernels:

* ``_tile_schedule_kernel`` — from the per-expert row ends, on the device, the list of
  (expert, first row, end row) tiles of height BLOCK_M in expert-major order and their count.
  Nothing is padded and nothing is read back by the host, so the whole expert block stays
  free of host syncs (and CUDA-graph capturable: grids are sized from host-known bounds).
* ``_gemm0_kernel`` — ``act(x[g] @ W_gate^T) * (x[g] @ W_up^T)`` for SwiGLU (one projection
  for GELU/ReLU): the A rows are read through the gather index ``g`` (``rows // divisor``), so
  the permuted token matrix is never written; gate and up accumulate in the same tile and the
  activation runs in the epilogue; the pre-activation is stored only when asked (backward).
* ``_gemm1_kernel`` — the down projection ``act @ W_down^T``.

Both GEMM kernels are persistent: a grid of at most (SM count × programs per SM) programs walks
the (tile, column block) work items, so no launch depends on the data. The SM count is read
from the device, never assumed.

Backward (interim): :class:`TritonExpertFFN` differentiates by recomputing the block with
``torch._grouped_mm`` under autograd; Triton backward kernels are still to come.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from interlace.ops import alloc
from interlace.ops.rows import use_triton
from interlace.ops.tuning import GemmConfig, ShapeClass, lookup


def _config_from_env(name: str) -> GemmConfig | None:
    """``INTERLACE_GEMM0=bm,bn,bk,warps,stages`` forces a config (tuning experiments)."""
    value = os.environ.get(name)
    return GemmConfig(*(int(v) for v in value.split(","))) if value else None


# Defaults where no tuning table covers the device (lookup warns once): chosen from a handful
# tried on an H100 (docs/benchmarks.md, run 9); 5 stages of GEMM0 failed there.
GEMM0_DEFAULT = GemmConfig(128, 128, 64, 8, 4)
GEMM1_DEFAULT = GemmConfig(128, 256, 64, 8, 3)
INTERPRETER_CONFIG = GemmConfig(16, 16, 16, 4, 1)
PROGRAMS_PER_SM = 1


@triton.jit
def _tile_schedule_kernel(
    ends_ptr,  # (E,) int32 inclusive row ends per expert
    tile_expert_ptr, tile_start_ptr, tile_end_ptr,  # (max_tiles,) int32 each, out
    num_tiles_ptr,  # (1,) int32, out
    E, max_tiles,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    ends = tl.load(ends_ptr + e, mask=e < E, other=0)
    starts = tl.load(ends_ptr + e - 1, mask=(e > 0) & (e < E), other=0)
    counts = tl.where(e < E, ends - starts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    first_tile = tl.cumsum(tiles, axis=0) - tiles
    total = tl.sum(tiles, axis=0)
    if pid == 0:
        tl.store(num_tiles_ptr, total)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    owns = (first_tile[None, :] <= t[:, None]) & (t[:, None] < (first_tile + tiles)[None, :])
    expert = tl.sum(tl.where(owns, e[None, :], 0), axis=1)
    local = t - tl.sum(tl.where(owns, first_tile[None, :], 0), axis=1)
    row0 = tl.sum(tl.where(owns, starts[None, :], 0), axis=1) + local * BLOCK_M
    row_end = tl.minimum(row0 + BLOCK_M, tl.sum(tl.where(owns, ends[None, :], 0), axis=1))
    valid = (t < total) & (t < max_tiles)
    tl.store(tile_expert_ptr + t, expert, mask=valid)
    tl.store(tile_start_ptr + t, row0, mask=valid)
    tl.store(tile_end_ptr + t, row_end, mask=valid)


@dataclass
class TileSchedule:
    expert: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    count: torch.Tensor  # (1,) int32 on the device
    max_tiles: int
    block_m: int


def tile_schedule(ends: torch.Tensor, num_rows: int, block_m: int) -> TileSchedule:
    """Tiles of ``block_m`` rows per expert from the inclusive row ends (device, no sync)."""
    E = ends.numel()
    max_tiles = triton.cdiv(num_rows, block_m) + E
    dev = ends.device
    sched = TileSchedule(alloc.empty((max_tiles,), torch.int32, dev), alloc.empty((max_tiles,), torch.int32, dev),
                         alloc.empty((max_tiles,), torch.int32, dev), alloc.empty((1,), torch.int32, dev),
                         max_tiles, block_m)
    e_pad = triton.next_power_of_2(max(E, 1))
    block_t = max(1, min(64, 8192 // e_pad))
    _tile_schedule_kernel[(triton.cdiv(max_tiles, block_t),)](
        ends, sched.expert, sched.start, sched.end, sched.count, E, max_tiles,
        BLOCK_M=block_m, E_PAD=e_pad, BLOCK_T=block_t, num_warps=4,
    )
    return sched


@triton.jit
def _tile_work(work, n_blocks, tile_expert_ptr, tile_start_ptr, tile_end_ptr, BLOCK_M: tl.constexpr):
    """Work item → (expert, its rows, their mask, column block) of the tile schedule."""
    tile = work // n_blocks
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    rows = tl.load(tile_start_ptr + tile) + tl.arange(0, BLOCK_M)
    rmask = rows < tl.load(tile_end_ptr + tile)
    return e, rows, rmask, work % n_blocks


@triton.jit
def _gemm0_kernel(
    x_ptr, gather_ptr, w_ptr, out_ptr, h_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
    N, K, divisor, num_programs,
    ACTIVATION: tl.constexpr,  # 0 swiglu, 1 gelu, 2 relu
    HAS_GATHER: tl.constexpr, STORE_H: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_tiles = tl.load(num_tiles_ptr)
    n_blocks = tl.cdiv(K, BLOCK_N)
    up_width = 2 * K if ACTIVATION == 0 else K
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for work in range(pid, num_tiles * n_blocks, num_programs):
        e, rows, rmask, nb = _tile_work(work, n_blocks, tile_expert_ptr, tile_start_ptr, tile_end_ptr, BLOCK_M)
        if HAS_GATHER:
            src = (tl.load(gather_ptr + rows, mask=rmask, other=0) // divisor).to(tl.int64)
        else:
            src = rows.to(tl.int64)
        cols = nb * BLOCK_N + offs_n
        cmask = cols < K
        w_base = w_ptr + e * up_width * N
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if ACTIVATION == 0:
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, N, BLOCK_K):
            kk = k0 + offs_k
            kmask = kk < N
            a = tl.load(x_ptr + src[:, None] * N + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            wg = tl.load(w_base + cols[None, :].to(tl.int64) * N + kk[:, None],
                         mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc_g = tl.dot(a, wg, acc_g)
            if ACTIVATION == 0:
                wu = tl.load(w_base + (K + cols)[None, :].to(tl.int64) * N + kk[:, None],
                             mask=kmask[:, None] & cmask[None, :], other=0.0)
                acc_u = tl.dot(a, wu, acc_u)
        if ACTIVATION == 0:
            act = acc_g * tl.sigmoid(acc_g) * acc_u
        elif ACTIVATION == 1:
            act = 0.5 * acc_g * (1.0 + tl.erf(acc_g * 0.7071067811865476))
        else:
            act = tl.maximum(acc_g, 0.0)
        omask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        tl.store(out_ptr + rows64[:, None] * K + cols[None, :], act.to(out_ptr.dtype.element_ty), mask=omask)
        if STORE_H:
            tl.store(h_ptr + rows64[:, None] * up_width + cols[None, :], acc_g.to(h_ptr.dtype.element_ty), mask=omask)
            if ACTIVATION == 0:
                tl.store(h_ptr + rows64[:, None] * up_width + K + cols[None, :], acc_u.to(h_ptr.dtype.element_ty),
                         mask=omask)


@triton.jit
def _gemm1_kernel(
    a_ptr, w_ptr, out_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr, num_tiles_ptr,
    N, K, num_programs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_tiles = tl.load(num_tiles_ptr)
    n_blocks = tl.cdiv(N, BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for work in range(pid, num_tiles * n_blocks, num_programs):
        e, rows, rmask, nb = _tile_work(work, n_blocks, tile_expert_ptr, tile_start_ptr, tile_end_ptr, BLOCK_M)
        rows64 = rows.to(tl.int64)
        cols = nb * BLOCK_N + offs_n
        cmask = cols < N
        w_base = w_ptr + e * N * K
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            kmask = kk < K
            a = tl.load(a_ptr + rows64[:, None] * K + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(w_base + cols[None, :].to(tl.int64) * K + kk[:, None], mask=kmask[:, None] & cmask[None, :],
                        other=0.0)
            acc = tl.dot(a, b, acc)
        tl.store(out_ptr + rows64[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])


_ACTIVATION_ID = {"swiglu": 0, "gelu": 1, "relu": 2}


def _num_programs(device: torch.device, work_bound: int) -> int:
    if device.type != "cuda":
        return max(1, min(work_bound, 4))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(work_bound, sms * PROGRAMS_PER_SM))


@lru_cache(maxsize=None)
def _device_identity(index: int) -> tuple[str, int]:
    props = torch.cuda.get_device_properties(index)
    return props.name, props.multi_processor_count


def choose_configs(x: torch.Tensor, w_down: torch.Tensor, num_rows: int, activation: str):
    """(GEMM0 config, GEMM1 config, where they came from) for this call's shape."""
    forced0, forced1 = _config_from_env("INTERLACE_GEMM0"), _config_from_env("INTERLACE_GEMM1")
    if not x.is_cuda:
        return forced0 or INTERPRETER_CONFIG, forced1 or INTERPRETER_CONFIG, "interpreter"
    name, sms = _device_identity(x.device.index if x.device.index is not None else torch.cuda.current_device())
    E, N, K = w_down.shape
    shape = ShapeClass(N, K, E, activation)
    per_expert = num_rows / max(E, 1)
    c0, src0 = (forced0, "env") if forced0 else lookup("expert_gemm0", name, sms, shape, per_expert, GEMM0_DEFAULT)
    c1, src1 = (forced1, "env") if forced1 else lookup("expert_gemm1", name, sms, shape, per_expert, GEMM1_DEFAULT)
    return c0, c1, f"gemm0 {src0}; gemm1 {src1}"


def expert_ffn_triton(x: torch.Tensor, gather: torch.Tensor | None, divisor: int, num_rows: int,
                      w_up: torch.Tensor, w_down: torch.Tensor, ends: torch.Tensor, activation: str,
                      store_h: bool = False, configs: tuple[GemmConfig, GemmConfig] | None = None):
    """Expert FFN over ``num_rows`` expert-major rows, row r reading ``x[gather[r] // divisor]``
    (or ``x[r]`` without ``gather``). Returns ``(y (num_rows, N), h or None)``. ``configs``
    forces the two kernels' configs (the tuner); by default they come from the tuning tables."""
    N = x.shape[1]
    K = w_down.shape[2]
    up_width = w_up.shape[1]
    c0, c1 = configs if configs is not None else choose_configs(x, w_down, num_rows, activation)[:2]
    act = alloc.empty((num_rows, K), x.dtype, x.device)
    h = alloc.empty((num_rows, up_width), x.dtype, x.device) if store_h else None
    y = alloc.empty((num_rows, N), x.dtype, x.device)
    if num_rows == 0:
        return y, h
    sched0 = tile_schedule(ends, num_rows, c0.block_m)
    work0 = sched0.max_tiles * triton.cdiv(K, c0.block_n)
    p0 = _num_programs(x.device, work0)
    _gemm0_kernel[(p0,)](
        x, gather if gather is not None else sched0.start, w_up, act, h if h is not None else act,
        sched0.expert, sched0.start, sched0.end, sched0.count, N, K, divisor, p0,
        ACTIVATION=_ACTIVATION_ID[activation], HAS_GATHER=gather is not None, STORE_H=store_h,
        BLOCK_M=c0.block_m, BLOCK_N=c0.block_n, BLOCK_K=c0.block_k, num_warps=c0.num_warps, num_stages=c0.num_stages,
    )
    sched1 = sched0 if c1.block_m == c0.block_m else tile_schedule(ends, num_rows, c1.block_m)
    work1 = sched1.max_tiles * triton.cdiv(N, c1.block_n)
    p1 = _num_programs(x.device, work1)
    _gemm1_kernel[(p1,)](
        act, w_down, y, sched1.expert, sched1.start, sched1.end, sched1.count, N, K, p1,
        BLOCK_M=c1.block_m, BLOCK_N=c1.block_n, BLOCK_K=c1.block_k, num_warps=c1.num_warps, num_stages=c1.num_stages,
    )
    return y, h


def supports(x: torch.Tensor, w_up: torch.Tensor) -> bool:
    """The Triton expert path runs on CUDA (or the interpreter) for bf16/fp16/fp32."""
    return use_triton(x) and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and w_up.dtype == x.dtype


class TritonExpertFFN(torch.autograd.Function):
    """Forward: the Triton kernels above. Backward (interim): recompute with torch ops."""

    @staticmethod
    def forward(ctx, x, w_up, w_down, gather, divisor, num_rows, ends, activation):
        y, _ = expert_ffn_triton(x, gather, divisor, num_rows, w_up, w_down, ends, activation)
        ctx.save_for_backward(x, w_up, w_down, gather, ends)
        ctx.divisor, ctx.activation = divisor, activation
        return y

    @staticmethod
    def backward(ctx, grad):
        from interlace.ops.activation import activation_fused
        from interlace.ops.grouped_mm import grouped_mm

        x, w_up, w_down, gather, ends = ctx.saved_tensors
        with torch.enable_grad():
            xl, wu, wd = (t.detach().requires_grad_() for t in (x, w_up, w_down))
            xg = xl.index_select(0, torch.div(gather.long(), ctx.divisor, rounding_mode="floor")) \
                if gather is not None else xl
            y = grouped_mm(activation_fused(grouped_mm(xg, wu, ends), ctx.activation), wd, ends)
            dx, dwu, dwd = torch.autograd.grad(y, (xl, wu, wd), grad)
        return dx, dwu, dwd, None, None, None, None, None
