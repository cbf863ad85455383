"""How fast ``P`` programs of a Triton kernel move rows over NVLink, per program and in all.

The fused kernels move their remote rows with a few programs while the rest compute, so what
one program can push (store into a peer's buffer) or pull (load from it) sets how many
programs the transfers take from the GEMMs. This times a row copy kernel on rank 0 with
``P`` programs (each copies every P-th block of ``ROWS`` rows, ``COLS`` columns per step):

* ``push``:  local rows → the peer's buffer, register stores (the layer0 sends' path);
* ``push_tma``: the same through TMA stores;
* ``pull``:  the peer's rows → a local buffer (peer loads);
* ``push_both``: every rank pushes to its next rank at once (both directions busy, as in the
  fused layers; rank 0's time);
* ``local``: local → local (the same kernel without NVLink);

and the copy engine (``copy_`` into the peer's buffer) for reference.

    torchrun --nproc-per-node 2 -m interlace.tools.peer_bandwidth [--mb 64] [--out DIR]

prints a table (GB/s in all and per program) and writes ``peer_bandwidth.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import triton
import triton.language as tl


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, n_rows, N, ROWS: tl.constexpr, COLS: tl.constexpr,
                      TMA_STORE: tl.constexpr):
    """dst[r, :] = src[r, :] for r < n_rows; program p copies row blocks p, p + P, p + 2P, …"""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    if TMA_STORE:
        dst_desc = tl.make_tensor_descriptor(dst_ptr, shape=[n_rows, N], strides=[N, 1], block_shape=[ROWS, COLS])
    for blk in range(pid, tl.cdiv(n_rows, ROWS), n_prog):
        r = blk * ROWS + tl.arange(0, ROWS)
        rmask = r < n_rows
        rows = r.to(tl.int64)[:, None] * N
        for c0 in range(0, N, COLS):
            cols = c0 + tl.arange(0, COLS)
            m = rmask[:, None] & (cols < N)[None, :]
            v = tl.load(src_ptr + rows + cols[None, :], mask=m)
            if TMA_STORE:
                dst_desc.store([blk * ROWS, c0], v)
            else:
                tl.store(dst_ptr + rows + cols[None, :], v, mask=m)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, programs: int, rows: int = 16, cols: int = 512,
              tma_store: bool = False) -> None:
    """Launch the copy of the (n, N) ``src`` into ``dst`` with ``programs`` programs."""
    if src.shape != dst.shape or src.dim() != 2 or src.dtype != dst.dtype:
        raise ValueError(f"copy_rows needs two (n, N) tensors of one dtype, got {tuple(src.shape)} {src.dtype} "
                         f"and {tuple(dst.shape)} {dst.dtype}")
    if programs < 1:
        raise ValueError(f"programs must be ≥ 1, got {programs}")
    if tma_store:
        from interlace.kernels.tma import ensure_allocator as _ensure_allocator
        _ensure_allocator()  # device-side descriptors need Triton's scratch allocator
    _copy_rows_kernel[(programs,)](src, dst, src.shape[0], src.shape[1], ROWS=rows, COLS=cols, TMA_STORE=tma_store,
                                   num_warps=8)


def _time_ms(fn, iters: int) -> float:
    """Median ms of ``iters`` calls on this rank alone (the harness's CUDA-event timer)."""
    from interlace.tools.bench import time_cuda

    return statistics.median(time_cuda(fn, warmup=1, iters=iters, env=None))


def main(argv=None) -> list[dict]:
    import torch.distributed._symmetric_memory as symm_mem

    from interlace.tools.bench import git_commit, init_env

    p = argparse.ArgumentParser(prog="python -m interlace.tools.peer_bandwidth", description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=64, help="MiB moved per call")
    p.add_argument("--hidden", type=int, default=2048, help="row length (bf16 elements)")
    p.add_argument("--programs", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 132])
    p.add_argument("--rows", nargs="+", type=int, default=[16, 64], help="rows per copy step")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench-out")
    args = p.parse_args(argv)
    env = init_env()
    if not env.cuda or env.world < 2:
        raise SystemExit("peer_bandwidth needs ≥ 2 GPUs under torchrun")
    sms = torch.cuda.get_device_properties(env.device).multi_processor_count
    n = args.mb * 2**20 // (2 * args.hidden)
    local = torch.randn(n, args.hidden, device=env.device).to(torch.bfloat16)
    local_dst = torch.empty_like(local)
    sym = symm_mem.empty(n * args.hidden, dtype=torch.bfloat16, device=env.device)
    hdl = symm_mem.rendezvous(sym, env.group)
    nxt = (env.rank + 1) % env.world
    peer = hdl.get_buffer(nxt, (n, args.hidden), torch.bfloat16)  # the next rank's symmetric buffer
    mine = sym.view(n, args.hidden)
    mine.copy_(local)
    dist.barrier()
    nbytes = n * args.hidden * 2

    def run_case(mode, programs, rows, cols=512):
        tma = mode == "push_tma"
        src, dst = {"push": (local, peer), "push_tma": (local, peer), "push_both": (local, peer),
                    "pull": (peer, local_dst), "local": (local, local_dst)}[mode]
        both = mode == "push_both"
        dist.barrier()
        ms = float("nan")
        if env.rank == 0 or both:
            ms = _time_ms(lambda: copy_rows(src, dst, programs, rows, 256 if tma else cols, tma), args.iters)
            ok = torch.equal(dst, src) if mode != "pull" else torch.equal(local_dst, peer)
            if not ok:
                raise RuntimeError(f"{mode} P={programs} rows={rows}: the copy is wrong")
        dist.barrier()
        return ms

    results = []
    for mode in ("push", "push_tma", "pull", "push_both", "local"):
        for rows in args.rows:
            for programs in args.programs:
                if programs > sms:
                    continue
                ms = run_case(mode, programs, rows)
                if env.rank == 0:
                    gbs = nbytes / (ms * 1e-3) / 1e9
                    results.append(dict(mode=mode, programs=programs, rows=rows, ms=ms, gb_s=gbs,
                                        gb_s_per_program=gbs / programs))
                    print(f"{mode:10s} rows {rows:3d} P {programs:4d}: {ms:8.3f} ms {gbs:7.1f} GB/s "
                          f"{gbs / programs:6.1f} per program", flush=True)
    dist.barrier()
    if env.rank == 0:
        ce = _time_ms(lambda: peer.copy_(local), args.iters)
        results.append(dict(mode="copy_engine", programs=0, rows=0, ms=ce, gb_s=nbytes / (ce * 1e-3) / 1e9,
                            gb_s_per_program=None))
        print(f"copy engine: {ce:.3f} ms {nbytes / (ce * 1e-3) / 1e9:.1f} GB/s", flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "peer_bandwidth.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), world=env.world, mib=args.mb, hidden=args.hidden,
                           commit=git_commit(), results=results), f, indent=1)
    dist.barrier()
    del peer, hdl
    return results


if __name__ == "__main__":
    main()
