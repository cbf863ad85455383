"""The bench's timers and the ceilings it measures in the same run (bf16 matmul peak, peer copy
bandwidth and latency GPU0 → GPU1, HBM read bandwidth): the denominators of its floors.

``env`` is an :class:`interlace.tools.bench.Env` (rank, world, device, cuda) everywhere here.
"""

from __future__ import annotations

import datetime
import statistics
import time
import warnings

import torch
import torch.distributed as dist


def barrier(env) -> None:
    if env.world > 1:
        dist.barrier(device_ids=[env.device.index]) if env.cuda else dist.barrier()


def reduce_max(env, value: float) -> float:
    if env.world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


# ----------------------------------------------------------------------------- ceilings
def measure_matmul_tflops(env, size: int = 8192, iters: int = 10) -> float | None:
    """bf16 matmul size³ on random data, median of ``iters`` after 3 warm-ups (TFLOP/s)."""
    if not env.cuda:
        return None
    a = torch.randn(size, size, device=env.device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=env.device, dtype=torch.bfloat16)
    times = time_cuda(lambda: a @ b, warmup=3, iters=iters, env=None)
    a = b = None  # free 256 MiB before the layer runs
    return 2 * size**3 / (statistics.median(times) * 1e-3) / 1e12


def measure_fp8_matmul_tflops(env, size: int = 8192, iters: int = 10) -> float | None:
    """e4m3 matmul size³ (``torch._scaled_mm``, unit scales, bf16 out) on random data, median of
    ``iters`` after 3 warm-ups (TFLOP/s): the FLOPs peak of an FP8 layer's floor."""
    if not env.cuda:
        return None
    a = torch.randn(size, size, device=env.device).to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device=env.device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=env.device)
    times = time_cuda(lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16), warmup=3, iters=iters,
                      env=None)
    a = b = None
    return 2 * size**3 / (statistics.median(times) * 1e-3) / 1e12


def host_store():
    """The default process group's key-value store (TCP, on the host): ranks that wait on it run
    nothing on any GPU, unlike a collective, whose NCCL kernel spins on the rank's GPU."""
    return dist.distributed_c10d._get_default_store()


_MEASUREMENTS: dict[tuple[int, str], int] = {}  # (rank, name) → calls so far: every rank numbers alike


def rank0_measures(env, measure, name: str, timeout_s: float = 300.0) -> float:
    """``measure()`` run by rank 0 alone while every other rank waits on the host, its result on
    every rank. For peer copies GPU0 → GPU1: a rank waiting in a collective keeps an NCCL kernel
    spinning on its GPU (in another process's context), and rank 0's copy into that GPU then
    waits for a time slice, which inflated the measured latency about a thousandfold.

    Every rank first finishes its own GPU work, the others tell rank 0 through the host store
    that they are idle, rank 0 measures and posts the value (or its error) there. Waits end after
    ``timeout_s`` with an error naming the measurement."""
    if env.cuda:
        torch.cuda.synchronize(env.device)  # nothing of this rank's stays in flight on its GPU
    if env.world == 1:
        return float(measure())
    store, wait = host_store(), datetime.timedelta(seconds=timeout_s)
    call = _MEASUREMENTS[(env.rank, name)] = _MEASUREMENTS.get((env.rank, name), 0) + 1
    tag = f"interlace/bench/{name}/{call}"
    if env.rank != 0:
        store.set(f"{tag}/idle/{env.rank}", "1")
        try:
            store.wait([f"{tag}/result"], wait)
        except Exception as e:  # noqa: BLE001 — the store's timeout error type differs across versions
            raise RuntimeError(f"rank {env.rank}: no {name} from rank 0 within {timeout_s:g} s ({e})") from e
        text = store.get(f"{tag}/result").decode()
        if text.startswith("error:"):
            raise RuntimeError(f"rank 0 failed to measure {name}: {text[len('error:'):]}")
        return float(text)
    try:
        store.wait([f"{tag}/idle/{r}" for r in range(1, env.world)], wait)
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"rank 0: not every rank was idle for {name} within {timeout_s:g} s ({e})") from e
    try:
        value = float(measure())
    except BaseException as e:
        store.set(f"{tag}/result", f"error:{type(e).__name__}: {e}")
        raise
    store.set(f"{tag}/result", repr(value))
    return value


