"""The interface every MoE strategy implements, and the registry the layer picks from."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
from typing import ClassVar

import torch

from interlace import op_keys
from interlace.parallel.comm import ExpertParallel
from interlace.config import MoEConfig


def triton_runs_on(device: torch.device | str) -> bool:
    """Whether Triton kernels can run on ``device`` in this process: a CUDA device, or the CPU
    under Triton's interpreter (``TRITON_INTERPRET=1`` in the environment before Python starts)."""
    device = torch.device(device)
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    from triton import knobs

    return bool(knobs.runtime.interpret)


_NOTHING = contextlib.nullcontext()


def outside_inference_mode():
    """A context that runs a strategy call with inference mode off (grad stays off) where it is on.

    NOTE: what a strategy makes in a call and keeps (peer buffers and their epoch counters, graphs'
    static inputs and outputs, shared scratch) would be inference tensors if made under
    ``torch.inference_mode()``, and a later call outside it (a training step after an evaluation
    that ran under inference mode) may not update those in place. Made with it off, they are plain
    tensors, which calls in either mode may update; the call's output is then a plain tensor.
    Outside inference mode it is a shared null context (nothing on a decode call's host path)."""
    return _inference_mode_off() if torch.is_inference_mode_enabled() else _NOTHING


@contextlib.contextmanager
def _inference_mode_off():
    with torch.inference_mode(False), torch.no_grad():
        yield


def require_triton(spec: str, device: torch.device | str) -> None:
    """The one-line ``ValueError`` of a strategy whose kernels are Triton-only, on a device
    where Triton cannot run (for :meth:`Strategy.check_runtime`)."""
    if not triton_runs_on(device):
        raise ValueError(
            f"strategy {spec!r} runs Triton kernels, which need a CUDA device or, on the CPU, Triton's "
            f"interpreter (set TRITON_INTERPRET=1 before starting Python); the layer is on {torch.device(device)}"
        )


