"""Per-tile building blocks of the expert GEMM kernels, shared by the kernel families.

``gate_up_tile`` is GEMM0's main loop for one (BLOCK_M × BLOCK_N) tile whose A rows are given
as row pointers (so the caller decides where rows come from: a gather from the token matrix,
a peer-filled receive buffer, ...), gate and up accumulated in the same tile for SwiGLU (with
JOINT, in one double-width dot over a 3-D weight descriptor, :func:`joint_gate_up_desc`);
``activation_epilogue`` turns the accumulators into the activation in fp32.
``kmajor_tile`` is the same main loop for weights stored (reduction, output) per expert — the
fused backward multiplies by W_down and W_up untransposed. ``window_map`` and ``store_tile``
bound TMA loads and stores at a row without a descriptor per tile (the flat loops).
ACTIVATION: 0 SwiGLU, 1 GELU (exact, erf), 2 ReLU, 3 none (the plain product; backward).
``W_FP8`` (``gate_up_tile``): the weights are e4m3 with one fp32 scale per 128 × 128 block
(:class:`interlace.fp8.BlockFP8Weight`), dequantized in registers before each dot (W8A16: the
decode kernels read half the bytes; the dot stays in the activations' dtype).
"""

from __future__ import annotations

import triton
import triton.language as tl

ACTIVATION_ID = {"swiglu": 0, "gelu": 1, "relu": 2}  # the kernels' ACTIVATION constexpr per activation


@triton.jit
def a_block(a_rows, rmask, a_desc, a_row0, k0, offs_k, RED, A_TMA: tl.constexpr):
    """The (rows × BLOCK_K) A block at reduction offset k0: rows ``a_row0 ..`` of the descriptor
    ``a_desc`` (A_TMA), else a masked load through the row pointers ``a_rows``."""
    if A_TMA:
        a = a_desc.load([a_row0, k0])
    else:
        kk = k0 + offs_k
        a = tl.load(a_rows[:, None] + kk[None, :], mask=rmask[:, None] & (kk < RED)[None, :], other=0.0)
    return a


