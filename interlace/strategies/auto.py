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
  where ``persistent`` is a candidate: see *Routed calls*).
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

**Buffers.** ``fused`` / ``fused:train`` (one shared peer buffer) and ``persistent`` at W > 1
hold buffers for a fixed number of tokens per rank, sized from the agreed count of their first
call (rounded up to a power of two); a call whose agreed count is over them grows them first on
every rank (a device sync and a barrier, at most once per doubling). With the ``capacity`` option
the fused buffers are sized to it once and never grow (memory planning: the user promises no rank
passes more tokens; a call that breaks it raises on every rank alike, before any launch).
Once a key decides, the candidates no key runs or still calibrates are closed and their buffers
dropped (a device sync and a barrier, once per decision), so that the steady state holds what the
chosen strategies hold and no more.

**Calibration.** For a key with no decision, the candidates come from the performance model
(:func:`interlace.planning.pipemoe.degree.choose_degree`, :func:`...fused_speedup`): ``sequential``,
``pipelined:r`` at the planner's degree r > 1, and ``fused`` (forward calls) or ``fused:lean``
(training calls, unless ``train_fused=False`` or its buffers exceed ``memory_cap``: ``fused:train``'s
kernels and graphs keeping the rows received, where ``fused:train`` keeps W·cap of them); the model
orders them and drops those predicted ``prune_ratio`` times slower than the best prediction.
Each candidate serves real calls (its output is the call's output; nothing runs twice, so
results are exactly that candidate's): ``warmup`` untimed rounds, then ``samples`` timed rounds,
each round in another order (each candidate after each other one equally often: a GPU-bound
call's time depends on the call before it).
A training call is timed forward + backward (marks on the output's and the inputs' gradients);
a key decides only on complete timings: where some candidate's backward has not run yet on some
rank (gradient accumulation: several forwards, then the backwards; or the other layers sharing the
calibration, below, in the same forward pass), its calls run the first candidate untimed until
they are (at most ``MAX_WAITING_CALLS``). Where the agreed medians of the fastest
candidates lie within ``resolution`` of each other, the key times those candidates for another
round (at most ``extra_samples`` rounds): one call of a GPU-bound strategy moves by ±10% from call
to call, so the median of three cannot tell two strategies 5% apart, and a wrong pick is paid on
every later call while an extra round is paid once. A timed call during which its candidate
captured a CUDA graph on some rank (``Strategy.captures``: a one-time cost, e.g. ``fused:lean``
capturing again for more rows) is not counted, and every rank times that candidate once more.
The ``auto`` layers of a process with one config, expert-parallel group and options share one
calibration per key (:func:`~interlace.strategies.auto_plan.shared_decider`): each layer's call
serves the next scheduled candidate, so a model of L such layers decides in about 1/L of the
steps, and all of them run what it decides (each with its own strategies and buffers). A timed
slot that reaches a layer whose own instance of the candidate has served fewer than
``max(warmup, warm_calls)`` calls (the first compiles; ``fused`` and ``persistent`` capture a CUDA
graph on the second) is served untimed by that instance and stays for the next call. The config's
``source`` (HF blocks name their layer there) does not split the sharing.
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

**Routed calls.** Inference calls come with the router (:meth:`AutoStrategy.routes_call`)
where ``persistent`` (the whole layer in one launch, router included) is a candidate, so that it
may route inside its kernel while the others route first, each timed with its routing (a device
sync before each such calibration call: each is timed from an idle GPU, its host time
included). At world size 1 ``persistent`` is calibrated against ``sequential`` (and training
calls, and everything else, run ``sequential``: nothing to overlap or agree on). At W > 1 it is
calibrated beside the model's candidates for buckets up to ``persistent_max_tokens`` tokens per
rank (decode and prefill sizes), under key mode ``"fwd-routed"``; larger buckets keep the key mode
``"fwd"`` of calls that come routed (a call with ``expert_indices``, a balance loss in training
mode or under ``torch.compile``), whose decisions serve both kinds of call. Every rank with
tokens must hand over the same kind of call: where they differ, every rank raises; a rank
without tokens follows the others.

**FP8 experts** (``MoEConfig.expert_quant="fp8"``). Only candidates whose strategy runs them
(``Strategy.fp8_experts``) are considered: the model's, the ``candidates`` option's, routed calls'
``persistent``, a cached or profile-only decision (another is replaced by ``sequential``, which
runs every form of experts). Their decisions are cached under their own shape key (``-fp8``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from interlace.parallel.agreement import MAX_TOKENS, CallAgreement
from interlace.strategies.auto_decisions import BackwardMark, Choice, Clock, token_bucket
from interlace.strategies.auto_plan import FUSED_SPECS, PERSISTENT, ROUTED, KeyState, shared_decider
from interlace.strategies.base import Strategy, check_names, make_strategy, register_strategy, strategy_class

# Training calls' strategies a recompute may still ask for (activation checkpointing).
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
    memory_cap: int | None = None  # bytes: fused:train / persistent are no candidates where their buffers need more
    # fused:train keeps every source's receive region at capacity for its backward: W·min(k, E_local)/k
    # times the rows sequential keeps (2 at EP 2, 8 at EP 8). Named in `candidates`, it is timed only
    # where that ratio is at most this (None: no limit). (auto's own candidates hold fused:lean.)
    train_memory_ratio: float | None = 2.0
    prune_ratio: float = 1.5  # candidates predicted slower than this × the best are not timed
    warmup: int = 1  # untimed rounds (each candidate once per round) before the timed ones
    samples: int = 3  # timed rounds; the median of each candidate's samples is what ranks agree on
    # Further timed rounds (at most extra_samples) of the candidates whose agreed medians lie within
    # `resolution` (relative) of the fastest one's: close calls get more samples, clear ones none.
    resolution: float = 0.03
    extra_samples: int = 6
    # The auto layers of a process with the same config, expert-parallel group and options share one
    # calibration per key (their calls serve it in turn) and so its decision; False: each its own.
    share_calibration: bool = True
    cache: bool = True  # read and write the decision cache under the profile dir
    decisions_dir: str | None = None  # the decision cache's folder instead of <profile dir>/decisions
    shipped_decisions: bool = True  # read the decisions shipped for the presets beneath the cache
    agree_timeout_s: float = 300.0  # bound on every wait of the agreement (a peer that never comes raises)
    # W > 1: inference calls of buckets up to this many tokens per rank also calibrate `persistent`
    # (decode and prefill: its buffers grow with the bucket, to at most this many per rank); 0: never
    persistent_max_tokens: int = 16384

    def __post_init__(self):
        if self.capacity is not None and (not isinstance(self.capacity, int) or self.capacity < 1):
            raise ValueError(f"auto: capacity must be a positive int or None, got {self.capacity!r}")
        if self.warmup < 0 or self.samples < 1:
            raise ValueError(f"auto: warmup must be ≥ 0 and samples ≥ 1, got {self.warmup}, {self.samples}")
        if self.extra_samples < 0 or not self.resolution >= 0:
            raise ValueError(f"auto: extra_samples and resolution must be ≥ 0, got {self.extra_samples}, "
                             f"{self.resolution}")
        cap = self.persistent_max_tokens
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise ValueError(f"auto: persistent_max_tokens must be an int >= 0, got {cap!r}")
        if not self.agree_timeout_s > 0:
            raise ValueError(f"auto: agree_timeout_s must be > 0, got {self.agree_timeout_s}")
        if self.train_memory_ratio is not None and not self.train_memory_ratio > 0:
            raise ValueError(f"auto: train_memory_ratio must be > 0 or None, got {self.train_memory_ratio!r}")
        if self.prune_ratio < 1:
            raise ValueError(f"auto: prune_ratio must be ≥ 1, got {self.prune_ratio}")
        for spec in self.candidates or ():
            cls = strategy_class(spec)
            if cls.name == "auto" or (cls.name == "pipelined" and not spec.partition(":")[2].isdigit()):
                raise ValueError(f"auto: candidate {spec!r} must have fixed parameters (e.g. 'pipelined:4'): "
                                 f"a per-rank choice could differ between ranks")


@dataclass
class _Call:
    """One call as the runner sees it: the key it is served under, the group's largest token
    count, whether it trains, and its arguments: ``(x, topk_idx, topk_weight, w_up, w_down)``, or
    ``(x, router, w_up, w_down)`` for a call handed over with the router (``routed``)."""

    key: tuple[int, str]
    tokens: int
    train: bool
    routed: bool
    args: tuple


@register_strategy
class AutoStrategy(Strategy):
    name = "auto"
    options_class = AutoOptions
    fused_routing = True
    routes_itself = True  # inference calls may come with the router (routes_call)
    fp8_experts = True  # it picks among the candidates that run them (runs_experts_of)

    def __init__(self, config, ep, options: AutoOptions | dict | None = None, **given):
        super().__init__(config, ep)
        if isinstance(options, dict):
            given, options = {**options, **given}, None
        valid = [f.name for f in fields(AutoOptions)]
        check_names(given, valid, "auto options")
        base = options or AutoOptions()
        self.options = opts = AutoOptions(**{**{f: getattr(base, f) for f in valid}, **given})
        # The side channel is made here, where every rank builds the layer alike (a collective).
        distributed = ep.world > 1 and ep.group is not None and dist.is_initialized()
        self._agree = CallAgreement(ep, opts.agree_timeout_s) if distributed else None
        self.decider = shared_decider(config, ep, opts, self._group)
        if opts.candidates is not None and not any(self.decider.runs_experts(c) for c in opts.candidates):
            raise ValueError(f"auto: none of the candidates {list(opts.candidates)} runs FP8 experts "
                             f"(MoEConfig.expert_quant={config.expert_quant!r})")
        self._label = Strategy.label
        self._impls: dict[str, Strategy] = {}
        self._calls_of: dict[str, int] = {}  # spec → calibration calls its current instance served here
        # Tokens per rank the buffers of a buffered candidate hold (the fused pair shares one buffer).
        self._sized: dict[str, int] = {"fused": opts.capacity or 0}
        # W > 1: decided keys → (their strategy, the most tokens per rank it serves as it is: a
        # buffered strategy holds a fixed count, and a larger call takes the path that grows them; spec)
        self._ready: dict[tuple[int, str], tuple[Strategy, int, str]] = {}
        # Training calls' strategies, latest last: an activation checkpoint's recompute (a forward
        # run inside the backward) takes the one its forward ran, and is neither timed nor counted.
        self._served: deque[Strategy] = deque(maxlen=MAX_SERVED)
        self._released: set[tuple[int, str]] = set()  # decided keys whose losers this layer has dropped

    @property
    def _group(self):
        """The side channel (None at world size 1): the agreement's, which holds it weakly."""
        return self._agree.group if self._agree is not None else None

    @property
    def label(self) -> str:
        return self._label

    @label.setter
    def label(self, value: str) -> None:  # (the agreement's errors name the layer too)
        self._label = value
        if self._agree is not None:
            self._agree.label = value

    @property
    def choices(self) -> dict[tuple[int, str], Choice]:
        """Every decided key's :class:`Choice` (``(bucket, mode)`` → what it runs and why)."""
        return self.decider.choices

    @property
    def measure_override(self):
        """(tests) ``fn(spec, measured_ms) -> ms``: injects timings into calibration."""
        return self.decider.measure_override

    @measure_override.setter
    def measure_override(self, fn) -> None:
        self.decider.measure_override = fn

    def choice_for(self, tokens: int, mode: str = "fwd") -> Choice | None:
        """The decision recorded for the bucket of ``tokens`` (the group's largest count) and
        ``mode`` (``"fwd"``: the routed calls' decision where there is one), or None while it is
        not decided."""
        bucket = token_bucket(tokens)
        return (mode == "fwd" and self.choices.get((bucket, ROUTED))) or self.choices.get((bucket, mode))

    # -- the strategies a key runs ----------------------------------------------------------------
    def _impl(self, spec: str, agreed: int) -> Strategy:
        """The sub-strategy ``spec``; a buffered one (the fused pair, ``persistent`` at W > 1) with
        buffers for ``agreed`` tokens per rank (the group's largest count of this call, the same
        number on every rank)."""
        impl = self._impls.get(spec)
        buffered = spec in FUSED_SPECS or (spec == PERSISTENT and self.ep.world > 1)
        if not buffered:
            if impl is None:
                impl = self._impls[spec] = make_strategy(spec, self.config, self.ep)
            return impl
        size = "fused" if spec in FUSED_SPECS else spec
        cap = self.options.capacity if size == "fused" else None
        if cap is not None and agreed > cap:
            raise ValueError(f"auto: a rank passed {agreed} tokens, over capacity={cap} (the fused buffers' "
                             f"fixed size); raise capacity or leave it None to grow the buffers")
        need = cap or max(1, agreed)
        if need > self._sized.get(size, 0):
            self._sized[size] = cap or token_bucket(need)  # every rank grows here: same agreed value
        if impl is not None and impl.max_tokens >= need:
            return impl
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"auto: {spec}'s buffers must grow to {self._sized[size]} tokens per rank "
                               f"inside a CUDA graph capture; run the layer eagerly with the largest "
                               f"count first, or set the capacity option")
        if impl is not None:
            self._drop(spec)  # (decided keys that ran the old buffers take the slow path once more)
        options = {"agree": False} if spec == PERSISTENT else {}
        impl = self._impls[spec] = make_strategy(spec, self.config, self.ep, max_tokens=self._sized[size], **options)
        return impl

    def _drop(self, *specs: str) -> None:
        """Close the sub-strategies ``specs`` and forget them (and the decided keys they served).
        NOTE: a device sync and a barrier where one holds buffers a peer may still write into."""
        impls = [self._impls.pop(s) for s in specs if s in self._impls]
        for s in specs:
            self._calls_of.pop(s, None)  # (a new instance starts cold)
        if not impls:
            return
        if any(getattr(i, "buf", None) is not None or i.name == PERSISTENT for i in impls):
            for impl in impls:
                impl.synchronize_and_check()
            if self._agree is not None:
                dist.barrier(group=self._agree.group)
        for impl in impls:
            impl.close()
            impl.release_buffers()
        self._ready = {k: v for k, v in self._ready.items() if v[2] not in specs}

    def _release_unneeded(self) -> None:
        """After a decision: drop the candidates no key runs or still calibrates (same on every
        rank: the keys' states are)."""
        needed = self.decider.needed_specs()
        self._drop(*[s for s in self._impls if s not in needed])

    def close(self) -> None:
        for impl in self._impls.values():
            impl.close()
        self._impls.clear()
        self._ready.clear()
        self._served.clear()

    # -- which calls come with the router -------------------------------------------------------------
    def routes_call(self, x: torch.Tensor, router, w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
        """Inference calls (no autograd graph) where a candidate routes inside its kernel: at
        world size 1 when more than one candidate runs here; at W > 1 when ``persistent`` can."""
        if not self.options.calibrate:
            return False
        if torch.is_grad_enabled() and any(t.requires_grad for t in (x, router.weight, w_up, w_down)):
            return False
        if self._agree is None:
            return len(self.decider.world1_candidates(x.device)) > 1
        return self.decider.persistent_here(x.device)

    # -- the calls ------------------------------------------------------------------------------------
    def __call__(self, x, topk_idx, topk_weight, w_up, w_down):
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weight, w_up, w_down))
        args = (x, topk_idx, topk_weight, w_up, w_down)
        if self._agree is None:
            key = (token_bucket(x.shape[0]), "fwdbwd" if needs_grad else "fwd")
            if key not in self.choices:
                self.decider.record(key, Choice("sequential", "predicted", notes=["world size 1: nothing to overlap"]))
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
        return self._serve(_Call(key, agreed.tokens, agreed.train, False, args))

    def forward_layer(self, x: torch.Tensor, router, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        """x (T, N) → (T, N), a call handed over with the router: this call's strategy (routing
        inside, or the router first), or a calibration call of the scheduled candidate, timed
        with its routing."""
        args = (x, router, w_up, w_down)
        if self._agree is None:
            return self._serve(_Call((token_bucket(x.shape[0]), "fwd"), x.shape[0], False, True, args))
        agreed = self._agree.settle(x.shape[0], False, True).tokens
        bucket = token_bucket(agreed)
        ready = self._ready.get((bucket, ROUTED))
        if ready is not None and agreed <= ready[1]:  # (a decided key: straight to its strategy)
            return self._run(ready[0], args, True)
        return self._serve(_Call((bucket, self.decider.routed_mode(bucket)), agreed, False, True, args))

    def _serve(self, call: _Call) -> torch.Tensor:
        """A call of a key not (yet) on the fast path: its decision, or the scheduled candidate
        of its calibration, timed."""
        x = call.args[0]
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        state = self.decider.state(call.key, x.device, self._group)
        if state.choice is None and state.served and not capturing:
            self.decider.decide(call.key, state, Clock(x.device), self._group)
        if state.choice is not None:
            # (a layer sharing the decider may not be the one that decided; never inside a capture: the
            # drop syncs the device)
            if call.key not in self._released and not capturing:
                self._released.add(call.key)
                self._release_unneeded()
            spec = state.choice.spec
            impl = self._impl(spec, call.tokens)
            if self._agree is not None:  # W > 1: the key's later calls take the fast path
                ready_key = (call.key[0], ROUTED) if call.routed else call.key
                limit = self._impls[spec].max_tokens if spec in FUSED_SPECS or spec == PERSISTENT else MAX_TOKENS
                self._ready[ready_key] = (impl, limit, spec)
            if call.train:
                self._served.append(impl)
            return self._run(impl, call.args, call.routed)
        if capturing or state.served:
            # Inside a capture nothing is timed or recorded (see the module doc); a served
            # schedule still undecided waits for a backward's timing: the first candidate, untimed.
            impl = self._impl(state.first, call.tokens)
            if call.train and not capturing:
                self._served.append(impl)
            return self._run(impl, call.args, call.routed)
        return self._calibration_call(state, call)

    def _calibration_call(self, state: KeyState, call: _Call) -> torch.Tensor:
        """The scheduled candidate serves this call, timed: forward, and for a training call its
        backward too, through marks on the output's and the inputs' gradients."""
        x = call.args[0]
        clock = Clock(x.device)
        impl = self._impl(state.upcoming, call.tokens)
        calls = self._calls_of.get(state.upcoming, 0)
        self._calls_of[state.upcoming] = calls + 1
        warm = max(self.options.warmup, impl.warm_calls)
        if self.options.warmup and not state.warm_slot and calls < warm:
            # A timed slot, but this layer's own instance is still cold (its first call compiles, a
            # graph strategy's second captures): it serves the call untimed, and the schedule keeps
            # the slot. With layers sharing one calibration the schedule's warm-up round warms one
            # layer's instances only.
            if call.train:
                self._served.append(impl)
            return self._run(impl, call.args, call.routed)
        spec, sample = state.next_call(call.train)
        captures = impl.captures  # (a capture during the call: the sample is not counted, see Sample)
        if call.routed and x.is_cuda:
            # NOTE: a device sync before each routed calibration call (never in the steady state):
            # each candidate is timed from an idle GPU, its host time included. Back to back, a
            # call after one that queued its work asynchronously (persistent) would launch under
            # that work and hide its own host time (sequential's), and win by it.
            torch.cuda.synchronize(x.device)
        sample.marks.append(clock.mark())
        if not call.train:
            out = self._run(impl, call.args, call.routed)
            sample.marks.append(clock.mark())
            sample.captured = impl.captures != captures
            return out
        self._served.append(impl)
        sample.marks += [None, None, None]

        def at(i):
            def mark():
                sample.marks[i] = clock.mark()
                if i == 3:  # (the backward's end: the whole call)
                    sample.captured = impl.captures != captures
            return mark

        x, topk_idx, topk_weight, w_up, w_down = call.args
        x, topk_weight, w_up, w_down = BackwardMark.apply(at(3), x, topk_weight, w_up, w_down)
        out = impl(x, topk_idx, topk_weight, w_up, w_down)
        sample.marks[1] = clock.mark()
        (out,) = BackwardMark.apply(at(2), out)
        return out

    @staticmethod
    def _run(impl: Strategy, args: tuple, routed: bool) -> torch.Tensor:
        """``impl`` on a call's arguments; a routed call's router runs first unless ``impl`` routes itself."""
        if not routed:
            return impl(*args)
        x, router, w_up, w_down = args
        if impl.routes_itself:
            return impl.forward_layer(x, router, w_up, w_down)
        topk_idx, topk_weight, _ = router(x, None, fused=impl.fused_routing)
        return impl(x, topk_idx, topk_weight, w_up, w_down)

    def __repr__(self) -> str:
        return f"AutoStrategy(choices={ {k: c.spec for k, c in self.choices.items()} }, world={self.ep.world})"
