"""``auto``: every rank runs the same strategy on every call, the one measured fastest here.

**Agreement (why ranks never diverge).** Each call, every rank posts its host-known token count
and the kind of its call (training or inference; routed by the layer or handed over with the
router) on a counter shared by every layer over the same ranks
(:class:`~interlace.parallel.agreement.CallAgreement`): a page of shared memory where the ranks
share a host, else an asynchronous ``all_gather`` on a gloo side channel. Neither touches a GPU
stream. ``MoELayer.forward`` posts before the router runs (:meth:`Strategy.begin_call`); a call
that nobody posted for posts itself. The strategy reads every rank's post (a host wait for the
last rank's post, microseconds on the board, after the router's launch) and keys the call on
values every rank holds identically, and on nothing rank-local:

* the *key* ``(bucket, mode)``: ``bucket`` is the power-of-two bucket of the group's largest
  token count (zero tokens on some or all ranks included). ``mode`` is ``"fwdbwd"`` for a
  training call (it builds an autograd graph), else ``"fwd"`` (``"fwd-routed"`` for routed calls
  where ``persistent`` is a candidate: :mod:`interlace.strategies.auto_routed`).
* ranks whose kinds of call differ raise, every one of them, naming the ranks of each kind (a
  training call on one rank and an inference call on another; a call with ``expert_indices`` on
  one rank and without on another where the latter would go routed). A rank without tokens has
  nothing to route: it follows the group's routing.
* what to do for a key is decided once per process, by group rank 0, and broadcast over the
  side channel (a blocking step once per new key, never in the steady state): the cached
  decision or the candidates to calibrate. Ranks reading different cache files or profiles
  therefore still agree.
* calibration serves the calls of a key from a fixed schedule (candidates round-robin); the
  position in it advances by one per call of that key, identically on every rank. After the
  schedule, the next call of the key makes ONE ``all_reduce(MAX)`` (side channel) of every
  candidate's local median time, and every rank takes the argmin of the same vector (ties:
  candidate order).

Since the key sequence, the plan per key, the schedule position and the agreed times are equal
on every rank, so is the strategy of every call, whatever each rank's own token count. Sub-strategies
are built with fixed parameters (``pipelined:r`` with its degree, no per-rank ``"auto"``). Every
wait is bounded (``agree_timeout_s``: a peer that never reaches the call raises, naming the
rank, the layer and the call).

**Fused buffers.** ``fused`` / ``fused:train`` hold buffers for a fixed number of tokens per
rank, sized from the agreed count of their first call (rounded up to a power of two); a call
whose agreed count is over them grows them first on every rank (a device sync and a barrier,
at most once per doubling). With the ``capacity`` option they are sized to it once and never
grow (memory planning: the user promises no rank passes more tokens; a call that breaks it
raises on every rank alike, before any launch).

**Calibration.** For a key with no decision, the candidates come from the performance model
(:func:`interlace.planning.pipemoe.degree.choose_degree`, :func:`...fused_speedup`): ``sequential``,
``pipelined:r`` at the planner's degree r > 1, and ``fused`` (forward calls) or ``fused:train``
(training calls, unless ``train_fused=False`` or its buffers exceed ``memory_cap``); the model
orders them and drops those predicted ``prune_ratio`` times slower than the best prediction.
Each candidate serves real calls (its output is the call's output; nothing runs twice, so
results are exactly that candidate's): ``warmup`` untimed rounds, then ``samples`` timed rounds.
A training call is timed forward + backward (marks on the output's and the inputs' gradients);
a key decides only on complete timings: where some candidate's backward has not run yet on some
rank (gradient accumulation: several forwards, then the backwards), the key serves another round
of candidates instead (at most ``MAX_EXTRA_ROUNDS``).
An activation checkpoint's recomputed forward (a training call inside a backward) runs the
strategy its forward ran (the latest training call not yet recomputed), untimed and uncounted.
The winner is stored in the decision cache (:class:`~interlace.strategies.auto_decisions.DecisionCache`,
under the profile dir's ``decisions/``, one file per device key, above the decisions shipped
for the presets) and reused by later processes; a bucket between two measured ones takes their
decision when both agree, else it is calibrated too. ``calibrate=False`` decides from the
profile alone (:func:`choose_strategy`).

**CUDA graph capture.** Inside a user's ``torch.cuda.graph`` around the layer, the agreement runs
on the host at capture time only (the replays repeat the captured strategy at the captured token
count, which a graph fixes anyway); a key still undecided is not calibrated while capturing (its
timing events cannot be read inside a capture, and the graph would freeze one candidate): the
model's first candidate runs, nothing is recorded, and the key is calibrated by later eager
calls. Fused buffers cannot grow inside a capture: warm the layer up eagerly with the largest
count first, or set ``capacity``. (The fused strategy's own graphs, :mod:`interlace.strategies.graphs`,
are its business: ``auto`` only calls it.)

**Explain.** ``layer.strategy.choices[(bucket, mode)]`` is a
:class:`~interlace.strategies.auto_decisions.Choice` (what, measured or predicted, candidates'
times, the calibration's cost); each decision is logged once at INFO on ``"interlace.auto"``.
**Routed calls** (:mod:`interlace.strategies.auto_routed`). Inference calls come with the
router where ``persistent`` (the whole layer in one launch, router included) is a candidate:
at world size 1 against ``sequential``; at W > 1 beside the model's candidates, for buckets up
to ``persistent_max_tokens`` tokens per rank, under key mode ``"fwd-routed"``. Each candidate
is timed with its routing. At world size 1 there is nothing to overlap or agree on: training
calls, and everything else, run ``sequential``.

**FP8 experts** (``MoEConfig.expert_quant="fp8"``). Only candidates whose strategy runs them
(``Strategy.fp8_experts``) are considered: the model's, the ``candidates`` option's, routed calls'
``persistent``, a cached or profile-only decision (another is replaced by ``sequential``, which
runs every form of experts). Their decisions are cached under their own shape key (``-fp8``).
"""