@triton.jit
def fp8_dequant(b, w_scale, rows, rmask, k0, SCALE_COLS, ROWS_AXIS: tl.constexpr, dtype: tl.constexpr):
    """An e4m3 weight block ``b`` at reduction offset ``k0`` in ``dtype``: each weight row times
    the fp32 scale of its 128 × 128 block (``w_scale``: the expert's (⌈R/128⌉, SCALE_COLS) scales;
    ``rows``: the block's weight rows, along axis ``ROWS_AXIS`` of ``b``). A reduction step never
    crosses a scale block: its width divides 128 (the launchers check). (Scaling each step's
    product per output column instead keeps the weights exact but gives up the chained
    accumulator: 1.3-2.4x slower on H200 at 128-512 tokens.)"""
    s = tl.load(w_scale + (rows // 128).to(tl.int64) * SCALE_COLS + k0 // 128, mask=rmask, other=0.0)
    if ROWS_AXIS == 0:
        w = b.to(tl.float32) * s[:, None]
    else:
        w = b.to(tl.float32) * s[None, :]
    return w.to(dtype)


@triton.jit
def gate_up_tile(a_rows, rmask, w_base, w_desc, w_row, cols, cmask, N, K, ACTIVATION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr,
                 a_desc=None, a_row0=0, A_TMA: tl.constexpr = False, JOINT: tl.constexpr = False, w_expert=0,
                 col0=0, w_scale=None, SCALE_COLS=0, W_FP8: tl.constexpr = False):
    """(acc_gate, acc_up) of A[rows] @ W[cols]^T over the N reduction; W row-major (up_width, N)
    at ``w_base`` with the up rows K below the gate rows. acc_up is acc_gate without SwiGLU.
    With USE_TMA the weight tiles come through the tensor descriptor ``w_desc`` over all
    experts' (E·up_width, N) rows, this tile's first gate row being ``w_row`` (block rows past
    the expert's K rows only feed masked output columns). With A_TMA the A rows are the
    contiguous rows ``a_row0 ..`` of the descriptor ``a_desc`` (``a_rows`` unused): rows past
    the tile's valid ones only feed output rows the caller masks.

    JOINT (SwiGLU with USE_TMA): ``w_desc`` is the 3-D descriptor of :func:`joint_gate_up_desc`
    and one load brings the tile's gate and up rows (expert ``w_expert``, columns ``col0 ..``)
    as a (2, BLOCK_N, BLOCK_K) block, so one BLOCK_M × 2·BLOCK_N dot (a single n256 wgmma per
    warpgroup for BLOCK_N = 128) replaces two BLOCK_M × BLOCK_N dots that each re-read A from
    shared memory. The accumulator's gate and up halves split apart in registers.

    W_FP8 (not with JOINT): W is e4m3 and ``w_scale`` its expert's fp32 block scales
    (⌈up_width/128⌉, SCALE_COLS = ⌈N/128⌉), applied by :func:`fp8_dequant` before each dot."""
    offs_k = tl.arange(0, BLOCK_K)
    if JOINT:
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k0 in range(0, N, BLOCK_K):
            a = a_block(a_rows, rmask, a_desc, a_row0, k0, offs_k, N, A_TMA)
            b = tl.reshape(w_desc.load([2 * w_expert, col0, k0]), (2 * BLOCK_N, BLOCK_K))
            acc = tl.dot(a, b.T, acc)
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, N, BLOCK_K):
            kk = k0 + offs_k
            kmask = kk < N
            a = a_block(a_rows, rmask, a_desc, a_row0, k0, offs_k, N, A_TMA)
            if USE_TMA:
                b = w_desc.load([w_row, k0])
                if W_FP8:
                    b = fp8_dequant(b, w_scale, cols, cmask, k0, SCALE_COLS, 0, a.dtype)
                acc_g = tl.dot(a, b.T, acc_g)
                if ACTIVATION == 0:
                    b = w_desc.load([w_row + K, k0])
                    if W_FP8:
                        b = fp8_dequant(b, w_scale, K + cols, cmask, k0, SCALE_COLS, 0, a.dtype)
                    acc_u = tl.dot(a, b.T, acc_u)
            else:
                wmask = kmask[:, None] & cmask[None, :]
                b = tl.load(w_base + cols[None, :].to(tl.int64) * N + kk[:, None], mask=wmask, other=0.0)
                if W_FP8:
                    b = fp8_dequant(b, w_scale, cols, cmask, k0, SCALE_COLS, 1, a.dtype)
                acc_g = tl.dot(a, b, acc_g)
                if ACTIVATION == 0:
                    b = tl.load(w_base + (K + cols)[None, :].to(tl.int64) * N + kk[:, None], mask=wmask, other=0.0)
                    if W_FP8:
                        b = fp8_dequant(b, w_scale, K + cols, cmask, k0, SCALE_COLS, 1, a.dtype)
                    acc_u = tl.dot(a, b, acc_u)
    if ACTIVATION != 0:
        acc_u = acc_g
    return acc_g, acc_u


@triton.jit
def joint_gate_up_desc(w_ptr, E, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The SwiGLU weights (E, 2·K, N) as E·2 planes of (K, N) — gate then up per expert — for
    :func:`gate_up_tile`'s JOINT loads; rows past K in a plane read as zeros."""
    return tl.make_tensor_descriptor(w_ptr, shape=[E * 2, K, N], strides=[K * N, N, 1],
                                     block_shape=[2, BLOCK_N, BLOCK_K])


@triton.jit
def gate_up_desc(w_ptr, E, up_width, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, JOINT: tl.constexpr):
    """The up-projection weights (E, up_width, N) as a TMA descriptor for :func:`gate_up_tile`:
    JOINT, :func:`joint_gate_up_desc`; else E·up_width rows of N in (BLOCK_N × BLOCK_K) blocks
    (block rows past an expert's K gate or up rows feed only output columns the caller masks)."""
    if JOINT:  # (a constexpr branch: one return, of the descriptor the branch makes)
        desc = joint_gate_up_desc(w_ptr, E, N, K, BLOCK_N, BLOCK_K)
    else:
        desc = tl.make_tensor_descriptor(w_ptr, shape=[E * up_width, N], strides=[N, 1],
                                         block_shape=[BLOCK_N, BLOCK_K])
    return desc


@triton.jit
def kmajor_tile(a_rows, rmask, w_base, w_desc, w_row, col0, cols, cmask, RED, COLS,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr):
    """A[rows] (·, RED) @ W (RED, COLS) for one (BLOCK_M × BLOCK_N) tile; W row-major at ``w_base``.
    With USE_TMA the weight tiles come through ``w_desc`` over all experts' (E·RED, COLS) rows,
    this expert's first row being ``w_row`` and the tile's first column ``col0`` (block rows past
    RED meet zero A columns)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, RED, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < RED
        a = tl.load(a_rows[:, None] + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        if USE_TMA:
            b = w_desc.load([w_row + k0, col0])
        else:
            b = tl.load(w_base + kk[:, None].to(tl.int64) * COLS + cols[None, :], mask=kmask[:, None] & cmask[None, :],
                        other=0.0)
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def activation_epilogue(acc_g, acc_u, ACTIVATION: tl.constexpr):
    if ACTIVATION == 0:
        act = acc_g * tl.sigmoid(acc_g) * acc_u
    elif ACTIVATION == 1:
        act = 0.5 * acc_g * (1.0 + tl.erf(acc_g * 0.7071067811865476))
    elif ACTIVATION == 2:
        act = tl.maximum(acc_g, 0.0)
    else:
        act = acc_g
    return act


@triton.jit
def grouped_work(work, n_tiles, n_blocks, GROUP_M: tl.constexpr):
    """Work item → (row tile, column block), GROUP_M row tiles sharing each column block in
    turn (the L2 swizzle of the Triton matmul tutorial): a group's A rows and the weight block
    stay in L2 instead of every tile streaming the whole weight matrix."""
    width = GROUP_M * n_blocks
    first = (work // width) * GROUP_M
    size = tl.minimum(n_tiles - first, GROUP_M)
    rem = work % width
    return first + rem % size, rem // size


@triton.jit
def slice_grouped_work(work, n_tiles, n_slices, slice_group, GROUP_M: tl.constexpr):
    """Layer1's order: N-slices in groups of ``slice_group`` (0: all), each group's items
    swizzled as :func:`grouped_work`. slice_group = 1 is COMET's column-wise order (slice 0 of
    every row first: the combine starts early) but re-reads A once per slice; larger groups
    re-read A less and let the combine start later."""
    per = tl.where(slice_group > 0, slice_group, n_slices)
    group_items = n_tiles * per
    g = work // group_items
    sl0 = g * per
    tile, s = grouped_work(work % group_items, n_tiles, tl.minimum(n_slices - sl0, per), GROUP_M)
    return tile, sl0 + s


@triton.jit
def window_map(ptr, rows, cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """A **window map** over a row-major (rows, cols) matrix: the 3-D view (s, i, c) ↦ row s + i,
    column c, whose middle dimension has BLOCK_ROWS entries, loaded or stored in boxes of
    (1, BLOCK_ROWS, BLOCK_COLS). Moving a box's middle coordinate below 0 (loads) or past
    BLOCK_ROWS - 1 (stores) puts some of its rows outside that dimension: TMA reads those as
    zeros and drops their stores, while the other rows are rows of the matrix. So one map made
    before a loop bounds every step at a step-dependent row, where a 2-D map would have to be
    made again per step (a global write and a proxy fence each). Boxes never reach before row 0
    or past ``rows``; TMA stores take no negative coordinate (an illegal instruction on H200)."""
    return tl.make_tensor_descriptor(ptr, shape=[rows, BLOCK_ROWS, cols], strides=[cols, cols, 1],
                                     block_shape=[1, BLOCK_ROWS, BLOCK_COLS])


@triton.jit
def store_tile(out_win, out_ptr, val, row0, row_end, nb, COLS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A (BLOCK_M × BLOCK_N) output tile at rows ``row0 ..`` (valid below ``row_end``), column
    block ``nb``, through TMA (the store drains under the next tile's loads). A partial tile's
    box must not reach the next expert's first rows. ``out_win`` is the output's
    :func:`window_map` (BLOCK_M rows), made once per program: the box at s = row_end - BLOCK_M,
    i = BLOCK_M - v (v valid rows) puts the tile's rows on rows row0 .. row_end-1 and its other
    rows past the middle dimension's end, where TMA drops them. Only a tile ending before row
    BLOCK_M (s would be negative) takes a map made here, ending at ``row_end``. (A map per
    partial tile costs a global write and a proxy fence in the loop; a masked store instead
    needs a layout-conversion buffer on top of the TMA store's, which the flat kernels'
    pipelines leave no shared memory for.)"""
    box = tl.reshape(val.to(out_ptr.dtype.element_ty), (1, BLOCK_M, BLOCK_N))
    if row_end >= BLOCK_M:
        out_win.store([row_end - BLOCK_M, BLOCK_M - (row_end - row0), nb * BLOCK_N], box)
    else:  # (a 3-D box too, so both stores share one staging buffer)
        part = tl.make_tensor_descriptor(out_ptr, shape=[1, row_end, COLS], strides=[COLS, COLS, 1],
                                         block_shape=[1, BLOCK_M, BLOCK_N])
        part.store([0, row0, nb * BLOCK_N], box)
