"""What ``auto`` runs for a call key: the typed plan group rank 0 makes for a new key, a key's
calibration state, and :class:`AutoDecider`, the one object that decides the strategy of a
call (which candidates a key has, the plan broadcast to every rank, the agreed timing that ends a
calibration). :mod:`interlace.strategies.auto` runs what it decides; the protocol is described there.

A key is ``(bucket, mode)``: the power-of-two bucket of the group's largest token count and the
kind of call: ``"fwdbwd"`` (a training call), ``"fwd"`` (inference), or :data:`ROUTED` (an
inference call handed over with the router at W > 1, where ``persistent``, which routes inside its
kernel, is a candidate).
"""

from __future__ import annotations

import logging
import math
import statistics
import warnings
import weakref
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.distributed as dist

from interlace.parallel.comm import WeakGroupAttribute
from interlace.planning.profile import machine_key
from interlace.planning.rounds import round_order
from interlace.strategies.auto_decisions import SHIPPED_DIR, Choice, Clock, DecisionCache, decision_shape
from interlace.strategies.auto_prior import (choose_strategy, fused_buffer_bytes, fused_train_rows_ratio,
                                            predicted_candidates, prune)
from interlace.strategies.base import runs_experts_of, strategy_class

log = logging.getLogger("interlace.auto")

ROUTED = "fwd-routed"  # key mode of W > 1 inference calls handed over with the router
PERSISTENT = "persistent"
FUSED_SPECS = ("fused", "fused:train", "fused:lean")  # share one peer buffer for a fixed token count per rank
LEAN = "fused:lean"  # what auto trains through the fused kernels: fused:train's speed, the rows received kept
# Calls a key may serve untimed while some candidate has no complete timing (training calls whose
# backward has not run yet: gradient accumulation, or the other layers of a shared calibration in
# the same forward pass); past them it decides on what it has.
MAX_WAITING_CALLS = 64