from __future__ import annotations

import logging
import math
import statistics
import warnings
from collections import deque
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist

from interlace.parallel.agreement import MAX_TOKENS, CallAgreement
from interlace.planning.profile import machine_key
from interlace.strategies.auto_prior import choose_strategy, fused_buffer_bytes, predicted_candidates, prune
from interlace.strategies.auto_decisions import (SHIPPED_DIR, BackwardMark, Choice, Clock, DecisionCache,
                                                 decision_shape, token_bucket)
from interlace.strategies.auto_routed import FUSED_SPECS, PERSISTENT, ROUTED, RoutedCalls
from interlace.strategies.base import (Strategy, check_names, make_strategy, register_strategy, runs_experts_of,
                                       strategy_class)

log = logging.getLogger("interlace.auto")

# Calibration rounds a key may add while some candidate has no complete timing (training calls
# whose backward has not run: gradient accumulation); past them it decides on what it has.
MAX_EXTRA_ROUNDS = 16
# Training calls whose strategy a recompute may still ask for (activation checkpointing).
MAX_SERVED = 64


@dataclass(frozen=True)
class AutoOptions:
    """Options of ``auto`` (``strategy_options`` of :class:`interlace.MoELayer`)."""

    profile: object = None  # a Profile, a JSON path, or None (this machine's stored profile)
    max_degree: int = 16
    train_fused: bool = True  # False: training calls never run fused:train
    calibrate: bool = True  # False: decide from the profile alone (choose_strategy), time nothing
    candidates: tuple | None = None  # specs to calibrate instead of the model's (each with fixed parameters)
    capacity: int | None = None  # tokens per rank the fused buffers hold, fixed (a promise; see the module doc)
    memory_cap: int | None = None  # bytes: fused:train is not a candidate where its buffers need more
    prune_ratio: float = 1.5  # candidates predicted slower than this × the best are not timed
    warmup: int = 1  # untimed rounds (each candidate once per round) before the timed ones
    samples: int = 3  # timed rounds; the median of each candidate's samples is what ranks agree on
    cache: bool = True  # read and write the decision cache under the profile dir
    decisions_dir: str | None = None  # the decision cache's folder instead of <profile dir>/decisions
    shipped_decisions: bool = True  # read the decisions shipped for the presets beneath the cache
    agree_timeout_s: float = 300.0  # bound on every wait of the agreement (a peer that never comes raises)
    # W > 1: inference calls of buckets up to this many tokens per rank also calibrate `persistent`
    # (its buffers hold this many per rank: auto_routed.persistent_buffer_bytes); 0: never
    persistent_max_tokens: int = 512

    def __post_init__(self):
        if self.capacity is not None and (not isinstance(self.capacity, int) or self.capacity < 1):
            raise ValueError(f"auto: capacity must be a positive int or None, got {self.capacity!r}")
        if self.warmup < 0 or self.samples < 1:
            raise ValueError(f"auto: warmup must be ≥ 0 and samples ≥ 1, got {self.warmup}, {self.samples}")
        cap = self.persistent_max_tokens
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise ValueError(f"auto: persistent_max_tokens must be an int >= 0, got {cap!r}")
        if not self.agree_timeout_s > 0:
            raise ValueError(f"auto: agree_timeout_s must be > 0, got {self.agree_timeout_s}")
        if self.prune_ratio < 1:
            raise ValueError(f"auto: prune_ratio must be ≥ 1, got {self.prune_ratio}")
        for spec in self.candidates or ():
            cls = strategy_class(spec)
            if cls.name == "auto" or (cls.name == "pipelined" and not spec.partition(":")[2].isdigit()):
                raise ValueError(f"auto: candidate {spec!r} must have fixed parameters (e.g. 'pipelined:4'): "
                                 f"a per-rank choice could differ between ranks")


