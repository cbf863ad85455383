"""The performance profile as data: keys, dataclasses, JSON storage and lookups.

A profile holds what ``interlace profile`` (:mod:`interlace.tools.profile`) measured on one
machine kind, and the terms the planner fitted from it
(:mod:`interlace.planning.pipemoe.calibration`):

* the all-to-all on the expert-parallel group over bytes per rank → a :class:`SizeCurve` and
  its α–β line (PipeMoE Eq. 16);
* per shape class (hidden N, FFN K, experts per rank, activation): one chunk's expert stage
  over rows → a :class:`SizeCurve` and its α–β line (PipeMoE Eqs. 13–15), the raw layer
  timings at several pipeline degrees and token counts, the terms fitted from them, and the
  ``fused`` / ``sequential`` pairs ``auto`` decides from;
* the host cost of one chunk's bookkeeping and the bandwidth of the row gathers;
* per TP shard class (:class:`TPShapeProfile`): what the TP × EP planner needs.

The profile is keyed by device name, SM count, world size, node count and link kind, stored as
JSON under ``$INTERLACE_PROFILE_DIR`` (default ``~/.cache/interlace/profiles``); profiles shipped
in ``interlace/tuning/profiles/`` are found too.

Nothing here measures or fits: this module reads and writes what was measured.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from interlace.env import settings
from interlace.config import MoEConfig
from interlace.planning.pipemoe.models import AlphaBeta, SizeCurve, interp_log_rows

PROFILE_VERSION = 1
PACKAGED_DIR = Path(__file__).resolve().parent.parent / "tuning" / "profiles"


# ----------------------------------------------------------------------------- keys and storage
def profile_dir() -> Path:
    return settings().profile_dir


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
    """Fitted terms of one shape class and mode (see :mod:`interlace.planning.pipemoe.calibration`)."""

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
    :func:`interlace.planning.pipemoe.calibration.calibrate_profile`) are, per mode: ``fixed`` (dispatched rows
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
    TP × EP planner (measured by :mod:`interlace.tools.profile_tp`, fitted by
    :mod:`interlace.planning.monta.tp_profile`): the shard's expert-stage curve, raw
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


def load_profile(world: int, device: torch.device | None = None, path: str | Path | None = None,
                 packaged: bool = True) -> Profile:
    """The profile for this machine and world size (``path`` first if given; the profile
    directory, then with ``packaged`` the profiles shipped in ``interlace/tuning/profiles/``)."""
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



# ----------------------------------------------------------------------------- TP shard classes
def tp_shard_key(cfg: MoEConfig, tp: int, e_local: int) -> str:
    """Key of a TP shard class: ``tp{t}:N{hidden}-K{ffn/t}-El{experts per rank}-{activation}``."""
    return f"tp{tp}:N{cfg.hidden}-K{cfg.ffn // tp}-El{e_local}-{cfg.activation}"


def form_key(form: str, chunks: int) -> str:
    """``O0``, ``O1``, or ``O2:4`` / ``O3:2`` (the chunk count is part of a chunked form)."""
    return f"{form}:{chunks}" if form in ("O2", "O3") else form


def tp_fixed_line(entry: TPShapeProfile, mode: str, rows: int) -> float:
    """The fitted fixed ms at ``rows`` dispatched rows (the forward line where a mode has none),
    never below 0 (a line over a few token counts must not extrapolate negative)."""
    line = entry.fixed.get(mode) or entry.fixed.get("fwd")
    return max(line(rows), 0.0) if line is not None else 0.0


def tp_residual_ratio(entry: TPShapeProfile, mode: str, form: str, rows: int) -> float:
    """Measured / modelled at ``rows`` for ``form`` (a :func:`form_key`), interpolated in
    log(rows) between its calibration points and held flat beyond them; a chunked form not
    measured uses the same form at the nearest measured chunk count; 1 without points."""
    pts = entry.residuals.get(mode, [])
    mine = [(x, q) for x, f, q in pts if f == form]
    if not mine and ":" in form:
        base, n = form.split(":")
        counts = sorted({int(f.split(":")[1]) for _, f, _ in pts if f.startswith(base + ":")},
                        key=lambda c: (abs(math.log(c / int(n))), c))
        if counts:
            mine = [(x, q) for x, f, q in pts if f == f"{base}:{counts[0]}"]
    if not mine or rows <= 0:
        return 1.0
    return interp_log_rows(mine, rows)