def _peer_copy_gbps(nbytes: int, iters: int) -> float:
    """GPU0 → GPU1 ``copy_`` of ``nbytes`` (GB/s): the median of ``iters`` after 3 warm-ups."""
    src = torch.randn(nbytes // 4, device="cuda:0")
    dst = torch.empty(nbytes // 4, device="cuda:1")
    times = time_cuda(lambda: dst.copy_(src), warmup=3, iters=iters, env=None)
    del src, dst
    torch.cuda.synchronize("cuda:1")
    return nbytes / (statistics.median(times) * 1e-3) / 1e9


def _peer_copy_latency_us(warmup: int, iters: int) -> float:
    """GPU0 → GPU1 ``copy_`` of 4 KiB (µs): the median of ``iters`` after ``warmup`` calls."""
    src = torch.ones(1024, device="cuda:0")
    dst = torch.empty(1024, device="cuda:1")
    times = time_cuda(lambda: dst.copy_(src), warmup=warmup, iters=iters, env=None)
    torch.cuda.synchronize("cuda:1")
    return statistics.median(times) * 1e3


def measure_peer_gbps(env, nbytes: int = 1 << 30, iters: int = 10) -> float | None:
    """Peer copy GPU0 → GPU1 (``copy_`` of a 1 GiB buffer) measured by rank 0 while the other ranks
    wait on the host (:func:`rank0_measures`), in GB/s; None without two GPUs."""
    if not env.cuda or torch.cuda.device_count() < 2:
        return None
    return rank0_measures(env, lambda: _peer_copy_gbps(nbytes, iters), "peer_gbps")


def measure_peer_latency_us(env, warmup: int = 20, iters: int = 100) -> float | None:
    """One-way peer latency GPU0 → GPU1 (µs): the median time of a 4 KiB ``copy_`` over ``iters``
    (≥ 50) calls after ``warmup``, measured by rank 0 while the other ranks wait on the host
    (:func:`rank0_measures`); None without two GPUs. The decode floor counts two (dispatch and
    combine)."""
    if iters < 50:
        raise ValueError(f"peer latency needs >= 50 timed copies for a stable median, got iters={iters}")
    if not env.cuda or torch.cuda.device_count() < 2:
        return None
    return rank0_measures(env, lambda: _peer_copy_latency_us(warmup, iters), "peer_latency_us")


def measure_hbm_read_tbps(env, nbytes: int = 4 << 30, iters: int = 10) -> float | None:
    """HBM read bandwidth (TB/s): a sum over a ``nbytes`` bf16 buffer (a read with a negligible
    write), the slowest rank's median. The decode floor's weight term divides by it."""
    if not env.cuda:
        return None
    buf = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=env.device)
    # (torch.sum takes ``out`` only with ``dim``; the 4-byte result's allocation is noise)
    times = time_cuda(lambda: torch.sum(buf, dtype=torch.float32), warmup=3, iters=iters, env=None)
    del buf
    tbps = nbytes / (statistics.median(times) * 1e-3) / 1e12
    return -reduce_max(env, -tbps)


# ----------------------------------------------------------------------------- timing
def time_cuda(fn, warmup: int, iters: int, env) -> list[float]:
    """Milliseconds per call with CUDA events (a barrier across ranks before each timed call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if env is not None:
            barrier(env)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def time_back_to_back(fn, calls: int, env) -> float:
    """Milliseconds per call of ``calls`` calls issued back to back (one barrier before them, CUDA
    events around them all): the host runs ahead as in a model's forward or a captured decode
    step, so a call's host time hides under the previous call's GPU work unless it syncs."""
    barrier(env)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def time_cpu(fn, warmup: int, iters: int, env) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        barrier(env)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def host_syncs(fn) -> list[warnings.WarningMessage]:
    """Runs ``fn()`` once under torch's sync debug mode and returns the warnings of the host syncs
    it made (each names the call; the mode's one-time prototype notice is no sync). CUDA only."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [w for w in caught if "synchronizing CUDA operation" in str(w.message)]