class _KeyState:
    """A key's plan (what group rank 0 decided and broadcast) and its calibration progress."""

    def __init__(self, plan: dict, rounds: int):
        self.choice: Choice | None = plan.get("choice")
        self.plan = plan
        cands = plan.get("candidates", [])
        self.schedule = [i for _ in range(rounds) for i in range(len(cands))]
        self.pos = 0
        self.samples: list[list] = [[] for _ in cands]  # per candidate: [warm?, marks]
        self.extra_rounds = 0  # rounds served past the schedule while timings were incomplete


@register_strategy
class AutoStrategy(RoutedCalls, Strategy):
    name = "auto"
    options_class = AutoOptions
    fused_routing = True
    routes_itself = True  # inference calls may come with the router (auto_routed.RoutedCalls.routes_call)
    fp8_experts = True  # it picks among the candidates that run them (runs_experts_of)

    def __init__(self, config, ep, options: AutoOptions | dict | None = None, **given):
        super().__init__(config, ep)
        if isinstance(options, dict):
            given, options = {**options, **given}, None
        valid = [f.name for f in fields(AutoOptions)]
        check_names(given, valid, "auto options")
        base = options or AutoOptions()
        self.options = opts = AutoOptions(**{**{f: getattr(base, f) for f in valid}, **given})
        if opts.candidates is not None and not any(self.runs_experts(c) for c in opts.candidates):
            raise ValueError(f"auto: none of the candidates {list(opts.candidates)} runs FP8 experts "
                             f"(MoEConfig.expert_quant={config.expert_quant!r})")
        self._profile = opts.profile
        self.choices: dict[tuple[int, str], Choice] = {}
        self._keys: dict[tuple[int, str], _KeyState] = {}
        self._impls: dict[str, Strategy] = {}
        # W > 1: decided keys → (their strategy, the most tokens per rank it serves as it is: a fused
        # strategy's buffers hold a fixed count, and a larger call takes the path that grows them; spec)
        self._ready: dict[tuple[int, str], tuple[Strategy, int, str]] = {}
        self._fused_tokens = opts.capacity or 0  # agreed tokens per rank the fused buffers hold
        # The side channel is made here, where every rank builds the layer alike (a collective).
        distributed = ep.world > 1 and ep.group is not None and dist.is_initialized()
        self._agree = CallAgreement(ep, opts.agree_timeout_s) if distributed else None
        self._label = Strategy.label
        self._cache: DecisionCache | None = None
        self._shape = decision_shape(config, ep.world)
        self._warned = False
        self._routed_candidates: dict[str, tuple] = {}  # world size 1: device type → candidates of routed calls
        self._persistent_ok: dict[str, bool] = {}  # W > 1: device type → persistent a routed candidate
        self.measure_override = None  # tests: fn(spec, measured_ms) -> ms, injects timings
        # Training calls' strategies, latest last: an activation checkpoint's recompute (a forward
        # run inside the backward) takes the one its forward ran, and is neither timed nor counted.
        self._served: deque[Strategy] = deque(maxlen=MAX_SERVED)

    @property
    def label(self) -> str:
        return self._label

    @label.setter
    def label(self, value: str) -> None:  # (the agreement's errors name the layer too)
        self._label = value
        if self._agree is not None:
            self._agree.label = value

    # -- what a key runs ------------------------------------------------------------------------
    def runs_experts(self, spec: str) -> bool:
        """Whether candidate ``spec`` runs this layer's experts as stored (FP8: ``fp8_experts``)."""
        return runs_experts_of(strategy_class(spec), self.config)

    def _device_cache(self, device: torch.device) -> DecisionCache | None:
        if self.options.cache and self._cache is None:
            opts = self.options
            self._cache = DecisionCache(machine_key(self.ep.world, device),
                                        Path(opts.decisions_dir) if opts.decisions_dir else None,
                                        SHIPPED_DIR if opts.shipped_decisions else None)
        return self._cache

    def _plan(self, key, device) -> dict:
        """Group rank 0's plan for a new key: ``{"choice": Choice}`` or ``{"candidates": [...],
        "predicted": {...}, "notes": [...]}``."""
        bucket, mode = key
        opts, cfg, world = self.options, self.config, self.ep.world
        if bucket == 0:
            return {"choice": Choice("sequential", "predicted", notes=["no tokens on any rank"])}
        if world == 1:  # a routed inference call (routes_call): its candidates, each timed with its routing
            cache = self._device_cache(device)
            cached = cache.lookup(self._shape, mode, bucket) if cache is not None else None
            if cached is not None and self.runs_experts(cached.spec):
                return {"choice": cached}
            return {"candidates": list(self._world1_candidates(torch.device(device))),
                    "notes": ["world size 1: each candidate timed with its routing"]}
        if not opts.calibrate:
            try:
                spec, notes = choose_strategy(cfg, bucket, world, self._profile, opts.max_degree, mode,
                                              opts.train_fused)
            except FileNotFoundError as err:
                spec, notes = "sequential", [f"auto: {err}; running sequential (run `interlace profile` to plan)"]
            if not self.runs_experts(spec):
                spec, notes = "sequential", notes + [f"{spec}: does not run {cfg.expert_quant} experts"]
            return {"choice": Choice(spec, "predicted", notes=notes)}
        cache = self._device_cache(device)
        cached = cache.lookup(self._shape, mode, bucket) if cache is not None else None
        if (cached is not None and not (cached.spec == PERSISTENT and bucket > opts.persistent_max_tokens)
                and self.runs_experts(cached.spec)):
            return {"choice": cached}
        prior_mode = "fwd" if mode == ROUTED else mode  # (a routed call is a forward call)
        if opts.candidates is not None:
            predicted, notes = {s: None for s in opts.candidates}, ["candidates given by the options"]
        else:
            predicted, notes = predicted_candidates(cfg, bucket, world, self._profile, prior_mode, opts.max_degree)
        if mode == ROUTED:
            predicted = self.routed_candidates(predicted, bucket, device)
        else:
            predicted.pop(PERSISTENT, None)  # (it needs the router: only routed calls run it)
        for spec in [s for s in predicted if not self.runs_experts(s)]:
            predicted.pop(spec)
            notes.append(f"{spec}: does not run {cfg.expert_quant} experts")
        if not predicted:
            predicted = {"sequential": None}
        for spec in [s for s in predicted if s in FUSED_SPECS]:
            why = self._fused_excluded(spec, prior_mode, bucket, device)
            if why:
                predicted.pop(spec)
                notes.append(f"{spec}: {why}")
        kept, pruned = prune(predicted, opts.prune_ratio)
        notes += pruned
        if len(kept) == 1:
            return {"choice": Choice(kept[0], "predicted", kept, predicted_ms=_known(predicted), notes=notes)}
        return {"candidates": kept, "predicted": _known(predicted), "notes": notes}

    def _fused_excluded(self, spec: str, mode: str, bucket: int, device) -> str | None:
        opts = self.options
        if mode == "fwd" and spec == "fused:train" or mode == "fwdbwd" and spec == "fused":
            return "not this mode's fused path"
        if mode == "fwdbwd" and not opts.train_fused:
            return "not considered (train_fused=False)"
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

    def _key_state(self, key, device) -> _KeyState:
        state = self._keys.get(key)
        if state is None:
            plan = None
            if self.ep.rank == 0:
                try:
                    plan = self._plan(key, device)
                except Exception as err:  # every rank raises it, none waits in the broadcast
                    plan = {"error": f"{type(err).__name__}: {err}"}
            if self.ep.world > 1:
                box = [plan]
                # NOTE: blocking, once per new key per process (never in the steady state).
                group = self._agree.group
                dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
                plan = box[0]
            if "error" in plan:
                raise RuntimeError(f"auto: deciding {key} failed on group rank 0: {plan['error']}")
            state = self._keys[key] = _KeyState(plan, self.options.warmup + self.options.samples)
            if state.choice is not None:
                self._record(key, state.choice)
        return state

    def _record(self, key, choice: Choice) -> None:
        self.choices[key] = choice
        bucket, mode = key
        log.info("auto: %s %s tokens≤%d (world %d): %s", self._shape, mode, bucket, self.ep.world,
                 choice.summary())
        if choice.source == "predicted" and any(n.startswith("auto: ") for n in choice.notes) and not self._warned:
            self._warned = True
            warnings.warn(next(n for n in choice.notes if n.startswith("auto: ")), stacklevel=4)

    # -- calibration ----------------------------------------------------------------------------
    def _decide(self, key, state: _KeyState, clock: Clock) -> None:
        """End of a key's calibration: agree on each candidate's time (ONE all-reduce), keep the
        fastest, store it."""
        cands = state.plan["candidates"]
        local, total, waiting = [], 0.0, 0
        for c, spec in enumerate(cands):
            times = []
            for warm, marks in state.samples[c]:
                if any(m is None for m in marks):  # a training call whose backward has not run yet
                    continue
                ms = clock.elapsed_ms(marks[0], marks[1])
                if len(marks) == 4:
                    ms += clock.elapsed_ms(marks[2], marks[3])
                if self.measure_override is not None:
                    ms = self.measure_override(spec, ms)
                if math.isfinite(ms):
                    total += ms
                if not warm:
                    times.append(ms)
            local.append(statistics.median(times) if times else math.inf)
            waiting += not times
        vec = torch.tensor(local + [total, waiting], dtype=torch.float64)
        if self.ep.world > 1:  # on the side channel: host values, no GPU stream involved
            dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=self._agree.group)
        agreed = vec.tolist()
        times, total, waiting = agreed[:-2], agreed[-2], agreed[-1]
        if waiting and state.extra_rounds < MAX_EXTRA_ROUNDS:
            # Some candidate has no complete timing on some rank (gradient accumulation: forwards
            # first, their backwards later): serve another round instead of deciding on it.
            state.extra_rounds += 1
            state.schedule += list(range(len(cands)))
            return
        best = min(range(len(cands)), key=lambda i: (times[i], i))
        calls = len(state.schedule)
        overhead = total - calls * times[best] if math.isfinite(times[best]) else 0.0
        choice = Choice(cands[best], "measured", list(cands), {s: t for s, t in zip(cands, times)},
                        state.plan.get("predicted", {}), calls, total, max(overhead, 0.0), state.plan.get("notes", []))
        state.choice = choice
        self._record(key, choice)
        if self.ep.rank == 0 and self._cache is not None and all(math.isfinite(t) for t in times):
            self._cache.store(self._shape, key[1], key[0], choice)

    # -- strategies -----------------------------------------------------------------------------
    def _impl(self, spec: str, agreed: int) -> Strategy:
        """The sub-strategy ``spec``; a fused one with buffers for ``agreed`` tokens per rank
        (the group's largest count of this call, the same number on every rank)."""
        impl = self._impls.get(spec)
        if spec in FUSED_SPECS:
            cap = self.options.capacity
            if cap is not None and agreed > cap:
                raise ValueError(f"auto: a rank passed {agreed} tokens, over capacity={cap} (the fused buffers' "
                                 f"fixed size); raise capacity or leave it None to grow the buffers")
            need = cap or max(1, agreed)
            if need > self._fused_tokens:
                self._fused_tokens = cap or token_bucket(need)  # every rank grows here: same agreed value
            if impl is None or impl.max_tokens < need:
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError(f"auto: {spec}'s buffers must grow to {self._fused_tokens} tokens per rank "
                                       f"inside a CUDA graph capture; run the layer eagerly with the largest "
                                       f"count first, or set the capacity option")
                if impl is not None and impl.buf is not None:
                    # NOTE: a device sync and a barrier, only where the buffers grow: the old ones
                    # are freed below, and no peer may still write into them.
                    impl.synchronize_and_check()
                    if self.ep.world > 1:
                        dist.barrier(group=self._agree.group)
                if impl is not None:  # (decided keys that ran the old buffers take the slow path once more)
                    self._ready = {k: v for k, v in self._ready.items() if v[2] != spec}
                impl = self._impls[spec] = make_strategy(spec, self.config, self.ep, max_tokens=self._fused_tokens)
        elif impl is None and spec == PERSISTENT and self.ep.world > 1:
            # (buffers for persistent_max_tokens per rank, sized once: the largest routed bucket)
            impl = self._impls[spec] = make_strategy(spec, self.config, self.ep, agree=False,
                                                     max_tokens=self.options.persistent_max_tokens)
        elif impl is None:
            impl = self._impls[spec] = make_strategy(spec, self.config, self.ep)
        return impl

    def _mark_ready(self, key, spec: str, impl: Strategy) -> None:
        """W > 1: calls of the decided ``key`` go straight to ``impl`` from now on, up to the count
        its buffers hold (a fused strategy's ``max_tokens``)."""
        if self._agree is not None:
            self._ready[key] = (impl, self._impls[spec].max_tokens if spec in FUSED_SPECS else MAX_TOKENS, spec)

    def close(self) -> None:
        for impl in self._impls.values():
            impl.close()
        self._impls.clear()
        self._ready.clear()
        self._served.clear()

    def choice_for(self, tokens: int, mode: str = "fwd") -> Choice | None:
        """The decision recorded for the bucket of ``tokens`` (the group's largest count) and
        ``mode`` (``"fwd"``: the routed calls' decision where there is one), or None while it is
        not decided."""
        bucket = token_bucket(tokens)
        return (mode == "fwd" and self.choices.get((bucket, ROUTED))) or self.choices.get((bucket, mode))

    def __call__(self, x, topk_idx, topk_weight, w_up, w_down):
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weight, w_up, w_down))
        args = (x, topk_idx, topk_weight, w_up, w_down)
        if self._agree is None:
            key = (token_bucket(x.shape[0]), "fwdbwd" if needs_grad else "fwd")
            if key not in self.choices:
                self._record(key, Choice("sequential", "predicted", notes=["world size 1: nothing to overlap"]))
            return self._impl("sequential", x.shape[0])(*args)
        agreed = self._agree.settle(x.shape[0], needs_grad, False)
        key = (token_bucket(agreed.tokens), "fwdbwd" if agreed.train else "fwd")
        if agreed.train and torch._C._current_graph_task_id() != -1 and self._served:
            # A recompute (torch.utils.checkpoint): backwards run latest forward first, so the
            # latest unrecomputed training call is this one; every rank pops alike.
            return self._served.pop()(*args)
        ready = self._ready.get(key)
        if ready is not None and agreed.tokens <= ready[1]:  # (a decided key: straight to its strategy)
            if agreed.train:
                self._served.append(ready[0])
            return ready[0](*args)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        state = self._key_state(key, x.device)
        if state.choice is None and state.pos == len(state.schedule) and not capturing:
            self._decide(key, state, Clock(x.device))
        if state.choice is not None:
            impl = self._impl(state.choice.spec, agreed.tokens)
            self._mark_ready(key, state.choice.spec, impl)
            if agreed.train:
                self._served.append(impl)
            return impl(*args)
        if capturing:  # nothing timed or recorded inside a capture (see the module doc)
            return self._impl(state.plan["candidates"][0], agreed.tokens)(*args)
        return self._calibration_call(state, agreed.tokens, agreed.train, args)

    def _calibration_call(self, state: _KeyState, agreed: int, needs_grad: bool, args):
        """The scheduled candidate serves this call, timed (forward, and backward through marks
        on the output's and the inputs' gradients)."""
        x, topk_idx, topk_weight, w_up, w_down = args
        clock = Clock(x.device)
        c = state.schedule[state.pos]
        warm = state.pos < len(state.plan["candidates"]) * self.options.warmup
        state.pos += 1
        marks = [clock.mark()]
        impl = self._impl(state.plan["candidates"][c], agreed)
        if needs_grad:
            self._served.append(impl)
            marks += [None, None, None]

            def at(i):
                def mark():
                    marks[i] = clock.mark()
                return mark

            x, topk_weight, w_up, w_down = BackwardMark.apply(at(3), x, topk_weight, w_up, w_down)
            out = impl(x, topk_idx, topk_weight, w_up, w_down)
            marks[1] = clock.mark()
            (out,) = BackwardMark.apply(at(2), out)
        else:
            out = impl(x, topk_idx, topk_weight, w_up, w_down)
            marks.append(clock.mark())
        state.samples[c].append((warm, marks))
        return out

    def __repr__(self) -> str:
        return f"AutoStrategy(choices={ {k: c.spec for k, c in self.choices.items()} }, world={self.ep.world})"


def _known(predicted: dict) -> dict:
    return {s: ms for s, ms in predicted.items() if ms is not None}
