"""Run-time choice of the pipeline degree from a stored profile.

The layer time for degree r is predicted as

    simulate_ops(ops of the r-chunk pipeline) + fixed(T·k) + (r − 1)·(h_index + chunk_ms)
        + interference · (all-to-all time that overlaps compute)

where the op list mirrors what ``PipelinedStrategy`` issues after its host sync — per chunk a
re-layout index and dispatch gather, all dispatch all-to-alls, then per chunk the expert
stage and its combine all-to-all, then the combines — each op with its host issue cost and its
device time from the profile's curves (all-to-all: bytes per rank; expert stage: rows; gathers:
bytes over the measured gather bandwidth). ``fixed`` is the per-shape-class α_f + β_f·(T·k) fit
of what this model leaves out of a measured ``sequential`` call (routing, the count exchange,
the host sync); ``h_index`` the host cost of one more chunk's counting sort before the sync;
``chunk_ms`` and ``interference`` are fitted by :func:`calibrate` from the layer measured at
degrees 2 and 4: overlap is not free, since NCCL's kernels take SMs and memory bandwidth from
the GEMMs they run beside.

The degree is the argmin over the allowed degrees (a brute force over ≤ 16 simulations, done
once per distinct token count and cached by the strategy), except that degree 1 — the point
the model is calibrated best at — is kept unless another degree is predicted faster by more
than max(5%, twice the model's RMS error on its calibration points). PipeMoE's closed-form Theorem 1 on
the α–β lines is reported beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from interlace.config import MoEConfig
from interlace.perf.models import AlphaBeta
from interlace.perf.profile import Profile, load_profile, parse_shape_key, shape_key
from interlace.perf.schedule import DegreeChoice, Op, pipemoe_theorem1, simulate_ops

DEFAULT_DEGREES = (1, 2, 3, 4, 6, 8, 12, 16)
MIN_GAIN = 0.05  # smallest predicted gain over degree 1 that the planner acts on


def _element_size(cfg: MoEConfig) -> int:
    return torch.empty((), dtype=cfg.dtype).element_size()


def _chunks(tokens: int, r: int) -> list[int]:
    from interlace.strategies.pipelined import chunk_sizes

    sizes = chunk_sizes(tokens, r)
    return sizes + [0] * (r - len(sizes))


def pipeline_ops(prof: Profile, cfg: MoEConfig, tokens: int, world: int, r: int) -> list[Op]:
    """The ops the pipelined strategy issues after its host sync, with modelled costs.

    A chunk's device time is never taken below its share of the whole batch's time at the
    measured sustained rate (``max(curve(part), curve(whole)·part/whole)``): short bursts in a
    microbenchmark run at boost clocks that a long pipelined layer does not keep (seen on
    H200: the expert stage measured 672 TFLOP/s at 3.8k rows but 589 at 80k), so splitting
    work cannot make it cheaper in total.
    """
    _, shape = prof.shape(shape_key(cfg, world))
    row_bytes = cfg.hidden * _element_size(cfg)
    bw = prof.copy_gbps * 1e6  # bytes per ms
    h = prof.host_ms
    total_rows = tokens * cfg.top_k
    whole_expert = shape.expert(total_rows) if total_rows else 0.0
    whole_a2a = prof.a2a(total_rows * row_bytes) if total_rows else 0.0

    def expert_ms(rows):
        return max(shape.expert(rows), whole_expert * rows / total_rows) if rows else 0.0

    def a2a_ms(rows):
        return max(prof.a2a(rows * row_bytes), whole_a2a * rows / total_rows) if rows else prof.a2a(0)

    chunks = _chunks(tokens, r)
    ops: list[Op] = []
    for tc in chunks:
        ops.append(Op("prep", "compute", h["prep"], 2 * tc * cfg.top_k * row_bytes / bw))
    dispatch = []
    for tc in chunks:
        ops.append(Op("D", "comm", prof.a2a_host_ms, a2a_ms(tc * cfg.top_k), after=(len(ops) - 1,)))
        dispatch.append(len(ops) - 1)
    combine = []
    for c, tc in enumerate(chunks):
        ops.append(Op("E", "compute", shape.expert_host_ms, expert_ms(tc * cfg.top_k), after=(dispatch[c],)))
        ops.append(Op("C", "comm", prof.a2a_host_ms, a2a_ms(tc * cfg.top_k), after=(len(ops) - 1,)))
        combine.append(len(ops) - 1)
    for c, tc in enumerate(chunks):
        gpu = (tc * cfg.top_k * row_bytes + tc * row_bytes) / bw
        ops.append(Op("K", "compute", h["combine"], gpu, after=(combine[c],)))
    if r > 1:
        ops.append(Op("cat", "compute", 0.01, 2 * tokens * row_bytes / bw))
    return ops


def overlapped_comm_ms(ops: list[Op], r: int) -> float:
    """Device time of the all-to-alls that can overlap compute: all but the first dispatch
    and the last combine (nothing to overlap with at r = 1)."""
    comm = [op.gpu for op in ops if op.stream == "comm"]
    return sum(comm) - comm[0] - comm[-1] if r > 1 and len(comm) >= 2 else 0.0


def model_terms(prof: Profile, cfg: MoEConfig, tokens: int, world: int, r: int) -> tuple[float, float]:
    """(op-level simulated ms, overlappable all-to-all ms) of degree r."""
    ops = pipeline_ops(prof, cfg, tokens, world, r)
    total, _ = simulate_ops(ops)
    return total, overlapped_comm_ms(ops, r)


def predict_layer_ms(prof: Profile, cfg: MoEConfig, tokens: int, world: int, r: int,
                     include_fixed: bool = True) -> float:
    total, overlapped = model_terms(prof, cfg, tokens, world, r)
    if include_fixed:
        _, shape = prof.shape(shape_key(cfg, world))
        # The fixed line is fitted over a few token counts: never let it extrapolate below 0.
        total += max(shape.fixed(tokens * cfg.top_k), 0.0)
        total += (r - 1) * (prof.host_ms["index"] + shape.chunk_ms) + shape.interference * overlapped
    return total


def calibrate(prof: Profile, skey: str) -> None:
    """Fit a shape class's calibration terms from its raw layer timings (in place).

    Degree-1 points give ``fixed`` (α_f + β_f·T, least squares). Higher-degree points give,
    by non-negative least squares on ``measured − model − fixed − (r−1)·h_index =
    (r−1)·chunk_ms + interference·overlapped_comm``, the two remaining terms.
    """
    import numpy as np

    shape = prof.shapes[skey]
    n, k_ffn, e_local, act = parse_shape_key(skey)
    ones = [(T, k, ms) for T, k, r, ms in shape.calibration if r == 1]
    if ones:
        xs, ys = [], []
        for T, k, ms in ones:
            cfg = MoEConfig(hidden=n, ffn=k_ffn, num_experts=e_local * prof.world, top_k=k, activation=act)
            xs.append(T * k)
            ys.append(ms - model_terms(prof, cfg, T, prof.world, 1)[0])
        if len(set(xs)) > 1:
            beta, alpha = np.polyfit(xs, ys, 1)
            shape.fixed = AlphaBeta(float(alpha), float(beta))
        else:
            shape.fixed = AlphaBeta(float(np.mean(ys)), 0.0)
    rows, target = [], []
    for T, k, r, ms in shape.calibration:
        if r == 1:
            continue
        cfg = MoEConfig(hidden=n, ffn=k_ffn, num_experts=e_local * prof.world, top_k=k, activation=act)
        sim, overlapped = model_terms(prof, cfg, T, prof.world, r)
        rows.append([r - 1, overlapped])
        target.append(ms - sim - max(shape.fixed(T * k), 0.0) - (r - 1) * prof.host_ms["index"])
    if rows:
        shape.chunk_ms, shape.interference = _nonneg_lstsq(np.array(rows, dtype=float), np.array(target))
    # How far the calibrated model is from its own calibration points (RMS relative error):
    # the planner only leaves degree 1 for a predicted gain clearly larger than this.
    errors = []
    for T, k, r, ms in shape.calibration:
        cfg = MoEConfig(hidden=n, ffn=k_ffn, num_experts=e_local * prof.world, top_k=k, activation=act)
        errors.append(predict_layer_ms(prof, cfg, T, prof.world, r) / ms - 1)
    shape.model_error = float(np.sqrt(np.mean(np.square(errors)))) if errors else 0.0


def _nonneg_lstsq(A, b) -> tuple[float, float]:
    """Least squares for two non-negative unknowns (tries the free fit, then each alone)."""
    import numpy as np

    best = (0.0, 0.0)
    best_err = float(np.sum(b * b))
    candidates = [np.linalg.lstsq(A, b, rcond=None)[0]]
    for j in range(2):
        col = A[:, j]
        denom = float(col @ col)
        x = [0.0, 0.0]
        x[j] = float(col @ b) / denom if denom > 0 else 0.0
        candidates.append(np.array(x))
    for x in candidates:
        if np.all(x >= 0):
            err = float(np.sum((A @ x - b) ** 2))
            if err < best_err:
                best, best_err = (float(x[0]), float(x[1])), err
    return best


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
    # Degree 1 is the calibrated baseline; leave it only for a predicted gain that beats the
    # model's own error on its calibration points (at least MIN_GAIN).
    margin = max(MIN_GAIN, 2 * shape.model_error)
    if best != 1 and 1 in per and per[best] > per[1] * (1 - margin):
        notes.append(f"r={best} predicted {100 * (1 - per[best] / per[1]):.1f}% faster than r=1, "
                     f"below the {100 * margin:.1f}% margin: keeping r=1")
        best = 1
    n_d = tokens * cfg.top_k * cfg.hidden * _element_size(cfg)  # bytes per rank, each direction
    rows = tokens * cfg.top_k
    th = pipemoe_theorem1(prof.a2a.line.alpha, prof.a2a.line.beta, shape.expert.line.alpha,
                          shape.expert.line.beta, n_d, rows, r_max=max(allowed))
    return PipelinePlan(best, per[best], per, th, prof.key, used, notes)
