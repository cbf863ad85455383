"""Probe (issue 3): does a weight-gradient kernel whose block stores run under the next block's MMAs
beat interlace's flat Triton kernel on short reductions (256-512 rows per expert)?

The Triton kernel (``_wgrad_flat_kernel``) waits for every MMA of a block, then converts and stores
it, and only then issues the next block's first MMA: at 4 row steps per block the tensor cores idle
through every store. Triton's ``tl`` leaves that order to the compiler (run 199: a deferred store
still waited for every MMA), and ``tl`` warp specialization is Blackwell-only. Gluon states the
waits explicitly, so this kernel issues block b+1's first MMA (asynchronous), then writes block b
into shared memory and starts its TMA store, and only then waits for the MMA.

Scope: a probe, not a kernel of the package. Experts have equal row counts that are multiples of
BLOCK_R (the bench's balanced rows), P and Q multiples of the block. It checks its output against
``_launch_wgrad`` (bf16, the same fp32 accumulation order per block up to MMA tiling) and times both,
with ``DEFER`` off (the store inline, as the Triton kernel orders it) and on.

    python scripts/gluon_wgrad_probe.py [--configs dsv3-like qwen3-30b-a3b flashdmoe-cfg] [--tokens 4096]

What it measured on an H100 (docs/benchmarks.md, runs 201–205), all forms bitwise equal to the Triton kernel:
- The inline form is level with the Triton kernel or up to 5% behind at 256 rows per expert (445 against 445
  TFLOP/s on dsv3-like's dW_down) and 6–9% behind at 512–1024 rows, once its block coordinates were computed
  only at block starts (run 204; with divisions on every step it trailed by 7–25%, runs 201–202).
- Storing a block under the next block's first MMA (``DEFER``) is 1–10% slower than storing it inline.
- With the MMAs left out, the loads and stores alone take 75–84% of the inline kernel's time at 256–512
  rows per expert; with the stores left out instead (the loads and a quarter of the MMAs), 41–56%.
- Keeping b resident (one read of b per column strip: 2.8× fewer operand bytes at 128 × 256) is 9–18%
  slower than the inline form at 128 × 256 and 26–40% slower at 128 × 128.
So at these rows the kernel is bound by its memory traffic (operand loads and gradient stores), and
neither a store schedule nor fewer operand reads make it faster.
"""

import argparse
import statistics

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _item_coords(item, n_p, n_q, GROUP_P: gl.constexpr):
    """Output block ``item`` → (expert, P block, Q block): expert-major, GROUP_P P blocks per group."""
    per_e = n_p * n_q
    e = item // per_e
    r = item % per_e
    per_group = GROUP_P * n_q
    first_p = (r // per_group) * GROUP_P
    group = gl.minimum(n_p - first_p, GROUP_P)
    return e, first_p + (r % per_group) % group, (r % per_group) // group


@gluon.jit
def _next_step(k, item, e, pb, qb, n_k, num_programs, n_p, n_q, GROUP_P: gl.constexpr):
    """One step on in :func:`wgrad_kernel`'s order: the next row block, or the program's next block."""
    k += 1
    if k == n_k:
        k = 0
        item += num_programs
        e, pb, qb = _item_coords(item, n_p, n_q, GROUP_P)
    return k, item, e, pb, qb


@gluon.jit
def _load_ab(a_desc, b_desc, bar, a_buf, b_buf, row, a_col, b_col, ok):
    """One step's a and b tiles into a stage (``ok`` false: nothing)."""
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(a_desc, [row, a_col], bar, a_buf, ok)
    tma.async_copy_global_to_shared(b_desc, [row, b_col], bar, b_buf, ok)


@gluon.jit
def _store_block(c_desc, c_smem, val, row, col):
    """A finished block out through the staging buffer, once the previous store has read it."""
    tma.store_wait(pendings=0)
    c_smem.store(val)
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [row, col], c_smem)


