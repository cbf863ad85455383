"""``interlace profile``: microbenchmarks → a JSON performance profile (:mod:`interlace.planning.profile`).

What is measured (each as device time *and* host issue time, since at small sizes the layer is
bound by the host's launch rate):

* the all-to-all on the expert-parallel group, bytes per rank from 64 KiB to 256 MiB
  → a :class:`SizeCurve` and its α–β line (PipeMoE Eq. 16);
* per shape class (hidden N, FFN K, experts per rank, activation): one chunk's expert stage —
  re-layout gather, grouped GEMM, activation, grouped GEMM, gather back — over rows
  → a :class:`SizeCurve` and its α–β line (PipeMoE Eqs. 13–15);
* the host cost of one chunk's bookkeeping (counting sort, re-layout index, dispatch gather,
  combine) and the bandwidth of the row gathers;
* per shape class, the layer itself at degrees 1, 2 and 4 and a few token counts (kept raw in
  the profile): what the op-level model does not explain at degree 1 is fitted as
  α_f + β_f·T, and what it does not explain at higher degrees as a cost per extra chunk plus
  an interference fraction of the overlapped all-to-all time
  (:mod:`interlace.planning.pipemoe.calibration`; refittable offline from the raw points);
* per shape class, the ``fused`` strategy's forward beside ``sequential``'s at the same token
  counts, and ``fused:train``'s forward + backward beside ``sequential``'s (raw pairs; ``auto``
  runs ``fused`` for inference calls and ``fused:train`` for training calls where they measured
  faster). ``interlace profile --fused-from RESULTS.json --out PROFILE.json`` adds such pairs
  from ``interlace bench`` results instead (offline);
* with ``--tp t``, per config its TP shard class (:func:`profile_tp`): each rank holds every
  local expert's K/t slice, so its grouped GEMMs form a shape class the EP profile never timed,
  and a ``tp_ep`` layer call has fixed costs ``sequential``'s calibration does not see (every
  TP rank routes and sorts all T tokens, the count exchange runs over both groups).

Device time of an op is measured with the GPU held back by a sleep kernel while the host queues
n copies, so the events see n back-to-back executions and none of the host's issue time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from interlace.config import MoEConfig
from interlace.experts import init_expert_weights
from interlace.kernels.routing_index import build_dispatch_index, expert_major_index
from interlace.kernels.rows import combine_rows, gather_rows
from interlace.layer import MoELayer
from interlace.parallel import release_shared_buffers
from interlace.parallel.mesh import MoEMesh
from interlace.planning.monta.tp_profile import fit_tp_shape
from interlace.planning.pipemoe.calibration import calibrate_profile
from interlace.planning.pipemoe.models import SizeCurve
from interlace.planning.profile import (Profile, ShapeProfile, TPShapeProfile, load_profile, machine_key, shape_key,
                                        tp_shard_key)
from interlace.strategies.sequential import expert_ffn
from interlace.tools.bench import Env, bench_config, init_env, reduce_max, time_cpu, time_cuda
from interlace.tools.command_line import command_parser


# ----------------------------------------------------------------------------- timing
class Timer:
    """Device time per op (GPU held back by a sleep kernel while n copies are queued) and host
    issue time per op. On the CPU both are host wall time."""

    def __init__(self, device: torch.device, group=None):
        self.device = device
        self.group = group
        self.cuda = device.type == "cuda"
        self._cycles_per_ms = None

    def barrier(self):
        if self.group is not None:
            dist.barrier(group=self.group, device_ids=[self.device.index] if self.cuda else None)

    def _sleep_cycles_per_ms(self) -> float:
        if self._cycles_per_ms is None:
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            torch.cuda._sleep(10_000_000)
            e.record()
            e.synchronize()
            self._cycles_per_ms = 10_000_000 / max(s.elapsed_time(e), 1e-3)
        return self._cycles_per_ms

    def host_ms(self, fn, n: int = 10) -> float:
        fn()
        self.sync()
        self.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t0) * 1e3 / n
        self.sync()
        return host

    def device_ms(self, fn, n: int = 10, host_ms: float | None = None, repeats: int = 3) -> float:
        """Median over ``repeats`` of (device time of n back-to-back calls) / n."""
        if not self.cuda:  # the CPU's device time is its host time: the one given, if measured already
            return host_ms if host_ms is not None else self.host_ms(fn, n)
        host_ms = host_ms if host_ms is not None else self.host_ms(fn, 3)
        results = []
        for _ in range(repeats):
            self.sync()
            self.barrier()
            torch.cuda._sleep(int(self._sleep_cycles_per_ms() * (2.0 * host_ms * n + 0.5)))
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(n):
                fn()
            e.record()
            e.synchronize()
            results.append(s.elapsed_time(e) / n)
        return statistics.median(results)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)


def _progress(iterable, desc: str, enabled: bool):
    if not enabled:
        return iterable
    try:  # tqdm is optional: imported only when progress is shown
        from tqdm import tqdm

        return tqdm(list(iterable), desc=desc, file=sys.stdout, dynamic_ncols=True)
    except ImportError:
        items = list(iterable)

        def gen():
            for i, item in enumerate(items):
                print(f"{desc}: {i + 1}/{len(items)}", flush=True)
                yield item

        return gen()


def _geom_ints(lo: int, hi: int, n: int) -> list[int]:
    if hi <= lo:
        return [max(1, lo)]
    return sorted({max(1, int(round(lo * (hi / lo) ** (i / (n - 1))))) for i in range(n)})


# ----------------------------------------------------------------------------- microbenchmarks
def profile_all_to_all(timer: Timer, world: int, sizes_bytes: list[int], show: bool):
    points, hosts = [], []
    for nbytes in _progress(sizes_bytes, "all-to-all", show):
        elements = max(world * 8, (nbytes // 2) // world * world)  # bf16, equal split over peers
        x = torch.randn(elements, device=timer.device).to(torch.bfloat16)
        out = torch.empty_like(x)

        def op():
            if world > 1:
                dist.all_to_all_single(out, x, group=timer.group)
            else:
                out.copy_(x)

        host = timer.host_ms(op)
        dev = timer.device_ms(op, host_ms=host)
        points.append((x.numel() * 2, dev))
        hosts.append(host)
    return SizeCurve([p[0] for p in points], [p[1] for p in points]), statistics.median(hosts)


def profile_expert_stage(timer: Timer, cfg: MoEConfig, world: int, max_rows: int, show: bool, points: int = 8):
    E_local = cfg.num_experts // world
    w_up, w_down = init_expert_weights(cfg, range(E_local), 0, timer.device)
    lo = max(world * E_local, min(64, max_rows // 8))
    rows_list = _geom_ints(lo if lo < max_rows else max(1, max_rows // 4), max_rows, points)
    times, hosts = [], []
    for rows in _progress(rows_list, f"experts {shape_key(cfg, world)}", show):
        base, extra = divmod(rows, world * E_local)
        counts = torch.full((world * E_local,), base, dtype=torch.int32)
        counts[:extra] += 1
        counts = counts.view(world, E_local).to(timer.device)
        x = torch.randn(rows, cfg.hidden, device=timer.device).to(cfg.dtype)
        src_row, inverse, offs = expert_major_index(counts, rows)

        def op():
            gather_rows(expert_ffn(gather_rows(x, src_row), w_up, w_down, offs, cfg.activation), inverse)

        with torch.no_grad():
            host = timer.host_ms(op, n=5)
            times.append(timer.device_ms(op, n=5, host_ms=host))
        hosts.append(host)
    return SizeCurve(rows_list, times), statistics.median(hosts)


def profile_chunk_bookkeeping(timer: Timer, cfg: MoEConfig, world: int, tokens: int):
    """Host ms per chunk of: the counting sort (pre-sync), re-layout index + dispatch gather,
    and the combine; and the gathers' effective bandwidth."""
    k, E = cfg.top_k, cfg.num_experts
    topk = torch.randint(0, E, (tokens, k), device=timer.device)
    x = torch.randn(tokens, cfg.hidden, device=timer.device).to(cfg.dtype)
    w = torch.rand(tokens, k, device=timer.device)
    rows = tokens * k
    counts = torch.full((world, E // world), rows // E, dtype=torch.int32, device=timer.device)
    n_rows = int(counts.sum())
    row_of, assign, _, _ = build_dispatch_index(topk, E, None)
    y = torch.randn(rows, cfg.hidden, device=timer.device).to(cfg.dtype)
    with torch.no_grad():
        h_index = timer.host_ms(lambda: build_dispatch_index(topk, E, None))
        h_prep = timer.host_ms(lambda: (expert_major_index(counts, n_rows), gather_rows(x, assign, k)))
        h_comb = timer.host_ms(lambda: combine_rows(y, row_of, w, cfg.dtype))
        g_host = timer.host_ms(lambda: gather_rows(x, assign, k))
        g_dev = timer.device_ms(lambda: gather_rows(x, assign, k), host_ms=g_host)
    gbps = 2 * rows * cfg.hidden * x.element_size() / (g_dev * 1e-3) / 1e9
    return {"index": h_index, "prep": h_prep, "combine": h_comb}, gbps


def time_layer_ms(layer, x, timer: Timer, warmup: int = 3, iters: int = 10, backward: bool = False) -> float:
    """Median per-call time of ``layer(x)`` (with ``backward``: forward + backward of a fixed
    random output gradient), slowest rank, events around each call."""
    grad = torch.randn_like(x) if backward else None
    x = x.detach().requires_grad_(backward)

    def call():
        if backward:
            layer(x).backward(grad)
        else:
            with torch.no_grad():
                layer(x)

    call()  # untimed, as the evaluation's correctness call before its warm-ups

    # The evaluation's own timing (interlace.tools.bench), so calibration and evaluation
    # measure alike.
    world = dist.get_world_size(timer.group) if timer.group is not None else 1
    env = Env(dist.get_rank() if world > 1 else 0, world, timer.device, timer.group)
    times = (time_cuda if timer.cuda else time_cpu)(call, warmup, iters, env)
    return reduce_max(env, statistics.median(times))


LAYER_TIMING = {"fwd": (3, 10), "fwdbwd": (2, 6)}  # (warm-up, timed) calls of a profiled layer, by mode


def profile_fused(shape: ShapeProfile, cfg: MoEConfig, x: torch.Tensor, group, timer: Timer,
                  modes=("fwd", "fwdbwd"), timing: dict | None = None) -> None:
    """For mode ``"fwd"``: time ``fused`` and ``sequential`` forwards (no grad, fresh layers, the
    same tokens ``x``) back to back and keep the pair in ``shape.fused``; for ``"fwdbwd"``:
    ``fused:train`` and ``sequential`` forward + backward, kept in ``shape.fused_train``.
    ``timing``: (warm-up, timed) calls by mode (None: :data:`LAYER_TIMING`). Collective: every
    rank, same order."""
    timing = timing or LAYER_TIMING
    for mode in modes:
        strategies = ("fused", "sequential") if mode == "fwd" else ("fused:train", "sequential")
        pair = []
        for strategy in strategies:
            layer = MoELayer(cfg, group=group, strategy=strategy, device=x.device)
            pair.append(time_layer_ms(layer, x, timer, *timing[mode], backward=mode == "fwdbwd"))
            del layer
        release_shared_buffers()  # the fused layer's peer buffer: no later layer of this size shares it
        shape.fused_pairs(mode).append((x.shape[0], cfg.top_k, *pair))


def add_fused_points(prof: Profile, results: dict, replace: bool = False) -> list[str]:
    """Add the fused / sequential pairs of an ``interlace bench`` results.json to ``prof``'s shape
    classes: its ``random``-routing rows where both strategies ran ok, ``fwd`` rows of ``fused``
    (→ ``ShapeProfile.fused``) and ``fwdbwd`` rows of ``fused:train`` (→ ``fused_train``), each
    beside ``sequential`` in the same mode. ``replace``: a shape class these results have pairs
    for first drops its older pairs of that mode (after a change to the fused kernels, old and
    new timings must not be interpolated together). Returns one line per pair added, replaced or
    left out, and why (nothing is dropped silently)."""
    meta = results["meta"]
    if meta["world"] != prof.world:
        raise ValueError(f"results of world size {meta['world']} do not belong in profile {prof.key} "
                         f"(world size {prof.world})")
    small = meta.get("small", "--small" in meta.get("command", ""))
    ms = {(r["config"], r["tokens"], r["mode"], r["strategy"]): r["median_ms"] for r in results["rows"]
          if r.get("status") == "ok" and r["routing"] == "random" and r.get("median_ms")}
    lines = []
    cleared: set[tuple[str, str]] = set()
    for mode, fused in (("fwd", "fused"), ("fwdbwd", "fused:train")):
        for name, tokens in sorted({(c, t) for c, t, m, s in ms if m == mode and s == fused}):
            cfg = bench_config(name, small)
            skey = shape_key(cfg, prof.world)
            seq = ms.get((name, tokens, mode, "sequential"))
            what = f"{name} T={tokens} {mode}"
            if seq is None:
                lines.append(f"{what}: left out (no sequential row beside it)")
            elif skey not in prof.shapes:
                lines.append(f"{what}: left out (shape class {skey} not in the profile; profile it first)")
            else:
                pairs = prof.shapes[skey].fused_pairs(mode)
                if replace and (skey, mode) not in cleared:
                    cleared.add((skey, mode))
                    if pairs:
                        lines.append(f"{skey}: {len(pairs)} older {mode} pairs dropped (--fused-replace)")
                    pairs.clear()
                pairs.append((tokens, cfg.top_k, ms[(name, tokens, mode, fused)], seq))
                lines.append(f"{what}: {skey} {fused} {ms[(name, tokens, mode, fused)]:.3f} ms, "
                             f"sequential {seq:.3f} ms")
    prof.meta.setdefault("fused_points_from", []).append(
        f"{meta.get('date', '?')} {meta.get('device', '?')} commit {meta.get('commit', '?')}")
    return lines


def run_profile(configs: list[MoEConfig], tokens: list[int], group=None, device=None, show: bool = True,
                existing: Profile | None = None, a2a_max_bytes: int | None = None,
                calibration_degrees=(2, 3, 4, 6, 8, 12, 16), fwdbwd_degrees=(2, 4),
                fused: bool = True, timing: dict | None = None, expert_points: int = 8) -> Profile:
    """Measure everything the planner needs for ``configs`` (their shape classes) on this
    machine; returns the profile (``existing`` is extended, not re-measured, where it can be).

    The all-to-all sweep reaches the largest exchange the calibration runs (so the planner
    interpolates instead of extrapolating); the layer is timed at degree 1 and
    ``calibration_degrees`` forward, and at 1 and ``fwdbwd_degrees`` forward + backward (empty:
    no backward points; the planner then predicts training steps with the forward terms).
    With ``fused`` (and more than one rank) the fused strategy's forward is timed beside
    sequential's at each token count, also for shape classes ``existing`` has without them.
    ``timing``: (warm-up, timed) calls of each layer timing by mode, ``"fwd"`` and ``"fwdbwd"``
    (None: :data:`LAYER_TIMING`; fewer only for a smoke run: the planner fits these points).
    ``expert_points``: row counts of each expert-stage sweep (:func:`profile_expert_stage`).
    """
    timing = timing or LAYER_TIMING
    world = dist.get_world_size(group) if group is not None else 1
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                        else torch.device("cpu"))
    timer = Timer(device, group)
    key = machine_key(world, device)
    if existing is not None and existing.key == key:
        prof = existing
    else:
        if a2a_max_bytes is None:
            biggest = max(max(tokens) * c.top_k * c.hidden * torch.empty((), dtype=c.dtype).element_size()
                          for c in configs)
            a2a_max_bytes = max(256 << 20, min(biggest, 8 << 30))
        n = max(12, round(math.log(a2a_max_bytes / (64 << 10)) / math.log(2.2)) + 1)
        sizes = _geom_ints(64 << 10, a2a_max_bytes, n) if device.type == "cuda" else _geom_ints(4 << 10, 1 << 20, 4)
        a2a, a2a_host = profile_all_to_all(timer, world, sizes, show)
        host, gbps = profile_chunk_bookkeeping(timer, configs[0], world, max(tokens))
        prof = Profile(key, world, a2a, a2a_host, gbps, host, meta={
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "device": str(device)})
    fused = fused and world > 1
    for cfg in configs:
        skey = shape_key(cfg, world)
        if skey in prof.shapes:
            missing = [m for m in ("fwd", "fwdbwd") if not prof.shapes[skey].fused_pairs(m)]
            if fused and missing:  # an older profile: measure only the pairs it lacks
                for T in _progress(tokens, f"fused {skey}", show):
                    gen = torch.Generator(device=device).manual_seed(1234 + T)
                    x = torch.randn(T, cfg.hidden, device=device, generator=gen).to(cfg.dtype)
                    profile_fused(prof.shapes[skey], cfg, x, group, timer, missing, timing)
            continue
        curve, e_host = profile_expert_stage(timer, cfg, world, max(tokens) * cfg.top_k, show, expert_points)
        shape = prof.shapes[skey] = ShapeProfile(curve, e_host)
        # Measured exactly as `interlace pipeline-eval` measures (interlace.tools.evaluate.run_eval):
        # a fresh layer per token count, one untimed call per degree, then the timed calls. One
        # layer object timed over all token counts degree by degree made the host-bound points
        # (small T, many chunks) slower than the evaluation measures them.
        fwd_runs = [(r, False) for r in (1, *calibration_degrees)]
        bwd_runs = [(r, True) for r in ((1, *fwdbwd_degrees) if fwdbwd_degrees else ())]
        for T in _progress(tokens, f"layer {skey}", show):
            layer = MoELayer(cfg, group=group, strategy="pipelined", strategy_options={"degree": 1}, device=device)
            gen = torch.Generator(device=device).manual_seed(1234 + T)
            x = torch.randn(T, cfg.hidden, device=device, generator=gen).to(cfg.dtype)
            for r, backward in fwd_runs + bwd_runs:
                if T < 2 * r:
                    continue
                layer.set_strategy("pipelined", degree=r)
                ms = time_layer_ms(layer, x, timer, *timing["fwdbwd" if backward else "fwd"], backward=backward)
                (shape.calibration_fwdbwd if backward else shape.calibration).append((T, cfg.top_k, r, ms))
            del layer
            if fused:
                profile_fused(shape, cfg, x, group, timer, timing=timing)
            del x
            if device.type == "cuda":
                torch.cuda.empty_cache()
    calibrate_profile(prof)
    return prof


def profile_tp(prof: Profile, configs: list[MoEConfig], tokens: list[int], tp: int, show: bool = True,
               warmup: int = 3, iters: int = 10, forms=("O0", "O1", "O2:2", "O3:2", "O2:4", "O3:4"),
               expert_points: int = 8) -> None:
    """Measure each config's TP shard class on a TP = ``tp`` mesh over the whole world into
    ``prof.tp_shapes`` and fit it (:func:`interlace.planning.monta.tp_profile.fit_tp_shape`):
    the shard's expert stage (as :func:`profile_expert_stage` does for EP classes) and the
    ``tp_ep`` layer in each form forward and forward + backward at ``tokens`` (collective: every
    rank calls it with the same arguments). ``expert_points``: row counts of the expert-stage
    sweep (fewer only for a smoke run)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % tp:
        raise ValueError(f"tp={tp} must divide the world size {world}")
    ep = world // tp
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mesh = MoEMesh.build(tp=tp, ep=ep)
    timer = Timer(device, dist.group.WORLD if dist.is_initialized() else None)  # barrier + slowest rank
    for cfg in configs:
        key = tp_shard_key(cfg, tp, cfg.num_experts // ep)
        if key in prof.tp_shapes:
            continue
        # The shard's grouped GEMMs: E/ep experts of K/tp, rows arriving from `ep` sources.
        shard = replace(cfg, ffn=cfg.ffn // tp)
        curve, _ = profile_expert_stage(timer, shard, ep, max(tokens) * cfg.top_k, show, expert_points)
        entry = prof.tp_shapes[key] = TPShapeProfile(tp, curve)
        for T in _progress(tokens, f"layer {key}", show):
            layer = MoELayer(cfg, mesh=mesh, strategy="tp_ep:O0", seed=0, device=device)
            gen = torch.Generator(device=device).manual_seed(4321 + T + mesh.ep_rank)  # TP ranks: same tokens
            x = torch.randn(T, cfg.hidden, device=device, generator=gen).to(cfg.dtype)
            for form in forms:
                base, _, n = form.partition(":")
                layer.set_strategy(f"tp_ep:{base}" + (f"-{n}" if n else ""))
                entry.calibration.append((T, cfg.top_k, time_layer_ms(layer, x, timer, warmup, iters), form))
                # (one warm-up fewer and half the timed calls, at least 1 and 2, or fewer where asked)
                entry.calibration_fwdbwd.append(
                    (T, cfg.top_k, time_layer_ms(layer, x, timer, min(warmup, max(1, warmup - 1)),
                                                 min(iters, max(2, iters // 2)), backward=True), form))
            del layer, x
            if device.type == "cuda":
                torch.cuda.empty_cache()
        fit_tp_shape(prof, cfg, tp, ep)


def parser() -> argparse.ArgumentParser:
    p = command_parser("profile", "Microbenchmarks of this machine (the all-to-all, each shape class's expert "
                                  "stage, the host's per-chunk costs) written as the JSON performance profile "
                                  "the pipelined and auto strategies plan with.")
    p.add_argument("--configs", nargs="+", default=["mixtral-8x7b", "qwen2-moe", "flashdmoe-cfg"],
                   help="presets whose shape classes to measure")
    p.add_argument("--tokens", nargs="+", type=int, default=[1000, 3000, 12000, 40000],
                   help="tokens per rank for the fixed-cost fit (the largest also sizes the expert sweep)")
    p.add_argument("--out", default=None, help="profile path (default: the profile directory)")
    p.add_argument("--tp", type=int, default=None,
                   help="also measure the --configs' TP shard classes on a TP = this mesh "
                        "(profile_tp; the TP x EP planner uses them)")
    p.add_argument("--no-fused", action="store_true",
                   help="do not time fused (forward) and fused:train (training) beside sequential")
    p.add_argument("--fused-from", nargs="+", default=None, metavar="RESULTS_JSON",
                   help="offline, no measurement: add the fused/sequential forward pairs of these "
                        "interlace bench results to the profile --out")
    p.add_argument("--fused-replace", action="store_true",
                   help="with --fused-from: shape classes in those results drop their older pairs first")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.fused_from:
        if not args.out:
            p.error("--fused-from needs --out PROFILE.json (the profile to extend)")
        prof = Profile.from_json(json.loads(Path(args.out).read_text()))
        for path in args.fused_from:
            for line in add_fused_points(prof, json.loads(Path(path).read_text()), replace=args.fused_replace):
                print(line)
        print(f"→ {prof.save(args.out)}")
        return 0
    env = init_env()
    try:
        # Extend the user's own profile, never the shipped one (that would skip every shape it has).
        existing = load_profile(env.world, env.device, args.out if args.out and Path(args.out).exists() else None,
                                packaged=False)
    except (FileNotFoundError, ValueError):
        existing = None
    prof = run_profile([bench_config(c, small=False) for c in args.configs], args.tokens, env.group, env.device,
                       show=env.rank == 0, existing=existing, fused=not args.no_fused)
    if args.tp:
        profile_tp(prof, [bench_config(c, small=False) for c in args.configs], args.tokens, args.tp,
                   show=env.rank == 0)
    if env.rank == 0:
        path = prof.save(args.out)
        print(f"profile {prof.key}: all-to-all α {prof.a2a.line.alpha * 1e3:.1f} µs, "
              f"β {1 / max(prof.a2a.line.beta, 1e-30) / 1e6:.1f} GB/s; {len(prof.shapes)} shape classes → {path}")
    if dist.is_initialized():
        dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
