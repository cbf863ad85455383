"""What ``auto`` decided, and where it keeps it: :class:`Choice` records, the on-disk
:class:`DecisionCache`, token buckets and the timing marks of calibration calls (the agreement
with the peers is :mod:`interlace.parallel.agreement`). The protocol that uses them is described in :mod:`interlace.strategies.auto`.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from interlace.config import MoEConfig
from interlace.planning.profile import profile_dir, shape_key

DECISIONS_VERSION = 1
SOURCES = ("measured", "cached", "interpolated", "predicted")


def token_bucket(tokens: int) -> int:
    """The bucket of a token count: 0 for none, else the next power of two (≥ 1)."""
    return 0 if tokens <= 0 else 1 << (int(tokens) - 1).bit_length()


def decision_shape(cfg: MoEConfig, world: int) -> str:
    """What a decision depends on besides the token bucket, the mode and the device key:
    the profile's shape class plus top-k and dtype (``N…-K…-El…-act-k2-bfloat16``), and ``-fp8``
    for FP8 experts (``MoEConfig.expert_quant``: other kernels, other decisions)."""
    quant = f"-{cfg.expert_quant}" if cfg.expert_quant else ""
    return f"{shape_key(cfg, world)}-k{cfg.top_k}-{str(cfg.dtype).removeprefix('torch.')}{quant}"


@dataclass
class Choice:
    """One decision of ``auto`` for a (token bucket, mode) key of a layer.

    ``source``: ``"measured"`` (calibrated on this process's calls), ``"cached"`` (a measured
    decision read from the decision cache), ``"interpolated"`` (both measured neighbouring
    buckets agree on it), ``"predicted"`` (from the performance model or a rule, nothing timed).
    ``times_ms``: per candidate, the median over its timed calls of each call's slowest rank's
    time, calls that captured a CUDA graph on some rank left out (what the group agreed on);
    ``predicted_ms``: the model's prediction where it has one.
    ``calibration_ms``: the time of every calibration call (max over ranks), warm-ups included;
    ``overhead_ms``: that minus the same number of calls at the winner's median time.
    """

    spec: str
    source: str
    candidates: list = field(default_factory=list)
    times_ms: dict = field(default_factory=dict)
    predicted_ms: dict = field(default_factory=dict)
    calibration_calls: int = 0
    calibration_ms: float = 0.0
    overhead_ms: float = 0.0
    notes: list = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "Choice":
        return Choice(**{k: d[k] for k in Choice.__dataclass_fields__ if k in d})

    def summary(self) -> str:
        times = ", ".join(f"{s} {ms:.3f}" for s, ms in self.times_ms.items()) or "none timed"
        text = f"{self.spec} ({self.source}; candidates ms: {times}"
        if self.calibration_calls:
            text += f"; calibration {self.calibration_calls} calls, {self.calibration_ms:.1f} ms, " \
                    f"{self.overhead_ms:.1f} ms over the winner"
        elif self.notes:
            text += f"; {self.notes[0]}"
        return text + ")"


SHIPPED_DIR = Path(__file__).resolve().parent.parent / "tuning" / "decisions"


def read_decisions(path: Path) -> dict:
    """The ``decisions`` table of a decisions file, {} where it is missing, unreadable or of
    another version."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data.get("decisions", {}) if data.get("version") == DECISIONS_VERSION else {}


class DecisionCache:
    """Measured decisions of one device key, as JSON at ``<profile dir>/decisions/<key>.json``:

        {"version": 1, "device_key": ..., "decisions": {"<shape>/<mode>": {"<bucket>": Choice}}}

    Beneath the user's file lie the decisions shipped with interlace for the presets
    (``interlace/tuning/decisions/<key>.json``, written by ``benchmarks/auto_grid.py
    --ship``): a bucket the user's file holds wins. Only measured decisions are stored (as
    ``"cached"`` once read back), only into the user's file. Writes replace the file
    atomically; a decision lost to two processes writing at once is measured again.
    """

    def __init__(self, device_key: str, directory: Path | None = None, shipped_dir: Path | None = SHIPPED_DIR):
        self.device_key = device_key
        self.path = (directory or profile_dir() / "decisions") / f"{device_key}.json"
        self.shipped_path = None if shipped_dir is None else Path(shipped_dir) / f"{device_key}.json"
        self._table: dict | None = None
        self._shipped: dict | None = None

    def _load(self) -> dict:
        if self._table is None:
            self._table = read_decisions(self.path)
        return self._table

    def _load_shipped(self) -> dict:
        if self._shipped is None:
            self._shipped = {} if self.shipped_path is None else read_decisions(self.shipped_path)
        return self._shipped

    def measured(self, shape: str, mode: str) -> dict[int, Choice]:
        rows = {**self._load_shipped().get(f"{shape}/{mode}", {}), **self._load().get(f"{shape}/{mode}", {})}
        return {int(b): Choice.from_json(c) for b, c in rows.items()}

    def lookup(self, shape: str, mode: str, bucket: int) -> Choice | None:
        """The decision for ``bucket``: stored for it (``"cached"``), or the one that both the
        nearest measured buckets below and above agree on (``"interpolated"``); else None."""
        table = self.measured(shape, mode)
        if bucket in table:
            c = table[bucket]
            c.source = "cached"
            return c
        below = [b for b in table if 0 < b < bucket]
        above = [b for b in table if b > bucket]
        if not below or not above:
            return None
        lo, hi = max(below), min(above)
        if table[lo].spec != table[hi].spec:
            return None
        return Choice(table[lo].spec, "interpolated", notes=[f"measured buckets {lo} and {hi} both chose it"])

    def store(self, shape: str, mode: str, bucket: int, choice: Choice) -> None:
        """Add a measured decision, merged into what the file holds now."""
        self._table = None
        table = self._load()
        table.setdefault(f"{shape}/{mode}", {})[str(bucket)] = choice.to_json()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": DECISIONS_VERSION, "device_key": self.device_key,
                                       "decisions": table}, indent=1))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only profile dir: the decision still holds for this process


class Clock:
    """Timing marks of calibration calls: CUDA events on a GPU (recorded now, read once at the
    decision), ``perf_counter`` elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def elapsed_ms(self, start, end) -> float:
        if start is None or end is None:
            return math.inf
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end)
        return (end - start) * 1e3


class BackwardMark(torch.autograd.Function):
    """Identity on ``tensors``; its backward calls ``mark()`` (timing a training call's backward:
    on the layer's output it runs first, on its inputs last)."""

    @staticmethod
    def forward(ctx, mark, *tensors):
        ctx.mark = mark
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.mark()
        return (None, *grads)
