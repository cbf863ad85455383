"""``interlace profile``: microbenchmarks → a JSON performance profile.

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
  (:func:`interlace.planning.pipemoe.degree.calibrate`; refittable offline from the raw points);
* per shape class, the ``fused`` strategy's forward beside ``sequential``'s at the same token
  counts, and ``fused:train``'s forward + backward beside ``sequential``'s (raw pairs; ``auto``
  runs ``fused`` for inference calls and ``fused:train`` for training calls where they measured
  faster). ``interlace profile --fused-from RESULTS.json --out PROFILE.json`` adds such pairs
  from ``interlace bench`` results instead (offline).

Device time of an op is measured with the GPU held back by a sleep kernel while the host queues
n copies, so the events see n back-to-back executions and none of the host's issue time.

The profile is keyed by device name, SM count, world size, node count and link kind, stored as
JSON under ``$INTERLACE_PROFILE_DIR`` (default ``~/.cache/interlace/profiles``); profiles shipped
in ``interlace/profiles/`` are found too.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from interlace.config import MoEConfig
from interlace.planning.pipemoe.models import AlphaBeta, SizeCurve
from interlace import env

PROFILE_VERSION = 1
PACKAGED_DIR = Path(__file__).resolve().parent.parent / "tuning" / "profiles"


# ----------------------------------------------------------------------------- keys and storage
def profile_dir() -> Path:
    return env.get().profile_dir


def machine_key(world: int, device: torch.device) -> str:
    """``<device>-sm<SMs>-w<world>-n<nodes>-<link>``: what the measurements depend on."""
    nodes = max(1, int(os.environ.get("WORLD_SIZE", world)) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        count = torch.cuda.device_count()
        peer = all(torch.cuda.can_device_access_peer(i, j) for i in range(count) for j in range(count) if i != j)
        link = "p2p" if peer else "nop2p"
    else:
        name, sms, link = "cpu", os.cpu_count() or 1, "gloo"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{name}-sm{sms}-w{world}-n{nodes}-{link}")


def shape_key(cfg: MoEConfig, world: int) -> str:
    return f"N{cfg.hidden}-K{cfg.ffn}-El{cfg.num_experts // world}-{cfg.activation}"


def parse_shape_key(key: str) -> tuple[int, int, int, str]:
    m = re.fullmatch(r"N(\d+)-K(\d+)-El(\d+)-(\w+)", key)
    if not m:
        raise ValueError(f"bad shape key {key!r}")
    return int(m[1]), int(m[2]), int(m[3]), m[4]


MODES = ("fwd", "fwdbwd")  # forward only (eval / no grad) and a training step's forward + backward


@dataclass
class Calibration:
    """Fitted terms of one shape class and mode (see :mod:`interlace.planning.pipemoe.degree`)."""

    fixed: AlphaBeta = field(default_factory=lambda: AlphaBeta(0.0, 0.0))  # over dispatched rows T·k
    pipe_ms: float = 0.0
    chunk_ms: float = 0.0
    interference: float = 0.0
    model_error: float = 0.0

    def to_json(self) -> dict:
        return {"fixed": self.fixed.to_json(), "pipe_ms": self.pipe_ms, "chunk_ms": self.chunk_ms,
                "interference": self.interference, "model_error": self.model_error}

    @staticmethod
    def from_json(d: dict) -> "Calibration":
        return Calibration(AlphaBeta.from_json(d["fixed"]), d.get("pipe_ms", 0.0), d.get("chunk_ms", 0.0),
                           d.get("interference", 0.0), d.get("model_error", 0.0))


@dataclass
class ShapeProfile:
    """Measurements of one shape class and the calibrations fitted from them.

    ``calibration`` holds the raw forward layer timings ``(tokens, top_k, degree, ms)`` and
    ``calibration_fwdbwd`` those of forward + backward; the fitted terms (see
    :func:`interlace.planning.pipemoe.degree.calibrate_profile`) are, per mode: ``fixed`` (dispatched rows
    → ms of a degree-1 call that the op model leaves out: routing, count exchange, host sync),
    ``pipe_ms`` (the pipelined code path's fixed extra over ``sequential``), ``chunk_ms`` (what
    each extra chunk costs on the device beyond the model) and ``interference`` (the fraction
    of every overlapped all-to-all's time that the compute it overlaps loses: NCCL kernels take
    SMs and memory bandwidth from the GEMMs). The forward terms are the flat fields (the
    profile format of earlier versions); the forward + backward ones live in ``train``.
    """

    expert: SizeCurve  # received rows of one chunk → device ms of its expert stage
    expert_host_ms: float
    fixed: AlphaBeta = field(default_factory=lambda: AlphaBeta(0.0, 0.0))  # over dispatched rows T·k
    chunk_ms: float = 0.0
    interference: float = 0.0
    calibration: list = field(default_factory=list)
    model_error: float = 0.0  # RMS relative error of the calibrated model on ``calibration``
    pipe_ms: float = 0.0
    calibration_fwdbwd: list = field(default_factory=list)
    train: Calibration | None = None  # forward + backward terms (None: use the forward ones)
    chunk_host_ms: float | None = None  # fitted host time per chunk (None: the profile's value)
    # Per mode, the calibrated model's measured/predicted ratio at each raw point
    # ``[rows T·k, degree, ratio]`` (:func:`interlace.planning.pipemoe.degree.residual_ratio` interpolates it).
    residuals: dict = field(default_factory=dict)
    # Forward of the fused strategy beside sequential's, measured together:
    # ``[tokens, top_k, fused ms, sequential ms]`` (:func:`interlace.planning.pipemoe.degree.fused_speedup`).
    fused: list = field(default_factory=list)
    # The same for training calls (forward + backward): ``fused:train`` beside ``sequential``.
    fused_train: list = field(default_factory=list)

    def fused_pairs(self, mode: str) -> list:
        return self.fused if mode == "fwd" else self.fused_train

    def points(self, mode: str) -> list:
        return self.calibration if mode == "fwd" else self.calibration_fwdbwd

    def terms(self, mode: str) -> Calibration:
        if mode == "fwd" or self.train is None:
            return Calibration(self.fixed, self.pipe_ms, self.chunk_ms, self.interference, self.model_error)
        return self.train

    def set_terms(self, mode: str, cal: Calibration) -> None:
        if mode == "fwd":
            self.fixed, self.pipe_ms, self.chunk_ms = cal.fixed, cal.pipe_ms, cal.chunk_ms
            self.interference, self.model_error = cal.interference, cal.model_error
        else:
            self.train = cal

    def to_json(self) -> dict:
        d = {"expert": self.expert.to_json(), "expert_host_ms": self.expert_host_ms,
             **self.terms("fwd").to_json(), "calibration": self.calibration}
        if self.calibration_fwdbwd:
            d["calibration_fwdbwd"] = self.calibration_fwdbwd
        if self.train is not None:
            d["train"] = self.train.to_json()
        if self.chunk_host_ms is not None:
            d["chunk_host_ms"] = self.chunk_host_ms
        if self.residuals:
            d["residuals"] = self.residuals
        if self.fused:
            d["fused"] = self.fused
        if self.fused_train:
            d["fused_train"] = self.fused_train
        return d

    @staticmethod
    def from_json(d: dict) -> "ShapeProfile":
        fwd = Calibration.from_json(d)
        return ShapeProfile(SizeCurve.from_json(d["expert"]), d["expert_host_ms"], fwd.fixed, fwd.chunk_ms,
                            fwd.interference, d.get("calibration", []), fwd.model_error, fwd.pipe_ms,
                            d.get("calibration_fwdbwd", []),
                            Calibration.from_json(d["train"]) if "train" in d else None, d.get("chunk_host_ms"),
                            d.get("residuals", {}), d.get("fused", []), d.get("fused_train", []))


@dataclass
class TPShapeProfile:
    """Measurements of one TP shard class (each rank holds K/tp of every local expert) for the
    TP × EP planner (:mod:`interlace.planning.monta.tp_profile`): the shard's expert-stage curve, raw
    ``tp_ep`` layer timings ``(tokens, top_k, ms, form)`` forward and forward + backward on a
    TP = ``tp`` mesh, and the fitted line over dispatched rows T·k of what the planner's op
    simulation of that layer leaves out (routing of all T tokens on every TP rank, the count
    exchange over both groups, the host sync), per mode."""

    tp: int
    expert: SizeCurve
    calibration: list = field(default_factory=list)
    calibration_fwdbwd: list = field(default_factory=list)
    fixed: dict = field(default_factory=dict)  # mode → AlphaBeta
    residuals: dict = field(default_factory=dict)  # mode → [[rows, form, measured/modelled], ...]

    def to_json(self) -> dict:
        return {"tp": self.tp, "expert": self.expert.to_json(), "calibration": self.calibration,
                "calibration_fwdbwd": self.calibration_fwdbwd,
                "fixed": {m: ab.to_json() for m, ab in self.fixed.items()}, "residuals": self.residuals}

    @staticmethod
    def from_json(d: dict) -> "TPShapeProfile":
        return TPShapeProfile(d["tp"], SizeCurve.from_json(d["expert"]), d.get("calibration", []),
                              d.get("calibration_fwdbwd", []),
                              {m: AlphaBeta.from_json(v) for m, v in d.get("fixed", {}).items()},
                              d.get("residuals", {}))


@dataclass
class Profile:
    key: str
    world: int
    a2a: SizeCurve  # bytes sent per rank → device ms
    a2a_host_ms: float
    copy_gbps: float  # row gathers: (bytes read + written) / device time
    host_ms: dict  # host cost per chunk: "index" (pre-sync), "prep", "combine" (post-sync)
    shapes: dict[str, ShapeProfile] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    chunk_host_ms: float = 0.0  # fitted host time per chunk: median of the shape classes' values
    tp_shapes: dict[str, TPShapeProfile] = field(default_factory=dict)  # interlace.planning.monta.tp_profile

    def to_json(self) -> dict:
        d = {"version": PROFILE_VERSION, "key": self.key, "world": self.world, "meta": self.meta,
             "a2a": self.a2a.to_json(), "a2a_host_ms": self.a2a_host_ms, "copy_gbps": self.copy_gbps,
             "host_ms": self.host_ms, "chunk_host_ms": self.chunk_host_ms,
             "shapes": {k: v.to_json() for k, v in self.shapes.items()}}
        if self.tp_shapes:
            d["tp_shapes"] = {k: v.to_json() for k, v in self.tp_shapes.items()}
        return d

    @staticmethod
    def from_json(d: dict) -> "Profile":
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {d.get('version')} is not {PROFILE_VERSION}; run `interlace profile` again")
        return Profile(d["key"], d["world"], SizeCurve.from_json(d["a2a"]), d["a2a_host_ms"], d["copy_gbps"],
                       d["host_ms"], {k: ShapeProfile.from_json(v) for k, v in d["shapes"].items()}, d.get("meta", {}),
                       d.get("chunk_host_ms", 0.0),
                       {k: TPShapeProfile.from_json(v) for k, v in d.get("tp_shapes", {}).items()})

    def save(self, path: str | Path | None = None) -> Path:
        path = Path(path) if path else profile_dir() / f"{self.key}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path

    def shape(self, key: str) -> tuple[str, ShapeProfile]:
        """The profile of a shape class: exact, else the nearest measured class (log distance
        over N, K and experts per rank, same activation), which the caller should report."""
        if key in self.shapes:
            return key, self.shapes[key]
        if not self.shapes:
            raise FileNotFoundError(f"profile {self.key} has no shape classes; run `interlace profile`")
        n, k, el, act = parse_shape_key(key)

        def distance(other: str) -> float:
            n2, k2, el2, act2 = parse_shape_key(other)
            return (abs(math.log(n / n2)) + abs(math.log(k / k2)) + abs(math.log(el / el2))
                    + (10.0 if act2 != act else 0.0))

        best = min(self.shapes, key=distance)
        return best, self.shapes[best]


def merge_points(prof: Profile, others: list[Profile]) -> Profile:
    """Add the raw layer timings of ``others`` (earlier runs on the same machine kind) to the
    shape classes ``prof`` has, in place, and refit (the curves stay ``prof``'s own).

    Why: a profile's layer timings drift between phases of a job and between machine leases
    (2× H200 runs 7 and 13: the same host-bound points ±30%), and each profile's calibration
    then carries its own lease's bias. Points pooled over several runs average that out.
    """
    from interlace.planning.pipemoe.degree import calibrate_profile

    merged = []
    for other in others:
        if other.key != prof.key:
            raise ValueError(f"cannot merge profile {other.key} into {prof.key}: another machine or world size")
        for skey, shape in prof.shapes.items():
            if skey in other.shapes:
                shape.calibration = list(shape.calibration) + list(other.shapes[skey].calibration)
                shape.calibration_fwdbwd = list(shape.calibration_fwdbwd) + list(other.shapes[skey].calibration_fwdbwd)
        merged.append(other.meta.get("created", "?"))
    prof.meta["merged_points_from"] = prof.meta.get("merged_points_from", []) + merged
    calibrate_profile(prof)
    return prof


def load_profile(world: int, device: torch.device | None = None, path: str | Path | None = None,
                 packaged: bool = True) -> Profile:
    """The profile for this machine and world size (``path`` first if given; the profile
    directory, then with ``packaged`` the profiles shipped in ``interlace/profiles/``)."""
    if path is not None:
        return Profile.from_json(json.loads(Path(path).read_text()))
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                        else torch.device("cpu"))
    key = machine_key(world, device)
    searched = [profile_dir() / f"{key}.json"] + ([PACKAGED_DIR / f"{key}.json"] if packaged else [])
    for candidate in searched:
        if candidate.exists():
            return Profile.from_json(json.loads(candidate.read_text()))
    raise FileNotFoundError(f"no performance profile {key}.json in {', '.join(str(p.parent) for p in searched)}")


def as_profile(profile, world: int) -> Profile:
    """The :class:`Profile` that ``profile`` names: itself, a JSON path, or None (this machine's
    stored profile for ``world`` ranks, see :func:`load_profile`)."""
    return profile if isinstance(profile, Profile) else load_profile(world, path=profile)


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
        if not self.cuda:
            return self.host_ms(fn, n)
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
    try:
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
    from interlace.experts import init_expert_weights
    from interlace.kernels.routing_index import expert_major_index
    from interlace.kernels.rows import gather_rows
    from interlace.strategies.sequential import expert_ffn

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
    from interlace.kernels.routing_index import build_dispatch_index, expert_major_index
    from interlace.kernels.rows import combine_rows, gather_rows

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
    from interlace.tools.bench import Env, reduce_max, time_cpu, time_cuda

    world = dist.get_world_size(timer.group) if timer.group is not None else 1
    env = Env(dist.get_rank() if world > 1 else 0, world, timer.device, timer.group)
    times = (time_cuda if timer.cuda else time_cpu)(call, warmup, iters, env)
    return reduce_max(env, statistics.median(times))


def profile_fused(shape: ShapeProfile, cfg: MoEConfig, x: torch.Tensor, group, timer: Timer,
                  modes=("fwd", "fwdbwd")) -> None:
    """For mode ``"fwd"``: time ``fused`` and ``sequential`` forwards (no grad, fresh layers, the
    same tokens ``x``) back to back and keep the pair in ``shape.fused``; for ``"fwdbwd"``:
    ``fused:train`` and ``sequential`` forward + backward, kept in ``shape.fused_train``.
    Collective: every rank, same order."""
    from interlace.layer import MoELayer
    from interlace.parallel import release_shared_buffers

    for mode in modes:
        strategies = ("fused", "sequential") if mode == "fwd" else ("fused:train", "sequential")
        pair = []
        for strategy in strategies:
            layer = MoELayer(cfg, group=group, strategy=strategy, device=x.device)
            pair.append(time_layer_ms(layer, x, timer, *((2, 6) if mode == "fwdbwd" else (3, 10)),
                                      backward=mode == "fwdbwd"))
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
    from interlace.tools.bench import bench_config

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
                fused: bool = True) -> Profile:
    """Measure everything the planner needs for ``configs`` (their shape classes) on this
    machine; returns the profile (``existing`` is extended, not re-measured, where it can be).

    The all-to-all sweep reaches the largest exchange the calibration runs (so the planner
    interpolates instead of extrapolating); the layer is timed at degree 1 and
    ``calibration_degrees`` forward, and at 1 and ``fwdbwd_degrees`` forward + backward (empty:
    no backward points; the planner then predicts training steps with the forward terms).
    With ``fused`` (and more than one rank) the fused strategy's forward is timed beside
    sequential's at each token count, also for shape classes ``existing`` has without them.
    """
    from interlace.layer import MoELayer
    from interlace.planning.pipemoe.degree import calibrate_profile

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
                    profile_fused(prof.shapes[skey], cfg, x, group, timer, missing)
            continue
        curve, e_host = profile_expert_stage(timer, cfg, world, max(tokens) * cfg.top_k, show)
        shape = prof.shapes[skey] = ShapeProfile(curve, e_host)
        # Measured exactly as `interlace pipeline-eval` measures (interlace.tools.evaluate.run_eval):
        # a fresh layer per token count, one untimed call per degree, then the timed calls. Run
        # 13 timed one layer object over all token counts degree by degree, and its host-bound
        # points (small T, many chunks) came out up to 2x slower than the evaluation's.
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
                ms = time_layer_ms(layer, x, timer, *((2, 6) if backward else (3, 10)), backward=backward)
                (shape.calibration_fwdbwd if backward else shape.calibration).append((T, cfg.top_k, r, ms))
            del layer
            if fused:
                profile_fused(shape, cfg, x, group, timer)
            del x
            if device.type == "cuda":
                torch.cuda.empty_cache()
    calibrate_profile(prof)
    return prof


def main(argv=None) -> int:
    import argparse

    from interlace.tools.bench import bench_config, init_env

    p = argparse.ArgumentParser(prog="interlace profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["mixtral-8x7b", "qwen2-moe", "flashdmoe-cfg"],
                   help="presets whose shape classes to measure")
    p.add_argument("--tokens", nargs="+", type=int, default=[1000, 3000, 12000, 40000],
                   help="tokens per rank for the fixed-cost fit (the largest also sizes the expert sweep)")
    p.add_argument("--out", default=None, help="profile path (default: the profile directory)")
    p.add_argument("--tp", type=int, default=None,
                   help="also measure the --configs' TP shard classes on a TP = this mesh "
                        "(interlace.planning.monta.tp_profile; the TP x EP planner uses them)")
    p.add_argument("--no-fused", action="store_true",
                   help="do not time fused (forward) and fused:train (training) beside sequential")
    p.add_argument("--fused-from", nargs="+", default=None, metavar="RESULTS_JSON",
                   help="offline, no measurement: add the fused/sequential forward pairs of these "
                        "`interlace bench` results to the profile --out")
    p.add_argument("--fused-replace", action="store_true",
                   help="with --fused-from: shape classes in those results drop their older pairs first")
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
        from interlace.planning.monta.tp_profile import profile_tp

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
