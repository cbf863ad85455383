"""``auto``: per token count, run the strategy the planner predicts fastest on this machine.

For each distinct token count T and call mode (once; cached) the strategy asks the planner with
the local performance profile (``interlace profile``; looked up by machine key like
``pipelined``'s, or the ``profile=`` path/object given) which of the registered strategies to
run:

* ``sequential`` or ``pipelined`` with a degree r (``interlace.planning.pipemoe.degree.choose_degree``: the
  calibrated op-level model, leaving r = 1 only for a gain larger than the model's own error),
  planned on the forward + backward prediction for a call whose backward will run (autograd
  graph) and on the forward one otherwise;
* ``fused`` for a forward-only call where the profile *measured* the fused forward beside
  sequential's for this exact shape class (``ShapeProfile.fused``, interpolated over T·k) and
  the predicted time beats the best of the above by more than ``FUSED_MARGIN``;
* ``fused:train`` (the fused kernels forward and backward) for a training call, likewise from
  measured ``fused:train`` / ``sequential`` forward + backward pairs (``ShapeProfile.fused_train``).
  It wins on some shapes and token counts and loses on others, so only measurements decide. It
  holds more memory than ``sequential`` (``docs/performance.md``): ``train_fused=False`` keeps
  training calls off it.

Strategies the profile has no measurements for are not chosen: the planner would only be
guessing. Without a profile (e.g. CPU gloo ranks) it runs ``sequential`` and warns once.

Contract (as ``pipelined:auto``): every rank of the expert-parallel group must call the layer
with the same T and mode, so that all ranks reach the same choice (the choice is a
deterministic function of config, T, mode, world size and profile). ``pipelined`` carries every
rank's degree in its count exchange and raises on a disagreement. ``layer.strategy.choices``
records what was chosen, keyed by ``(T, mode)``.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from interlace.planning.pipemoe.degree import choose_degree, fused_speedup
from interlace.planning.profile import as_profile, shape_key
from interlace.strategies.base import Strategy, make_strategy, register_strategy

# Smallest measured-and-interpolated gain of fused over the best alternative that auto acts on
# (timings of one strategy move between machine leases; docs/performance.md).
FUSED_MARGIN = 0.05


def choose_strategy(config, tokens: int, world: int, profile, max_degree: int = 16,
                    mode: str = "fwd", train_fused: bool = True) -> tuple[str, list[str]]:
    """(strategy spec, notes) for ``tokens`` tokens per rank and a ``"fwd"`` or ``"fwdbwd"``
    call; raises FileNotFoundError without a profile."""
    if world == 1:
        return "sequential", ["world size 1: nothing to overlap"]
    profile = as_profile(profile, world)  # read a path once, for both questions below
    plan = choose_degree(config, tokens, world, profile, max_degree=max_degree, mode=mode)
    notes = list(plan.notes) + [f"predicted ms per degree: { {r: round(ms, 3) for r, ms in plan.per_degree_ms.items()} }"]
    spec = "sequential" if plan.degree == 1 else f"pipelined:{plan.degree}"
    fused = "fused" if mode == "fwd" else "fused:train"
    if mode != "fwd" and not train_fused:
        notes.append("fused:train: not considered (train_fused=False)")
        return spec, notes
    shape = profile.shapes.get(shape_key(config, world))
    speedup = None if shape is None else fused_speedup(shape, tokens * config.top_k, mode)
    if speedup is None:
        notes.append(f"{fused}: no measured {fused}/sequential {mode} pairs for this shape class in the profile")
        return spec, notes
    fused_ms = plan.per_degree_ms[1] / speedup if 1 in plan.per_degree_ms else float("inf")
    best_ms = plan.per_degree_ms[plan.degree]
    measured_at = sorted({int(t) for t, *_ in shape.fused_pairs(mode)})
    notes.append(f"{fused}: {speedup:.2f}x sequential at T={tokens} (pairs measured at T={measured_at}, held flat "
                 f"outside), predicted {fused_ms:.3f} ms against {best_ms:.3f} ms for {spec}")
    if fused_ms < best_ms * (1 - FUSED_MARGIN):
        return fused, notes
    return spec, notes


@register_strategy
class AutoStrategy(Strategy):
    name = "auto"
    fused_routing = True

    def __init__(self, config, ep, profile=None, max_degree: int = 16, train_fused: bool = True):
        super().__init__(config, ep)
        self._profile = profile
        self.max_degree = max_degree
        self.train_fused = train_fused
        self.choices: dict[tuple[int, str], str] = {}
        self.notes: dict[tuple[int, str], list[str]] = {}
        self._impls: dict[str, Strategy] = {}
        self._warned = False

    def choice_for(self, tokens: int, mode: str = "fwd") -> str:
        """The strategy spec for a call of ``tokens`` tokens per rank (``mode`` ``"fwd"``: no
        backward will run; ``"fwdbwd"``: a training call)."""
        key = (tokens, mode)
        if key not in self.choices:
            try:
                if self.ep.world > 1:
                    self._profile = as_profile(self._profile, self.ep.world)  # read once
                spec, notes = choose_strategy(self.config, tokens, self.ep.world, self._profile, self.max_degree,
                                              mode, self.train_fused)
            except FileNotFoundError as err:
                if not self._warned:
                    warnings.warn(f"auto: {err}; running sequential (run `interlace profile` to plan)", stacklevel=2)
                    self._warned = True
                spec, notes = "sequential", [str(err)]
            self.choices[key], self.notes[key] = spec, notes
        return self.choices[key]

    def _impl(self, spec: str, tokens: int) -> Strategy:
        impl = self._impls.get(spec)
        if spec in ("fused", "fused:train") and (impl is None or impl.max_tokens < tokens):
            # The fused buffers are sized once; a larger T than any before gets a new, larger
            # strategy. Every rank calls with the same T (the contract above), so all rebuild
            # together, and sizing by T needs no host sync.
            if impl is not None and impl.buf is not None:
                # Host sync, only when growing: the old buffers are freed below, and no peer may
                # still be writing into them (each rank's own work, then all ranks).
                impl.synchronize_and_check()
                if self.ep.world > 1:
                    dist.barrier(group=self.ep.group)
            impl = self._impls[spec] = make_strategy(spec, self.config, self.ep, max_tokens=tokens)
        elif impl is None:
            impl = self._impls[spec] = make_strategy(spec, self.config, self.ep)
        return impl

    def __call__(self, x, topk_idx, topk_weight, w_up, w_down):
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or w_up.requires_grad or w_down.requires_grad)
        spec = self.choice_for(x.shape[0], "fwdbwd" if needs_grad else "fwd")
        return self._impl(spec, x.shape[0])(x, topk_idx, topk_weight, w_up, w_down)

    def __repr__(self) -> str:
        return f"AutoStrategy(choices={self.choices}, world={self.ep.world})"
