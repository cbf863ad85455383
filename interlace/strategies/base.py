"""The interface every MoE strategy implements, and the registry the layer picks from."""

from __future__ import annotations

from typing import ClassVar

import torch

from interlace.parallel.comm import ExpertParallel
from interlace.config import MoEConfig


class Strategy:
    """Dispatch → local experts → combine, for routing the layer already decided.

    A strategy gets this rank's tokens and routing and returns the combined outputs:

        x (T, N), topk_idx (T, k) int64, topk_weight (T, k) → out (T, N), x.dtype

    ``w_up`` (E_local, up_width, N) and ``w_down`` (E_local, N, K) are this rank's experts.
    Gradients flow through autograd. Subclasses set ``name`` and register themselves with
    :func:`register_strategy`.
    """

    name: ClassVar[str] = ""
    # Whether the layer routes with the one-kernel Triton router (interlace.kernels.router_topk)
    # or with plain torch ops (what the naive baseline does).
    fused_routing: ClassVar[bool] = False

    def __init__(self, config: MoEConfig, ep: ExpertParallel, **options):
        if options:
            raise TypeError(f"strategy {self.name!r} takes no options, got {sorted(options)}")
        self.config = config
        self.ep = ep

    @classmethod
    def parse_arg(cls, arg: str) -> dict:
        """Options from the ``name:arg`` spelling (e.g. ``"pipelined:4"``)."""
        raise ValueError(f"strategy {cls.name!r} takes no ':' argument, got {arg!r}")

    def __call__(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weight: torch.Tensor,
        w_up: torch.Tensor,
        w_down: torch.Tensor,
    ) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world={self.ep.world}, experts/rank={self.ep.num_local})"


STRATEGIES: dict[str, type[Strategy]] = {}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    if not cls.name or cls.name in STRATEGIES:
        raise ValueError(f"strategy name {cls.name!r} is empty or taken")
    STRATEGIES[cls.name] = cls
    return cls


def make_strategy(name: str, config: MoEConfig, ep: ExpertParallel, **options) -> Strategy:
    """Build a strategy by name; ``"name:arg"`` passes ``arg`` through ``Strategy.parse_arg``.

    Strategies may create process groups: construct them on every rank in the same order.
    """
    base, _, arg = name.partition(":")
    if base not in STRATEGIES:
        raise ValueError(f"unknown strategy {base!r}; available: {', '.join(sorted(STRATEGIES))}")
    cls = STRATEGIES[base]
    if arg:
        options = {**cls.parse_arg(arg), **options}
    return cls(config, ep, **options)