class Strategy:
    """Dispatch → local experts → combine, for routing the layer already decided.

    A strategy gets this rank's tokens and routing and returns the combined outputs:

        x (T, N), topk_idx (T, k) int64, topk_weight (T, k) → out (T, N), x.dtype

    ``w_up`` (E_local, up_width, N) and ``w_down`` (E_local, N, K) are this rank's experts.
    Gradients flow through autograd. Subclasses set ``name`` and register themselves with
    :func:`register_strategy`.

    What a strategy needs from the machine is said by :meth:`check_runtime`, which the layer
    calls before it builds the strategy: on a machine that lacks it, the user gets one line
    saying what is missing instead of a backend's error at the first call.
    """

    name: ClassVar[str] = ""
    # Whether the layer routes with the one-kernel Triton router (interlace.kernels.router_topk)
    # or with plain torch ops (what the naive baseline does).
    fused_routing: ClassVar[bool] = False
    # Whether every call runs Triton kernels (no torch fallback): checked by check_runtime's default.
    needs_triton: ClassVar[bool] = False
    # Whether the strategy can route inside its own kernel: the layer then asks routes_call and,
    # if it says yes, calls forward_layer with the router instead of routing first.
    routes_itself: ClassVar[bool] = False
    # Whether the strategy runs block-scaled FP8 experts (MoEConfig.expert_quant="fp8"): its
    # __call__ / forward_layer take w_up, w_down as interlace.fp8.BlockFP8Weight. make_strategy
    # refuses an FP8 config for a strategy without it; ``auto`` picks among those with it.
    fp8_experts: ClassVar[bool] = False
    # Calls with one token count before this strategy's steady state: the first compiles its
    # kernels; strategies that capture a CUDA graph on the second call (fused, persistent) say 2.
    # ``auto`` times a layer's candidate only after this many of its calls.
    @property
    def warm_calls(self) -> int:
        return 1

    # CUDA graphs this strategy has captured (each a one-time cost inside the call that captured:
    # ``auto`` does not count such a call as a timing of the strategy).
    captures: int = 0

    # What errors call the layer this strategy serves (the layer sets it: "MoELayer 3").
    label: str = "an interlace layer"
    # The dataclass whose fields the constructor also takes as keyword options (through
    # ``**fields``), for the names :func:`make_strategy` accepts; None: the named parameters only.
    options_class: ClassVar[type | None] = None
    # The strategy's agreement with its peers on each call (:class:`~interlace.parallel.agreement.
    # CallAgreement`), for those whose choice depends on every rank's call; None: no agreement.
    _agree = None

    def __init__(self, config: MoEConfig, ep: ExpertParallel, **options):
        if options:
            raise TypeError(f"strategy {self.name!r} takes no options, got {sorted(options)}")
        self.config = config
        self.ep = ep
        self._register_op_key()

    def _register_op_key(self) -> None:
        # The key that names this instance inside the compiled layer's ops (interlace.op_keys).
        self.op_key = op_keys.register(self)

    def __setstate__(self, state: dict) -> None:
        # A copy (copy.deepcopy, pickle) is another strategy: it gets its own key.
        self.__dict__.update(state)
        self._register_op_key()

    def __reduce_ex__(self, protocol):
        # NOTE: a copy of a strategy that make_strategy built (copy.deepcopy of a model, pickle) is
        # built anew from its name and options. What it holds from its calls is not state to copy:
        # a peer buffer's address table would still point at the original's memory (the copy's
        # kernels would wait on flags nobody sets), and graphs, plans and auto's timings belong to
        # the original's buffers.
        recipe = self.__dict__.get("_recipe")
        if recipe is None:
            return super().__reduce_ex__(protocol)
        return _rebuild_strategy, (recipe[0], self.config, self.ep, recipe[1], self.label)

    @classmethod
    def parse_arg(cls, arg: str) -> dict:
        """Options from the ``name:arg`` spelling (e.g. ``"pipelined:4"``)."""
        raise ValueError(f"strategy {cls.name!r} takes no ':' argument, got {arg!r}")

    @classmethod
    def check_runtime(cls, spec: str, device: torch.device, **options) -> None:
        """Raise ``ValueError``, one line saying what is needed, if this strategy with these
        options cannot run on ``device`` in this process.

        ``spec`` is the name as the user spelled it (``"fused:train"``), for the message;
        ``options`` are the constructor's (the ``:arg`` already parsed; they are validated by
        the constructor, after this check). The default checks :attr:`needs_triton`; a strategy
        whose needs depend on its options overrides it (:func:`require_triton` helps).
        """
        if cls.needs_triton:
            require_triton(spec, device)

    def begin_call(self, num_tokens: int, train: bool, routed: bool) -> bool:
        """Called by the layer before it routes, once per call and on every rank alike (not while
        ``torch.compile`` traces), with this rank's token count, whether the call builds an
        autograd graph, and whether this rank would hand it over with the router
        (:meth:`routes_call`). Returns whether it does: a strategy that agrees with its peers
        (:mod:`interlace.parallel.agreement`) posts here, under the router's work, and may make a
        rank without tokens follow the group. By default: ``routed``."""
        return routed if self._agree is None else self._agree.begin(num_tokens, train, routed)

    def routes_call(self, x: torch.Tensor, router, w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
        """(``routes_itself`` strategies) Whether this call goes to :meth:`forward_layer`."""
        return False

    def forward_layer(self, x: torch.Tensor, router, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        """(``routes_itself`` strategies) x (T, N) → (T, N): routing by ``router``
        (:class:`interlace.routing.Router`) and the experts, all inside the strategy."""
        raise NotImplementedError

    def __call__(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weight: torch.Tensor,
        w_up: torch.Tensor,
        w_down: torch.Tensor,
    ) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        """Drop what this strategy holds for its own calls (captured CUDA graphs, call plans):
        the layer calls it when it switches to another strategy. Buffers shared by every layer of
        the process stay until :func:`interlace.parallel.release_shared_buffers`. No-op by default."""

    def synchronize_and_check(self) -> None:
        """Wait for this strategy's device work and raise ``RuntimeError`` if one of its waits timed
        out. Strategies that keep no device-side error record (their collectives are NCCL's) have
        nothing to wait for here: no-op by default."""

    def release_buffers(self) -> None:
        """After :meth:`close`, for good: leave the process-wide buffers this strategy took (the
        last strategy to leave one frees it; ``auto`` calls it on the candidates it no longer
        runs). The caller makes sure no launch, here or on a peer, still uses them. No-op by
        default."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world={self.ep.world}, experts/rank={self.ep.num_local})"


STRATEGIES: dict[str, type[Strategy]] = {}

def strategy_by_key(key: int) -> Strategy:
    """The live strategy whose ``op_key`` holds ``key``; ``RuntimeError`` if it was freed."""
    return op_keys.lookup(key, "strategy")


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    if not cls.name or cls.name in STRATEGIES:
        raise ValueError(f"strategy name {cls.name!r} is empty or taken")
    STRATEGIES[cls.name] = cls
    return cls


def strategy_class(name: str) -> type[Strategy]:
    """The registered class of ``"name"`` or ``"name:arg"``; ``ValueError`` for an unknown name."""
    if not isinstance(name, str):
        raise TypeError(f"strategy must be a name (str), got {type(name).__name__}")
    base = name.partition(":")[0]
    if base not in STRATEGIES:
        raise ValueError(f"unknown strategy {named(base, STRATEGIES)}; available: {', '.join(sorted(STRATEGIES))}")
    return STRATEGIES[base]


def named(name: str, valid) -> str:
    """``"'fusd' (did you mean 'fused'?)"``: ``name`` quoted, with the closest of ``valid`` if one is close."""
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)


def check_names(given, valid: list[str], what: str, noun: str = "option") -> None:
    """``ValueError`` for the names of ``given`` not in ``valid``: each named, with the closest
    valid one where there is one, and the whole valid list."""
    unknown = [name for name in given if name not in valid]
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        raise ValueError(f"{what}: unknown {noun}{plural} {', '.join(named(n, valid) for n in unknown)}; "
                         f"valid: {', '.join(valid)}")


def option_names(cls: type[Strategy]) -> list[str]:
    """The keyword options the strategy ``cls`` takes: the fields of its ``options_class``, then
    its constructor's named parameters after ``config`` and ``ep``."""
    fields = [f.name for f in dataclasses.fields(cls.options_class)] if cls.options_class else []
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = inspect.signature(cls.__init__).parameters.values()
    return fields + [p.name for p in parameters if p.kind in keyword and p.name not in ("self", "config", "ep")]


def runs_experts_of(cls: type[Strategy], config: MoEConfig) -> bool:
    """Whether strategy class ``cls`` runs ``config``'s experts as they are stored (dense, or
    FP8 where ``cls.fp8_experts``)."""
    return config.expert_quant is None or (config.expert_quant == "fp8" and cls.fp8_experts)


def check_expert_quant(spec: str, config: MoEConfig) -> None:
    """``ValueError`` naming the strategies that run FP8 experts, where ``spec``'s does not
    run ``config``'s."""
    cls = strategy_class(spec)
    if not runs_experts_of(cls, config):
        raise ValueError(f"strategy {spec!r} does not run FP8 experts (MoEConfig.expert_quant={config.expert_quant!r}); "
                         f"strategies that do: {', '.join(fp8_strategy_names())}")


def fp8_strategy_names() -> list[str]:
    """The registered strategies that run FP8 experts (``fp8_experts``), sorted."""
    return sorted(name for name, cls in STRATEGIES.items() if cls.fp8_experts)


def make_strategy(name: str, config: MoEConfig, ep: ExpertParallel, device: torch.device | str | None = None,
                  **options) -> Strategy:
    """Build a strategy by name; ``"name:arg"`` passes ``arg`` through ``Strategy.parse_arg``.

    With ``device``, :meth:`Strategy.check_runtime` runs first (the layer passes its device).
    A strategy that does not run ``config``'s FP8 experts raises ``ValueError`` (:func:`check_expert_quant`).
    Strategies may create process groups: construct them on every rank in the same order.
    """
    cls = strategy_class(name)
    check_expert_quant(name, config)
    _, _, arg = name.partition(":")
    if arg:
        options = {**cls.parse_arg(arg), **options}
    valid = option_names(cls)
    if valid:  # (a strategy without options says so itself: Strategy.__init__)
        check_names(options, valid, f"strategy {cls.name!r}")
    if device is not None:
        cls.check_runtime(name, torch.device(device), **options)
    strategy = cls(config, ep, **options)
    strategy._recipe = (name, options)  # (what a copy is built from: Strategy.__reduce_ex__)
    return strategy


def _rebuild_strategy(name: str, config: MoEConfig, ep: ExpertParallel, options: dict, label: str) -> Strategy:
    """A copy of a strategy (:meth:`Strategy.__reduce_ex__`): a new one of the same name and options."""
    strategy = make_strategy(name, config, ep, **options)
    strategy.label = label
    return strategy
