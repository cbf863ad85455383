"""What ``auto`` decided, and where it keeps it: :class:`Choice` records, the on-disk
:class:`DecisionCache`, token buckets, the token-count agreement over a CPU side channel and the
timing marks of calibration calls. The protocol that uses them is described in :mod:`interlace.strategies.auto`.
"""

from __future__ import annotations

import json
import math
import os
import time
from datetime import timedelta
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from interlace.config import MoEConfig
from interlace.parallel.comm import ExpertParallel
from interlace.parallel.host_board import HostBoard
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


_SIDE_CHANNELS: dict[tuple, dist.ProcessGroup] = {}


def group_backend(group) -> str:
    """``group``'s backend name (a seam for tests, which fake a non-gloo group on the CPU)."""
    return dist.get_backend(group)


def side_channel(ep: ExpertParallel, timeout_s: float) -> dist.ProcessGroup:
    """The CPU (gloo) process group ``auto`` agrees on for ``ep``'s group: the group itself when
    it is gloo, else one gloo group per rank tuple, created once and shared by every layer over
    those ranks. Creating it is a collective of the group's ranks (of every rank when the group
    is the whole world): call it on each of them alike, as when building the layer."""
    if group_backend(ep.group) == "gloo":
        return ep.group
    ranks = tuple(dist.get_process_group_ranks(ep.group))
    key = (id(dist.group.WORLD), ranks)  # a re-initialized default group gets fresh side channels
    group = _SIDE_CHANNELS.get(key)
    if group is None:
        whole = len(ranks) == dist.get_world_size()
        group = _SIDE_CHANNELS[key] = dist.new_group(list(ranks), backend="gloo", timeout=timedelta(seconds=timeout_s),
                                                     use_local_synchronization=not whole)
    return group


class GroupMax:
    """The gloo side channel's answer to the same question as the board's (the group's maximum of
    one integer per call, calls numbered alike on every rank), for ranks on several hosts: one
    asynchronous ``all_reduce(MAX)`` per call, finished at the latest when the next call posts.
    Same interface as :class:`~interlace.parallel.host_board.HostBoard`."""

    def __init__(self, group, timeout_s: float):
        self.group, self.timeout = group, timedelta(seconds=timeout_s)
        self.seq = 0
        self._pending: tuple | None = None  # (call, value tensor, work) of the last call posted
        self.last: tuple[int, int] | None = None  # (call, maximum) of the last call finished

    def post(self, value: int) -> int:
        if self._pending is not None:
            self._finish()
        self.seq += 1
        tensor = torch.tensor([int(value)], dtype=torch.int64)
        self._pending = (self.seq, tensor, dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group,
                                                           async_op=True))
        return self.seq

    def _finish(self, timeout_s: float | None = None) -> None:
        seq, tensor, work = self._pending
        self._pending = None
        work.wait(self.timeout if timeout_s is None else timedelta(seconds=timeout_s))
        self.last = (seq, int(tensor.item()))  # a CPU tensor: no device sync

    def previous(self, seq: int) -> int | None:
        return self.last[1] if self.last is not None and self.last[0] + 1 == seq else None

    def wait(self, seq: int, timeout_s: float | None = None) -> int:
        if self._pending is not None and self._pending[0] == seq:
            self._finish(timeout_s)
        if self.last is None or self.last[0] != seq:
            raise RuntimeError(f"GroupMax: call {seq} is neither the last posted nor the last finished")
        return self.last[1]


_COUNTERS: dict[tuple, object] = {}


def group_counter(ep: ExpertParallel, group, timeout_s: float):
    """The per-call maximum of ``ep``'s ranks, one object per rank tuple shared by every layer
    over them (so a call's "previous call" is the previous layer's call, of the same forward
    pass in a model): the shared-memory board where all ranks are on one host, else
    :class:`GroupMax` over the gloo side channel. Built with the side channel, on every rank
    alike."""
    key = (id(dist.group.WORLD), tuple(dist.get_process_group_ranks(ep.group)))
    if key not in _COUNTERS:
        _COUNTERS[key] = HostBoard.create(group, timeout_s) or GroupMax(group, timeout_s)
    return _COUNTERS[key]


class TokenAgreement:
    """The group's largest token count per call, agreed on the host, for one layer.

    The counter behind it (:func:`group_counter`) is shared by every layer over the same ranks:
    the shared-memory board (:class:`~interlace.parallel.host_board.HostBoard`: a post is one
    store) where every rank runs on one host, else an asynchronous ``all_reduce(MAX)`` on the
    gloo group of :func:`side_channel`. Neither touches a GPU stream. Each call posts its count
    (:meth:`post`, before the router runs: ``Strategy.begin_call``) and gets at once the
    group's maximum of the *previous* call on the counter (:attr:`previous`, read when posting;
    it waits only where a peer has not even started that call). The current call's maximum
    (:meth:`wait`) waits for the last rank's post; :meth:`skip` finishes a call that does not
    need it. Waits are bounded by ``timeout_s`` (a peer that never posts raises instead of
    hanging).
    """

    def __init__(self, ep: ExpertParallel, timeout_s: float = 300.0):
        self.ep = ep
        self.timeout = timedelta(seconds=timeout_s)
        self.group = side_channel(ep, timeout_s)
        self.counter = group_counter(ep, self.group, timeout_s)
        self.calls = 0
        self.waits = 0  # calls that waited for their own call's maximum (tests, diagnostics)
        self.previous: int | None = None  # the group's maximum of the call before the posted one
        self._pending: tuple[int, int] | None = None  # (call on the counter, this rank's count)

    @property
    def board(self) -> HostBoard | None:
        return self.counter if isinstance(self.counter, HostBoard) else None

    @property
    def posted(self) -> bool:
        return self._pending is not None

    @property
    def posted_tokens(self) -> int | None:
        return None if self._pending is None else self._pending[1]

    def post(self, tokens: int) -> None:
        # A post whose call never came (an exception between, on every rank alike) is simply
        # replaced: the counter's sequence is the same on every rank either way.
        seq = self._guard(lambda: self.counter.post(int(tokens)))
        self.previous = self.counter.previous(seq)
        self._pending = (seq, int(tokens))

    def wait(self) -> int:
        """The group's largest count of the posted call (a host wait for the last rank's post)."""
        seq, _ = self._pending
        self._pending = None
        self.calls += 1
        self.waits += 1
        return self._guard(lambda: self.counter.wait(seq, self.timeout.total_seconds()))

    def skip(self) -> None:
        """Finish the posted call without its maximum (it is read when the next call posts)."""
        self._pending = None
        self.calls += 1

    def _guard(self, fn):
        try:
            return fn()
        except (RuntimeError, TimeoutError) as err:
            raise RuntimeError(f"auto: the token-count agreement failed or timed out after {self.timeout} on rank "
                               f"{self.ep.rank} of {self.ep.world} (a peer did not reach this layer call?): {err}"
                               ) from err


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