@gluon.jit
def wgrad_kernel(a_desc, b_desc, c_desc, E, P, Q, RE, num_programs,
                 STAGES: gl.constexpr, GROUP_P: gl.constexpr, DEFER: gl.constexpr, num_warps: gl.constexpr,
                 STORE: gl.constexpr = True, MMA: gl.constexpr = True):
    """out[e] (P × Q) = a[rows of e]ᵀ b[rows of e]; expert e's rows are e·RE … (e+1)·RE. One flat loop
    over (output block, row block) steps; the loads run STAGES-1 steps ahead; block coordinates are
    recomputed only when a block starts (for the load side and the MMA side apart).
    For the time split only: ``STORE = False`` skips the blocks' TMA stores (the MMA results then go unused,
    and ptxas keeps 1 of the 4 HGMMA instructions per step), ``MMA = False`` the MMAs (loads and stores of zeros)."""
    BLOCK_R: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_P: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_Q: gl.constexpr = b_desc.block_type.shape[1]
    dtype: gl.constexpr = a_desc.dtype
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_Q, 16])
    pid = gl.program_id(0)
    n_p = P // BLOCK_P
    n_q = Q // BLOCK_Q
    n_items = E * n_p * n_q
    n_k = RE // BLOCK_R
    total = gl.cdiv(n_items - pid, num_programs) * n_k

    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_R, BLOCK_P], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_R, BLOCK_Q], b_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, [BLOCK_P, BLOCK_Q], c_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    # the load side: block l_item, row block l_k
    l_item = pid
    l_k = 0
    l_e, l_pb, l_qb = _item_coords(l_item, n_p, n_q, GROUP_P)
    for s in gl.static_range(STAGES - 1):
        _load_ab(a_desc, b_desc, bars.index(s), a_bufs.index(s), b_bufs.index(s), l_e * RE + l_k * BLOCK_R,
                 l_pb * BLOCK_P, l_qb * BLOCK_Q, s < total)
        l_k, l_item, l_e, l_pb, l_qb = _next_step(l_k, l_item, l_e, l_pb, l_qb, n_k, num_programs, n_p, n_q,
                                                  GROUP_P)

    # the MMA side: block c_item, row block c_k
    c_item = pid
    c_k = 0
    c_e, c_pb, c_qb = _item_coords(c_item, n_p, n_q, GROUP_P)
    acc = gl.zeros((BLOCK_P, BLOCK_Q), dtype=gl.float32, layout=acc_layout)
    held = gl.zeros((BLOCK_P, BLOCK_Q), dtype=dtype, layout=acc_layout)
    held_row = 0
    held_col = 0
    holding = False
    for step in range(total):
        slot = step % STAGES
        mbarrier.wait(bars.index(slot), (step // STAGES) & 1)
        if MMA:
            acc = warpgroup_mma(a_bufs.index(slot).permute((1, 0)), b_bufs.index(slot), acc, use_acc=c_k != 0,
                                is_async=True)
        if DEFER:
            if holding:  # the previous block, while this step's MMA runs
                _store_block(c_desc, c_smem, held, held_row, held_col)
                holding = False
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # step-1's MMA done: its slot is free
        nslot = (step + STAGES - 1) % STAGES
        _load_ab(a_desc, b_desc, bars.index(nslot), a_bufs.index(nslot), b_bufs.index(nslot),
                 l_e * RE + l_k * BLOCK_R, l_pb * BLOCK_P, l_qb * BLOCK_Q, step + STAGES - 1 < total)
        l_k, l_item, l_e, l_pb, l_qb = _next_step(l_k, l_item, l_e, l_pb, l_qb, n_k, num_programs, n_p, n_q,
                                                  GROUP_P)
        if c_k == n_k - 1:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            if DEFER:
                held = acc.to(dtype)
                held_row = c_e * P + c_pb * BLOCK_P
                held_col = c_qb * BLOCK_Q
                holding = True
            elif STORE:
                _store_block(c_desc, c_smem, acc.to(dtype), c_e * P + c_pb * BLOCK_P, c_qb * BLOCK_Q)
        c_k, c_item, c_e, c_pb, c_qb = _next_step(c_k, c_item, c_e, c_pb, c_qb, n_k, num_programs, n_p, n_q,
                                                  GROUP_P)
    if DEFER:
        if holding:
            _store_block(c_desc, c_smem, held, held_row, held_col)
    tma.store_wait(pendings=0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _next_strip_step(k, pb, i, e, qb, N_K: gl.constexpr, n_p, n_q, pid, num_programs):
    """One step on in :func:`wgrad_resident_kernel`'s order: row block, then P block, then the program's next strip."""
    k += 1
    if k == N_K:
        k = 0
        pb += 1
        if pb == n_p:
            pb = 0
            i += 1
            e = (pid + i * num_programs) // n_q
            qb = (pid + i * num_programs) % n_q
    return k, pb, i, e, qb


@gluon.jit
def _load_a(a_desc, bar, a_buf, row, col, ok):
    """One step's a tile into a stage (``ok`` false: nothing)."""
    mbarrier.expect(bar, a_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(a_desc, [row, col], bar, a_buf, ok)


@gluon.jit
def wgrad_resident_kernel(a_desc, b_desc, c_desc, E, P, Q, RE, num_programs,
                          STAGES: gl.constexpr, N_K: gl.constexpr, num_warps: gl.constexpr):
    """:func:`wgrad_kernel` with expert e's b rows for one column block held in shared memory
    (N_K = RE / BLOCK_R blocks of BLOCK_R × BLOCK_Q: 128 KB at 256 rows × 256 columns) while the
    program runs every P block of that column strip, streaming only a. The flat kernel reads both
    operands again for every output block: at 256 rows per expert its loads and stores alone take
    75–84% of its time (runs 202, 204). Here b is read once per strip, so a block costs its a tile only."""
    BLOCK_R: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_P: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_Q: gl.constexpr = b_desc.block_type.shape[1]
    dtype: gl.constexpr = a_desc.dtype
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_Q, 16])
    pid = gl.program_id(0)
    n_p = P // BLOCK_P
    n_q = Q // BLOCK_Q
    n_strips = E * n_q
    my_strips = gl.cdiv(n_strips - pid, num_programs)
    total = my_strips * n_p * N_K

    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_R, BLOCK_P], a_desc.layout)
    b_res = gl.allocate_shared_memory(dtype, [N_K, BLOCK_R, BLOCK_Q], b_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, [BLOCK_P, BLOCK_Q], c_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    mbarrier.init(b_bar.index(0), count=1)

    # the load side (a tiles) and the MMA side: strip i of this program (expert e, column block qb), P block pb,
    # row block k
    l_k, l_pb, l_i, l_e, l_qb = 0, 0, 0, pid // n_q, pid % n_q
    for s in gl.static_range(STAGES - 1):
        _load_a(a_desc, bars.index(s), a_bufs.index(s), l_e * RE + l_k * BLOCK_R, l_pb * BLOCK_P, s < total)
        l_k, l_pb, l_i, l_e, l_qb = _next_strip_step(l_k, l_pb, l_i, l_e, l_qb, N_K, n_p, n_q, pid, num_programs)

    acc = gl.zeros((BLOCK_P, BLOCK_Q), dtype=gl.float32, layout=acc_layout)
    c_k, c_pb, c_i, e, qb = 0, 0, 0, pid // n_q, pid % n_q
    for step in range(total):
        if (c_pb == 0) & (c_k == 0):  # a new strip: its b rows into shared memory (the last strip's MMAs are done)
            mbarrier.expect(b_bar.index(0), N_K * b_desc.block_type.nbytes)
            for kk in gl.static_range(N_K):
                tma.async_copy_global_to_shared(b_desc, [e * RE + kk * BLOCK_R, qb * BLOCK_Q], b_bar.index(0),
                                                b_res.index(kk))
            mbarrier.wait(b_bar.index(0), c_i & 1)
        slot = step % STAGES
        mbarrier.wait(bars.index(slot), (step // STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(slot).permute((1, 0)), b_res.index(c_k), acc, use_acc=c_k != 0,
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # step-1's MMA done: its slot is free
        nslot = (step + STAGES - 1) % STAGES
        _load_a(a_desc, bars.index(nslot), a_bufs.index(nslot), l_e * RE + l_k * BLOCK_R, l_pb * BLOCK_P,
                step + STAGES - 1 < total)
        l_k, l_pb, l_i, l_e, l_qb = _next_strip_step(l_k, l_pb, l_i, l_e, l_qb, N_K, n_p, n_q, pid, num_programs)
        if c_k == N_K - 1:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            _store_block(c_desc, c_smem, acc.to(dtype), e * P + c_pb * BLOCK_P, qb * BLOCK_Q)
        c_k, c_pb, c_i, e, qb = _next_strip_step(c_k, c_pb, c_i, e, qb, N_K, n_p, n_q, pid, num_programs)
    tma.store_wait(pendings=0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    mbarrier.invalidate(b_bar.index(0))


def gluon_wgrad_resident(a, b, out, E, RE, block=(128, 256, 32), stages=4, num_programs=None):
    """:func:`gluon_wgrad` with b's rows of a column strip resident (RE · BLOCK_Q · 2 bytes of shared memory)."""
    BP, BQ, BR = block
    P, Q = a.shape[1], b.shape[1]
    assert fits(a.shape[0], P, Q, E, RE, block) and RE * BQ * 2 <= 128 * 1024 and RE % BR == 0
    lay = lambda shape: gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)
    a_desc = TensorDescriptor.from_tensor(a, [BR, BP], lay([BR, BP]))
    b_desc = TensorDescriptor.from_tensor(b, [BR, BQ], lay([BR, BQ]))
    c_desc = TensorDescriptor.from_tensor(out.view(E * P, Q), [BP, BQ], lay([BP, BQ]))
    strips = E * (Q // BQ)
    if num_programs is None:
        num_programs = min(strips, torch.cuda.get_device_properties(a.device).multi_processor_count)
    wgrad_resident_kernel[(num_programs, )](a_desc, b_desc, c_desc, E, P, Q, RE, num_programs, STAGES=stages,
                                            N_K=RE // BR, num_warps=8)
    return out


def fits(R, P, Q, E, RE, block=(128, 256, 64)) -> bool:
    """The probe's scope: equal runs of RE rows, whole row blocks, whole output blocks."""
    BP, BQ, BR = block
    return RE % BR == 0 and P % BP == 0 and Q % BQ == 0 and R == E * RE


def gluon_wgrad(a, b, out, E, RE, block=(128, 256, 64), stages=3, group=8, defer=True, num_programs=None,
                store=True, mma=True):
    """out (E, P, Q) = per-expert aᵀ b over equal runs of RE rows (a (E·RE, P), b (E·RE, Q), bf16)."""
    BP, BQ, BR = block
    P, Q = a.shape[1], b.shape[1]
    assert fits(a.shape[0], a.shape[1], b.shape[1], E, RE, block)
    lay = lambda shape: gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)
    a_desc = TensorDescriptor.from_tensor(a, [BR, BP], lay([BR, BP]))
    b_desc = TensorDescriptor.from_tensor(b, [BR, BQ], lay([BR, BQ]))
    c_desc = TensorDescriptor.from_tensor(out.view(E * P, Q), [BP, BQ], lay([BP, BQ]))
    items = E * (P // BP) * (Q // BQ)
    if num_programs is None:
        num_programs = min(items, torch.cuda.get_device_properties(a.device).multi_processor_count)
    wgrad_kernel[(num_programs, )](a_desc, b_desc, c_desc, E, P, Q, RE, num_programs, STAGES=stages, GROUP_P=group,
                                   DEFER=defer, num_warps=8, STORE=store, MMA=mma)
    return out


def main():
    from interlace.bench.harness import bench_config
    from interlace.ops import grouped_gemm as gg
    from interlace.ops.tuning import GemmConfig

    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="+", default=["dsv3-like", "qwen3-30b-a3b", "flashdmoe-cfg", "qwen2-moe"])
    p.add_argument("--tokens", nargs="+", type=int, default=[4096])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print("| config | tokens | kernel | rows/expert | Triton table ms | Gluon inline ms | Gluon deferred ms | "
          "TFLOP/s Triton / inline / deferred | max rel. diff inline, deferred | inline without stores ms | "
          "inline without MMAs ms | Gluon b-resident 128 × 256 ms (TFLOP/s; max rel. diff) | "
          "Gluon b-resident 128 × 128 ms (TFLOP/s; max rel. diff) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.configs:
        cfg = bench_config(name, small=False)
        E = cfg.num_experts // args.world
        for T in args.tokens:
            RE = T * cfg.top_k // E
            for kernel, (P, Q) in (("dw_down", (cfg.hidden, cfg.ffn)), ("dw_up", (2 * cfg.ffn, cfg.hidden))):
                if not fits(E * RE, P, Q, E, RE):
                    print(f"| {name} | {T} | {kernel} | {RE} | (outside the probe's scope: P={P}, Q={Q}) |")
                    continue
                a = torch.randn(E * RE, P, device=dev).to(torch.bfloat16)
                b = torch.randn(E * RE, Q, device=dev).to(torch.bfloat16)
                ends = (torch.arange(1, E + 1, device=dev) * RE).to(torch.int32)
                config = GemmConfig(128, 256, 64, 8, 3, 8, 0, 0, 1, 2)  # the H100 table's on these rows
                runs = {
                    "triton": lambda o: gg._launch_wgrad(a, b, None, 1, o, ends, P, Q, config, tma=True),
                    "inline": lambda o: gluon_wgrad(a, b, o, E, RE, defer=False),
                    "deferred": lambda o: gluon_wgrad(a, b, o, E, RE, defer=True),
                    "no_store": lambda o: gluon_wgrad(a, b, o, E, RE, defer=False, store=False),
                    "no_mma": lambda o: gluon_wgrad(a, b, o, E, RE, defer=False, mma=False),
                }
                checked = ("triton", "inline", "deferred")
                if RE * 256 * 2 <= 128 * 1024:
                    runs["resident"] = lambda o: gluon_wgrad_resident(a, b, o, E, RE)
                    checked += ("resident", )
                if RE * 128 * 2 <= 128 * 1024 and Q % 128 == 0:
                    runs["resident128"] = lambda o: gluon_wgrad_resident(a, b, o, E, RE, block=(128, 128, 64), stages=3)
                    checked += ("resident128", )
                outs = {}
                for label in checked:
                    fn = runs[label]
                    o = torch.full((E, P, Q), float("nan"), device=dev, dtype=torch.bfloat16)
                    fn(o)
                    outs[label] = o
                torch.cuda.synchronize()
                ref = outs["triton"].float()
                diff = {l: ((outs[l].float() - ref).abs().max() / ref.abs().max()).item() for l in checked[1:]}
                ms = {label: [] for label in runs}
                buf = torch.empty(E, P, Q, device=dev, dtype=torch.bfloat16)
                for _ in range(args.rounds):
                    for label, fn in runs.items():
                        ms[label].append(triton.testing.do_bench(lambda: fn(buf), warmup=25, rep=100,
                                                                 return_mode="median"))
                med = {label: statistics.median(v) for label, v in ms.items()}
                flops = 2 * E * RE * P * Q
                print(f"| {name} | {T} | {kernel} | {RE} | {med['triton']:.3f} | {med['inline']:.3f} | "
                      f"{med['deferred']:.3f} | " + " / ".join(f"{flops / med[l] / 1e9:.0f}" for l in checked[:3])
                      + f" | {diff['inline']:.1e}, {diff['deferred']:.1e} | {med['no_store']:.3f} | {med['no_mma']:.3f} | "
                      + " | ".join(f"{med[l]:.3f} ({flops / med[l] / 1e9:.0f}; {diff[l]:.1e})" if l in med else "-"
                                   for l in ("resident", "resident128")) + " |", flush=True)
                del a, b, outs, buf
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
