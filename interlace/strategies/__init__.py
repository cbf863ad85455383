"""MoE strategies. Importing this package registers every built-in strategy."""

from interlace.strategies.base import STRATEGIES, Strategy, make_strategy, register_strategy
from interlace.strategies import naive as _naive  # noqa: F401  (registers "naive")
from interlace.strategies import sequential as _sequential  # noqa: F401  (registers "sequential")
from interlace.strategies import pipelined as _pipelined  # noqa: F401  (registers "pipelined")
from interlace.strategies import auto as _auto  # noqa: F401  (registers "auto")
from interlace.strategies.fused import inference as _fused  # noqa: F401  (registers "fused")
from interlace.strategies import tp_ep as _tp_ep  # noqa: F401  (registers "tp_ep")
from interlace.strategies import persistent as _persistent  # noqa: F401  (registers "persistent")

__all__ = ["STRATEGIES", "Strategy", "make_strategy", "register_strategy"]