def persistent_buffer_bytes(config, world: int, max_tokens: int) -> int:
    """Bytes of the W > 1 persistent buffer on one rank (its regions: ``DistSpec.regions``)."""
    from interlace.kernels.persistent.dist_launch import DistSpec

    return DistSpec(world, config.num_experts // world, config.hidden, config.top_k, max_tokens, config.dtype).nbytes


@dataclass
class KeyPlan:
    """Group rank 0's plan for a new key, broadcast to every rank: a ``choice`` made without
    timing anything, or the ``candidates`` to calibrate (fastest predicted first) with the
    model's ``predicted`` ms where it has them; ``error``: planning raised on rank 0 (every rank
    raises it)."""

    choice: Choice | None = None
    candidates: tuple[str, ...] = ()
    predicted: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class Sample:
    """One calibration call's timing marks: its forward's start and end and, for a training call,
    its backward's start and end (None until the backward has run). ``warm``: untimed.
    ``captured``: the candidate captured a CUDA graph during the call (a one-time cost, e.g.
    ``fused:lean`` receiving more rows than its graph keeps): not counted, and timed again."""

    warm: bool
    train: bool
    marks: list = field(default_factory=list)
    captured: bool = False

    @property
    def complete(self) -> bool:
        return len(self.marks) == (4 if self.train else 2) and all(m is not None for m in self.marks)

    def ms(self, clock: Clock) -> float:
        ms = clock.elapsed_ms(self.marks[0], self.marks[1])
        return ms + clock.elapsed_ms(self.marks[2], self.marks[3]) if self.train else ms


class KeyState:
    """A key's plan and its calibration progress: the candidates in rounds, each round's order
    from :func:`interlace.planning.rounds.round_order`."""

    def __init__(self, plan: KeyPlan, warmup: int, samples: int):
        self.plan = plan
        self.choice: Choice | None = plan.choice
        n = len(plan.candidates)
        # (each round's order from planning.rounds: on GPU-bound calls the call before moves a timing)
        self.schedule = [i for r in range(warmup + samples) for i in round_order(list(range(n)), r)]
        self.warm_calls = n * warmup
        self.pos = 0
        self.samples: list[list[Sample]] = [[] for _ in range(n)]
        self.waiting_calls = 0  # calls served untimed past the schedule while timings were incomplete
        self.close_rounds = 0  # rounds served past it while the fastest candidates were within resolution
        self.recaptured = [0] * n  # agreed count of samples not counted because a graph was captured in them

    @property
    def served(self) -> bool:
        """Every scheduled call has been served: the next call decides."""
        return self.pos == len(self.schedule)

    @property
    def first(self) -> str:
        return self.plan.candidates[0]

    @property
    def upcoming(self) -> str:
        """The candidate the next scheduled call runs."""
        return self.plan.candidates[self.schedule[self.pos]]

    @property
    def warm_slot(self) -> bool:
        """Whether the next scheduled call is one of the untimed warm-up round's."""
        return self.pos < self.warm_calls

    def next_call(self, train: bool) -> tuple[str, Sample]:
        """The scheduled candidate of this call and the sample its marks go into."""
        c = self.schedule[self.pos]
        sample = Sample(self.pos < self.warm_calls, train)
        self.pos += 1
        self.samples[c].append(sample)
        return self.plan.candidates[c], sample


class AutoDecider:
    """Decides which strategy each key runs, identically on every rank of ``group`` (None: world
    size 1 or no process group).

    ``choices[(bucket, mode)]``: the decided keys (:class:`Choice`). ``keys``: every key's
    :class:`KeyState`. ``measure_override`` (tests): ``fn(spec, measured_ms) -> ms``.
    ``group`` is held weakly, as every interlace holder holds its group
    (:class:`~interlace.parallel.comm.WeakGroupAttribute`).
    """

    group = WeakGroupAttribute()

    def __init__(self, config, ep, options, group):
        self.config, self.ep, self.options, self.group = config, ep, options, group
        self.choices: dict[tuple[int, str], Choice] = {}
        self.keys: dict[tuple[int, str], KeyState] = {}
        self.cache: DecisionCache | None = None
        self.shape = decision_shape(config, ep.world)
        self.measure_override = None
        self._world1: dict[str, tuple] = {}  # device type → candidates of world-1 routed calls
        self._persistent_ok: dict[str, bool] = {}  # W > 1: device type → persistent a routed candidate
        self._warned = False

    # -- candidates -------------------------------------------------------------------------------
    def runs_experts(self, spec: str) -> bool:
        """Whether candidate ``spec`` runs this layer's experts as stored (FP8: ``fp8_experts``)."""
        return runs_experts_of(strategy_class(spec), self.config)

    def world1_candidates(self, device: torch.device) -> tuple:
        """World size 1: the candidates of routed calls (``persistent`` against ``sequential`` on a GPU)."""
        found = self._world1.get(device.type)
        if found is None:
            from interlace.strategies.persistent import unsupported

            if self.options.candidates is not None:
                found = tuple(self.options.candidates)
            elif device.type == "cuda" and unsupported(self.config, 1) is None:
                found = (PERSISTENT, "sequential")
            else:
                found = ("sequential",)
            found = self._world1[device.type] = tuple(s for s in found if runs_on(s, device) and self.runs_experts(s))
        return found

    def persistent_here(self, device: torch.device) -> bool:
        """W > 1: whether ``persistent`` is a candidate of routed calls on ``device`` (the config
        runs in its kernel, ``persistent_max_tokens`` > 0, its buffers fit ``memory_cap``, and a
        GPU on one host, or the ``candidates`` option naming it)."""
        found = self._persistent_ok.get(device.type)
        if found is None:
            from interlace.strategies.persistent import unsupported

            opts, cap = self.options, self.options.persistent_max_tokens
            found = (cap > 0 and unsupported(self.config, self.ep.world) is None
                     and (self.ep.one_host or device.type != "cuda")  # (peer memory: one host only)
                     and (PERSISTENT in opts.candidates if opts.candidates is not None else device.type == "cuda")
                     and (opts.memory_cap is None
                          or persistent_buffer_bytes(self.config, self.ep.world, cap) <= opts.memory_cap)
                     and runs_on(PERSISTENT, device) and self.runs_experts(PERSISTENT))
            self._persistent_ok[device.type] = found
        return found

    def routed_mode(self, bucket: int) -> str:
        """W > 1: the key mode of a routed call of ``bucket``: :data:`ROUTED` where ``persistent``
        may be a candidate, else ``"fwd"`` (the candidates of a call that comes routed)."""
        return ROUTED if 0 < bucket <= self.options.persistent_max_tokens else "fwd"

    def _device_cache(self, device: torch.device) -> DecisionCache | None:
        if self.options.cache and self.cache is None:
            opts = self.options
            self.cache = DecisionCache(machine_key(self.ep.world, device),
                                       Path(opts.decisions_dir) if opts.decisions_dir else None,
                                       SHIPPED_DIR if opts.shipped_decisions else None)
        return self.cache

    # -- a key's plan -----------------------------------------------------------------------------
    def plan(self, key, device) -> KeyPlan:
        """Group rank 0's plan for a new key (no collective: :meth:`state` broadcasts it)."""
        bucket, mode = key
        opts, cfg, world = self.options, self.config, self.ep.world
        if bucket == 0:
            return KeyPlan(Choice("sequential", "predicted", notes=["no tokens on any rank"]))
        cache = self._device_cache(device) if world == 1 or opts.calibrate else None
        cached = cache.lookup(self.shape, mode, bucket) if cache is not None else None
        if cached is not None and self._still_admitted(cached, mode, bucket, device):
            return KeyPlan(cached)
        if world == 1:  # a routed inference call (routes_call): its candidates, each timed with its routing
            return KeyPlan(candidates=self.world1_candidates(torch.device(device)),
                           notes=["world size 1: each candidate timed with its routing"])
        if not opts.calibrate:
            try:
                spec, notes = choose_strategy(cfg, bucket, world, opts.profile, opts.max_degree, mode,
                                              opts.train_fused and (opts.candidates is None or self.train_rows_ok()))
                spec = LEAN if spec == "fused:train" and opts.candidates is None else spec
            except FileNotFoundError as err:
                spec, notes = "sequential", [f"auto: {err}; running sequential (run `interlace profile` to plan)"]
            if not self.runs_experts(spec):
                spec, notes = "sequential", notes + [f"{spec}: does not run {cfg.expert_quant} experts"]
            return KeyPlan(Choice(spec, "predicted", notes=notes))
        prior_mode = "fwd" if mode == ROUTED else mode  # (a routed call is a forward call)
        if opts.candidates is not None:
            predicted, notes = {s: None for s in opts.candidates}, ["candidates given by the options"]
        else:
            predicted, notes = predicted_candidates(cfg, bucket, world, opts.profile, prior_mode, opts.max_degree)
        if mode == ROUTED and self.persistent_here(torch.device(device)):
            predicted.setdefault(PERSISTENT, None)  # (unpredicted: timed)
        else:
            predicted.pop(PERSISTENT, None)  # (it needs the router: only routed calls run it)
        for spec in [s for s in predicted if not self.runs_experts(s)]:
            predicted.pop(spec)
            notes.append(f"{spec}: does not run {cfg.expert_quant} experts")
        if not predicted:
            predicted = {"sequential": None}
        if prior_mode == "fwdbwd" and opts.candidates is None and "fused:train" in predicted:
            # The model's fused training path is fused:lean: fused:train's kernels and graphs (1-5%
            # slower on 2x H200) keeping the rows received, not W·cap of them.
            predicted = {LEAN if s == "fused:train" else s: ms for s, ms in predicted.items()}
        for spec in [s for s in predicted if s in FUSED_SPECS]:
            why = self._fused_excluded(spec, prior_mode, bucket, device)
            if why:
                predicted.pop(spec)
                notes.append(f"{spec}: {why}")
        kept, pruned = prune(predicted, opts.prune_ratio)
        known = {s: ms for s, ms in predicted.items() if ms is not None}
        if len(kept) == 1:
            return KeyPlan(Choice(kept[0], "predicted", kept, predicted_ms=known, notes=notes + pruned))
        return KeyPlan(candidates=tuple(kept), predicted=known, notes=notes + pruned)

    def _still_admitted(self, cached: Choice, mode: str, bucket: int, device) -> bool:
        """Whether a cached decision is one these options could make now: a cache written under
        other options (or by an older release) may name a strategy they exclude, e.g.
        ``fused:train`` at EP 8 over ``train_memory_ratio``, or, without ``candidates``, at all (the
        model's fused training path is ``fused:lean``); such a key is planned afresh."""
        spec = cached.spec
        if not self.runs_experts(spec):
            return False
        if spec == "fused:train" and self.options.candidates is None:  # (no longer a default candidate: LEAN)
            return False
        if self.ep.world > 1 and spec == PERSISTENT and bucket > self.options.persistent_max_tokens:
            return False
        if spec in FUSED_SPECS:
            return self._fused_excluded(spec, "fwd" if mode == ROUTED else mode, bucket, device) is None
        return True

    def train_rows_ok(self) -> bool:
        """Whether ``fused:train``'s saved rows stay within ``train_memory_ratio`` of sequential's."""
        ratio = self.options.train_memory_ratio
        return ratio is None or fused_train_rows_ratio(self.config, self.ep.world) <= ratio

    def _fused_excluded(self, spec: str, mode: str, bucket: int, device) -> str | None:
        opts = self.options
        if mode == "fwd" and spec != "fused" or mode == "fwdbwd" and spec == "fused":
            return "not this mode's fused path"
        if mode == "fwdbwd" and not opts.train_fused:
            return "not considered (train_fused=False)"
        if mode == "fwdbwd" and spec == "fused:train" and not self.train_rows_ok():
            return (f"keeps {fused_train_rows_ratio(self.config, self.ep.world):g}x the rows sequential keeps for "
                    f"the backward, over train_memory_ratio={opts.train_memory_ratio}")
        if not self.ep.one_host and torch.device(device).type == "cuda":
            return "its peer memory does not reach ranks on other hosts"
        try:
            strategy_class(spec).check_runtime(spec, torch.device(device))
        except ValueError as err:
            return f"cannot run here ({err})"
        if mode == "fwdbwd" and opts.memory_cap is not None:
            need = fused_buffer_bytes(self.config, self.ep.world, opts.capacity or bucket)
            if need > opts.memory_cap:
                return f"its buffers need ~{need} bytes, over memory_cap={opts.memory_cap}"
        return None

    def state(self, key, device, group=None) -> KeyState:
        """The key's state; a new key's plan is made by group rank 0 and broadcast over ``group``
        (the calling layer's side channel; default the decider's) (NOTE: blocking, once per new
        key per process, never in the steady state)."""
        group = group if group is not None else self.group
        state = self.keys.get(key)
        if state is None:
            plan = None
            if self.ep.rank == 0:
                try:
                    plan = self.plan(key, device)
                except Exception as err:  # every rank raises it, none waits in the broadcast
                    plan = KeyPlan(error=f"{type(err).__name__}: {err}")
            if group is not None:
                box = [plan]
                dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
                plan = box[0]
            if plan.error is not None:
                raise RuntimeError(f"auto: deciding {key} failed on group rank 0: {plan.error}")
            state = self.keys[key] = KeyState(plan, self.options.warmup, self.options.samples)
            if state.choice is not None:
                self.record(key, state.choice)
        return state

    # -- the end of a calibration -----------------------------------------------------------------
    def decide(self, key, state: KeyState, clock: Clock, group=None) -> bool:
        """Agree on each candidate's time (ONE all-reduce on the side channel) and keep the
        fastest; False where some candidate has no complete timing on some rank (gradient
        accumulation: forwards first, their backwards later; the caller serves the call untimed,
        :attr:`KeyState.served` still true), or, after adding a round to serve, where the fastest
        candidates' times lie within ``resolution`` (up to ``extra_samples`` rounds).
        ``group``: the calling layer's side channel (default the decider's)."""
        group = group if group is not None else self.group
        cands = state.plan.candidates
        n = len(cands)
        # Every timed sample's time and whether it captured a graph, each agreed sample by sample
        # (the max over ranks: the slowest rank's time; captured anywhere). A capture on one rank
        # delays the same call on the others, which wait for it in the call's exchanges: that
        # call is left out on every rank. Samples line up across ranks: every rank serves the
        # same schedule, whose length is agreed (its extensions are).
        slots = len(state.schedule)
        ms_of = [[math.inf] * slots for _ in range(n)]
        captured_in = [[0.0] * slots for _ in range(n)]
        untimed = [[1.0] * slots for _ in range(n)]  # warm, or incomplete (a backward still to run)
        total = 0.0
        for c, spec in enumerate(cands):
            for j, sample in enumerate(state.samples[c]):
                if not sample.complete:  # a training call whose backward has not run yet
                    continue
                ms = sample.ms(clock)
                if self.measure_override is not None:
                    ms = self.measure_override(spec, ms)
                if math.isfinite(ms):
                    total += ms
                if not sample.warm:
                    ms_of[c][j], captured_in[c][j], untimed[c][j] = ms, float(sample.captured), 0.0
        vec = torch.tensor([v for rows in (ms_of, captured_in, untimed) for row in rows for v in row] + [total],
                           dtype=torch.float64)
        if group is not None:  # on the side channel: host values, no GPU stream involved
            dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
        agreed = vec.tolist()
        total = agreed[-1]

        def row(table: int, c: int) -> list[float]:
            return agreed[(table * n + c) * slots:(table * n + c + 1) * slots]

        times, captured, waiting = [], [], 0
        for c in range(n):
            kept = [ms for ms, cap, skip in zip(row(0, c), row(1, c), row(2, c)) if not cap and not skip]
            times.append(statistics.median(kept) if kept else math.inf)
            captured.append(sum(row(1, c)))
            waiting += not kept
        again = [c for c in range(n) if captured[c] > state.recaptured[c]]
        if again and sum(state.recaptured) < self.options.samples * n:
            # A timed call that captured a graph on some rank: every rank times those candidates
            # again (the agreed counts decide it, so every rank adds the same calls).
            for c in again:
                state.schedule += [c] * (int(captured[c]) - state.recaptured[c])
                state.recaptured[c] = int(captured[c])
            return False
        if waiting and state.waiting_calls < MAX_WAITING_CALLS:
            state.waiting_calls += 1
            return False
        best = min(range(len(cands)), key=lambda i: (times[i], i))
        close = [i for i in range(len(cands)) if times[i] <= times[best] * (1 + self.options.resolution)]
        if len(close) > 1 and math.isfinite(times[best]) and state.close_rounds < self.options.extra_samples:
            # (the agreed times decide it: every rank adds the same round)
            state.close_rounds += 1
            state.schedule += round_order(close, state.close_rounds)
            return False
        calls = len(state.schedule)
        overhead = total - calls * times[best] if math.isfinite(times[best]) else 0.0
        choice = Choice(cands[best], "measured", list(cands), dict(zip(cands, times)), state.plan.predicted, calls,
                        total, max(overhead, 0.0), state.plan.notes)
        state.choice = choice
        self.record(key, choice)
        if self.ep.rank == 0 and self.cache is not None and all(math.isfinite(t) for t in times):
            self.cache.store(self.shape, key[1], key[0], choice)
        return True

    def record(self, key, choice: Choice) -> None:
        self.choices[key] = choice
        bucket, mode = key
        log.info("auto: %s %s tokens≤%d (world %d): %s", self.shape, mode, bucket, self.ep.world, choice.summary())
        if choice.source == "predicted" and any(n.startswith("auto: ") for n in choice.notes) and not self._warned:
            self._warned = True
            warnings.warn(next(n for n in choice.notes if n.startswith("auto: ")), stacklevel=5)

    def needed_specs(self) -> set[str]:
        """The strategies some decided key runs or some key still calibrates."""
        needed = {choice.spec for choice in self.choices.values()}  # (world size 1 records some without a state)
        for state in self.keys.values():
            needed.update([state.choice.spec] if state.choice is not None else state.plan.candidates)
        return needed


# Deciders shared by the auto layers of this process (see shared_decider); they live as long as a layer holds them.
_SHARED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def shared_decider(config, ep, options, group) -> AutoDecider:
    """The :class:`AutoDecider` of every ``auto`` layer of this process with this config, this
    expert-parallel group (``ep``: the same group object) and equal options: their calls serve
    one calibration per key, in turn (a model of L such layers decides in about 1/L of the calls
    each layer would take alone, and its layers run one strategy). Each layer keeps its own
    strategies and buffers. ``options.share_calibration=False``: a decider of its own.
    Every rank builds its layers alike, so every rank shares alike."""
    if not options.share_calibration:
        return AutoDecider(config, ep, options, group)
    opts = tuple((f.name, _hashable(getattr(options, f.name))) for f in fields(options))
    key = (config.with_(source=""), ep, opts)  # (``source`` names the layer: HF blocks differ only there)
    found = _SHARED.get(key)
    if found is None:
        found = _SHARED[key] = AutoDecider(config, ep, options, group)
    return found


def _hashable(value):
    try:
        hash(value)
        return value
    except TypeError:  # (a Profile object: shared only by the layers given that same object)
        return ("id", id(value))


def runs_on(spec: str, device: torch.device) -> bool:
    try:
        strategy_class(spec).check_runtime(spec, device)
        return True
    except ValueError:
        return False
