"""What ``auto`` decided, and where it keeps it: :class:`Choice` records, the on-disk
:class:`DecisionCache`, token buckets, the lagged token-count agreement and the timing marks of
calibration calls. The protocol that uses them is described in :mod:`interlace.strategies.auto`.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from interlace.config import MoEConfig
from interlace.parallel.comm import ExpertParallel
from interlace.planning.profile import profile_dir, shape_key

DECISIONS_VERSION = 1
SOURCES = ("measured", "cached", "interpolated", "predicted")


def token_bucket(tokens: int) -> int:
    """The bucket of a token count: 0 for none, else the next power of two (≥ 1)."""
    return 0 if tokens <= 0 else 1 << (int(tokens) - 1).bit_length()


def decision_shape(cfg: MoEConfig, world: int) -> str:
    """What a decision depends on besides the token bucket, the mode and the device key:
    the profile's shape class plus top-k and dtype (``N…-K…-El…-act-k2-bfloat16``)."""
    return f"{shape_key(cfg, world)}-k{cfg.top_k}-{str(cfg.dtype).removeprefix('torch.')}"


@dataclass
class Choice:
    """One decision of ``auto`` for a (token bucket, mode) key of a layer.

    ``source``: ``"measured"`` (calibrated on this process's calls), ``"cached"`` (a measured
    decision read from the decision cache), ``"interpolated"`` (both measured neighbouring
    buckets agree on it), ``"predicted"`` (from the performance model or a rule, nothing timed).
    ``times_ms``: per candidate, the median over its timed calls, max over ranks (what the
    group agreed on); ``predicted_ms``: the model's prediction where it has one.
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


class DecisionCache:
    """Measured decisions of one device key, as JSON at ``<profile dir>/decisions/<key>.json``:

        {"version": 1, "device_key": ..., "decisions": {"<shape>/<mode>": {"<bucket>": Choice}}}

    Only measured decisions are stored (as ``"cached"`` once read back). Writes replace the
    file atomically; a decision lost to two processes writing at once is measured again.
    """

    def __init__(self, device_key: str, directory: Path | None = None):
        self.device_key = device_key
        self.path = (directory or profile_dir() / "decisions") / f"{device_key}.json"
        self._table: dict | None = None

    def _load(self) -> dict:
        if self._table is None:
            self._table = {}
            if self.path.exists():
                try:
                    data = json.loads(self.path.read_text())
                except (OSError, ValueError):
                    data = {}
                if data.get("version") == DECISIONS_VERSION:
                    self._table = data.get("decisions", {})
        return self._table

    def measured(self, shape: str, mode: str) -> dict[int, Choice]:
        return {int(b): Choice.from_json(c) for b, c in self._load().get(f"{shape}/{mode}", {}).items()}

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


class TokenAgreement:
    """The group's largest token count per call, agreed with a lag (one small all-reduce per call).

    :meth:`post` enqueues ``all_reduce(MAX)`` of this rank's count; on NCCL it does not block the
    host (the result is copied to pinned host memory behind a CUDA event). :meth:`previous`
    reads the result posted at the call before (that event has long completed: a whole layer
    call ran since), :meth:`current` the one just posted (a host sync on NCCL). Every rank posts
    once per call in the same order, so the i-th result is the same number on every rank.
    """

    def __init__(self, ep: ExpertParallel):
        self.ep = ep
        self.calls = 0
        self._slots: list = [None, None]  # (host value tensor, event or None) of the last two calls

    def post(self, tokens: int) -> None:
        device = self.ep.collective_device()
        value = torch.full((1,), int(tokens), dtype=torch.int64, device=device)  # a fill: no H2D copy
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.ep.group)
        event = None
        if device.type == "cuda":
            host = torch.empty(1, dtype=torch.int64, pin_memory=True)
            host.copy_(value, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            value = host
        self._slots[self.calls % 2] = (value, event)
        self.calls += 1

    def _read(self, slot) -> int:
        value, event = slot
        if event is not None:
            event.synchronize()  # NOTE: a host sync only where the event has not completed yet
        return int(value.item())

    def current(self) -> int:
        return self._read(self._slots[(self.calls - 1) % 2])

    def previous(self) -> int:
        return self._read(self._slots[(self.calls - 2) % 2])


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
