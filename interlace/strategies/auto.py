"""``auto``: per token count, run the strategy the planner predicts fastest on this machine.

For each distinct token count T (once; cached) the strategy asks the planner with the local
performance profile (``interlace profile``; looked up by machine key like ``pipelined``'s, or the
``profile=`` path/object given) which of the registered strategies to run: ``sequential`` or
``pipelined`` with a degree r (``interlace.perf.planner.choose_degree``: the calibrated op-level
model, leaving r = 1 only for a gain larger than the model's own error). Strategies the profile
has no measurements for (a fused kernel, say) are not chosen: the planner would only be
guessing. Without a profile (e.g. CPU gloo ranks) it runs ``sequential`` and warns once.

Contract (as ``pipelined:auto``): every rank of the expert-parallel group must call the layer
with the same T, so that all ranks reach the same choice (the choice is a deterministic function
of config, T, world size and profile). ``pipelined`` carries every rank's degree in its count
exchange and raises on a disagreement. ``layer.strategy.choices`` records what was chosen.
"""

from __future__ import annotations

import warnings

from interlace.strategies.base import Strategy, make_strategy, register_strategy


def choose_strategy(config, tokens: int, world: int, profile, max_degree: int = 16) -> tuple[str, list[str]]:
    """(strategy spec, notes) for ``tokens`` tokens per rank; raises FileNotFoundError without a profile."""
    if world == 1:
        return "sequential", ["world size 1: nothing to overlap"]
    from interlace.perf.planner import choose_degree

    plan = choose_degree(config, tokens, world, profile, max_degree=max_degree)
    notes = list(plan.notes) + [f"predicted ms per degree: { {r: round(ms, 3) for r, ms in plan.per_degree_ms.items()} }"]
    return ("sequential" if plan.degree == 1 else f"pipelined:{plan.degree}"), notes


@register_strategy
class AutoStrategy(Strategy):
    name = "auto"
    fused_routing = True

    def __init__(self, config, ep, profile=None, max_degree: int = 16):
        super().__init__(config, ep)
        self._profile = profile
        self.max_degree = max_degree
        self.choices: dict[int, str] = {}
        self.notes: dict[int, list[str]] = {}
        self._impls: dict[str, Strategy] = {}
        self._warned = False

    def choice_for(self, tokens: int) -> str:
        if tokens not in self.choices:
            from interlace.perf.profile import Profile, load_profile

            try:
                if self.ep.world > 1 and not isinstance(self._profile, Profile):
                    self._profile = load_profile(self.ep.world, path=self._profile)  # read once
                spec, notes = choose_strategy(self.config, tokens, self.ep.world, self._profile, self.max_degree)
            except FileNotFoundError as err:
                if not self._warned:
                    warnings.warn(f"auto: {err}; running sequential (run `interlace profile` to plan)", stacklevel=2)
                    self._warned = True
                spec, notes = "sequential", [str(err)]
            self.choices[tokens], self.notes[tokens] = spec, notes
        return self.choices[tokens]

    def _impl(self, spec: str) -> Strategy:
        if spec not in self._impls:
            self._impls[spec] = make_strategy(spec, self.config, self.ep)
        return self._impls[spec]

    def __call__(self, x, topk_idx, topk_weight, w_up, w_down):
        return self._impl(self.choice_for(x.shape[0]))(x, topk_idx, topk_weight, w_up, w_down)

    def __repr__(self) -> str:
        return f"AutoStrategy(choices={self.choices}, world={self.ep.world})"
