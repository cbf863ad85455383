"""Run-time choice of the pipeline degree from a stored profile.

The layer time for degree r is predicted as

    fixed(T) + (r − 1)·(h_index + chunk(T)) + simulate_ops(ops of the r-chunk pipeline)

where the op list mirrors what ``PipelinedStrategy`` issues after its host sync — per chunk a
re-layout index and dispatch gather, all dispatch all-to-alls, then per chunk the expert
stage and its combine all-to-all, then the combines — each op with its host issue cost and its
device time from the profile's curves (all-to-all: bytes per rank; expert stage: rows; gathers:
bytes over the measured gather bandwidth). ``fixed(T)`` is the per-shape-class α_f + β_f·T fit
of what this model leaves out of a measured ``sequential`` call (routing, the count exchange,
the host sync); ``h_index`` the host cost of one more chunk's counting sort before the sync;
``chunk(T)`` the measured cost of each extra chunk beyond the model (calibrated at degrees 2
and 4 by ``interlace profile``).

The degree is the argmin over the allowed degrees (a brute force over ≤ 16 simulations, done
once per distinct token count and cached by the strategy). PipeMoE's closed-form Theorem 1 on
the α–β lines is reported beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from interlace.config import MoEConfig
from interlace.perf.profile import Profile, load_profile, shape_key
from interlace.perf.schedule import DegreeChoice, Op, pipemoe_theorem1, simulate_ops

DEFAULT_DEGREES = (1, 2, 3, 4, 6, 8, 12, 16)


def _element_size(cfg: MoEConfig) -> int:
    return torch.empty((), dtype=cfg.dtype).element_size()


def _chunks(tokens: int, r: int) -> list[int]:
    from interlace.strategies.pipelined import chunk_sizes

    sizes = chunk_sizes(tokens, r)
    return sizes + [0] * (r - len(sizes))


def pipeline_ops(prof: Profile, cfg: MoEConfig, tokens: int, world: int, r: int) -> list[Op]:
    """The ops the pipelined strategy issues after its host sync, with modelled costs."""
    _, shape = prof.shape(shape_key(cfg, world))
    row_bytes = cfg.hidden * _element_size(cfg)
    bw = prof.copy_gbps * 1e6  # bytes per ms
    h = prof.host_ms
    ops: list[Op] = []
    for tc in _chunks(tokens, r):
        rows = tc * cfg.top_k
        ops.append(Op("prep", "compute", h["prep"], 2 * rows * row_bytes / bw))
    dispatch = []
    for tc in _chunks(tokens, r):
        rows = tc * cfg.top_k
        ops.append(Op("D", "comm", prof.a2a_host_ms, prof.a2a(rows * row_bytes), after=(len(ops) - 1,)))
        dispatch.append(len(ops) - 1)
    combine = []
    for c, tc in enumerate(_chunks(tokens, r)):
        rows = tc * cfg.top_k
        ops.append(Op("E", "compute", shape.expert_host_ms, shape.expert(rows) if rows else 0.0,
                      after=(dispatch[c],)))
        ops.append(Op("C", "comm", prof.a2a_host_ms, prof.a2a(rows * row_bytes), after=(len(ops) - 1,)))
        combine.append(len(ops) - 1)
    for c, tc in enumerate(_chunks(tokens, r)):
        gpu = (tc * cfg.top_k * row_bytes + tc * row_bytes) / bw
        ops.append(Op("K", "compute", h["combine"], gpu, after=(combine[c],)))
    if r > 1:
        ops.append(Op("cat", "compute", 0.01, 2 * tokens * row_bytes / bw))
    return ops


def predict_layer_ms(prof: Profile, cfg: MoEConfig, tokens: int, world: int, r: int,
                     include_fixed: bool = True) -> float:
    total, _ = simulate_ops(pipeline_ops(prof, cfg, tokens, world, r))
    if include_fixed:
        _, shape = prof.shape(shape_key(cfg, world))
        total += shape.fixed(tokens) + (r - 1) * (prof.host_ms["index"] + shape.chunk(tokens))
    return total


@dataclass
class PipelinePlan:
    degree: int
    predicted_ms: float
    per_degree_ms: dict[int, float]
    theorem1: DegreeChoice
    profile_key: str
    shape_used: str
    notes: list[str] = field(default_factory=list)


def choose_degree(cfg: MoEConfig, tokens: int, world: int, profile: Profile | str | None = None,
                  max_degree: int = 16, degrees=DEFAULT_DEGREES) -> PipelinePlan:
    """The predicted-fastest pipeline degree for ``tokens`` tokens per rank.

    Raises FileNotFoundError if no profile is stored for this machine.
    """
    prof = profile if isinstance(profile, Profile) else load_profile(world, path=profile)
    skey = shape_key(cfg, world)
    used, shape = prof.shape(skey)
    notes = [] if used == skey else [f"shape class {skey} not profiled; using nearest {used}"]
    allowed = [r for r in degrees if r <= max_degree] or [1]
    per = {r: predict_layer_ms(prof, cfg, tokens, world, r) for r in allowed}
    best = min(per, key=lambda r: (per[r], r))
    n_d = tokens * cfg.top_k * cfg.hidden * _element_size(cfg)  # bytes per rank, each direction
    rows = tokens * cfg.top_k
    th = pipemoe_theorem1(prof.a2a.line.alpha, prof.a2a.line.beta, shape.expert.line.alpha,
                          shape.expert.line.beta, n_d, rows, r_max=max(allowed))
    return PipelinePlan(best, per[best], per, th, prof.key, used, notes)
