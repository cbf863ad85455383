"""Run-time choice of the pipeline degree from a stored profile.

The layer time for degree r, forward (``mode="fwd"``) or forward + backward (``"fwdbwd"``), is

    simulate_ops(ops of the r-chunk pipeline, each with host issue cost and device time)
        + fixed(T·k) + (r − 1)·h_index
        + [r > 1]·(pipe_ms + (r − 1)·chunk_ms + interference · overlapped all-to-all time)

* The op list mirrors what the strategy issues after its host sync. Forward, per chunk: a
  dispatch gather, the dispatch all-to-all (all queued first), the expert stage, the combine
  all-to-all and the weighted combine. Backward is the mirror image: combine backward, the
  output-gradient all-to-alls, each chunk's expert backward (twice the forward's GEMM work,
  plus, for r > 1, the fp32 accumulation of that chunk's weight gradients: 10 bytes per
  expert parameter), the input-gradient all-to-all and the dispatch backward. Device times come
  from the profile's curves (all-to-all: bytes per rank; expert stage: rows; gathers and
  accumulation: bytes over the measured copy bandwidth). Host costs are the measured op costs
  plus the shape class's ``chunk_host_ms``, the host time the strategy's own Python spends per
  chunk (autograd functions, NCCL wrappers, stream waits), which no op microbenchmark sees. It sits
  inside the simulation, so it is hidden while the GPU is busy and is the whole cost when the
  layer is host-bound; a fixed per-chunk term fitted at one size is wrong at another.
* ``fixed`` is a line over dispatched rows fitted on degree-1 points: what the op model leaves
  out of a ``sequential`` call (routing, count exchange, host sync). ``pipe_ms`` is the fixed
  extra of the pipelined code path over ``sequential``'s (r = 1 *is* ``sequential``: a
  different code path, not one chunk of the pipelined one); ``chunk_ms`` what each extra
  chunk costs on the device beyond the model; ``interference`` the fraction of the overlapped
  all-to-all time the compute it overlaps loses (NCCL kernels take SMs and memory bandwidth).

The fitted terms come from the profile's own raw calibration points
(:mod:`interlace.planning.pipemoe.calibration`). What they still miss at each raw point
(measured / modelled) is kept per mode and interpolated at prediction time
(:func:`residual_ratio`: linear in log rows, then in log r, flat outside the calibrated range),
so the calibrated model reproduces its own points and bends between them the way the
measurements do; far from every point it is the fitted form.

The degree is the argmin over the allowed degrees (≤ 16 simulations, done once per distinct
token count and mode and cached by the strategy), except that degree 1 — the point the
model is calibrated best at — is kept unless another degree is predicted faster by more than
max(5%, twice the model's RMS error on its calibration points). PipeMoE's closed-form Theorem 1
on the α–β lines is reported beside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from interlace.config import MoEConfig
from interlace.planning.pipemoe.models import interp_log_rows
from interlace.planning.pipemoe.schedule import DegreeChoice, Op, chunk_sizes, pipemoe_theorem1, simulate_ops
from interlace.planning.profile import MODES, Calibration, Profile, as_profile, shape_key

DEFAULT_DEGREES = (1, 2, 3, 4, 6, 8, 12, 16)
MIN_GAIN = 0.05  # smallest predicted gain over degree 1 that the planner acts on


def _element_size(cfg: MoEConfig) -> int:
    return torch.empty((), dtype=cfg.dtype).element_size()


def _chunks(tokens: int, r: int) -> list[int]:
    sizes = chunk_sizes(tokens, r)
    return sizes + [0] * (r - len(sizes))


def expert_params(cfg: MoEConfig, world: int) -> int:
    """Expert weights held by one rank: up (N × K, ×2 for SwiGLU's gate) and down (K × N)."""
    up = 2 * cfg.ffn if cfg.activation == "swiglu" else cfg.ffn
    return (cfg.num_experts // world) * cfg.hidden * (up + cfg.ffn)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def pipeline_ops(prof: Profile, cfg: MoEConfig, tokens: int, world: int, r: int, mode: str = "fwd",
                 host_extra: float | None = None) -> list[Op]:
    """The ops the layer issues after its host sync (forward, then backward for ``"fwdbwd"``).

    A chunk's device time is never taken below its share of the whole batch's time at the
    measured sustained rate (``max(curve(part), curve(whole)·part/whole)``): short bursts in a
    microbenchmark run at boost clocks that a long pipelined layer does not keep (measured on
    H200: ``docs/performance.md``), so splitting work cannot make it cheaper in total.
    """
    _check_mode(mode)
    _, shape = prof.shape(shape_key(cfg, world))
    row_bytes = cfg.hidden * _element_size(cfg)
    bw = prof.copy_gbps * 1e6  # bytes per ms
    h = prof.host_ms
    if host_extra is None:
        host_extra = shape.chunk_host_ms if shape.chunk_host_ms is not None else prof.chunk_host_ms
    extra = host_extra if r > 1 else 0.0
    total_rows = tokens * cfg.top_k
    whole_expert = shape.expert(total_rows) if total_rows else 0.0
    whole_a2a = prof.a2a(total_rows * row_bytes) if total_rows else 0.0

    def expert_ms(rows):
        return max(shape.expert(rows), whole_expert * rows / total_rows) if rows else 0.0

    def a2a_ms(rows):
        return max(prof.a2a(rows * row_bytes), whole_a2a * rows / total_rows) if rows else prof.a2a(0)

    chunks = _chunks(tokens, r)
    ops: list[Op] = []

    def add(*args, **kw) -> int:
        ops.append(Op(*args, **kw))
        return len(ops) - 1

    # Forward: dispatch gathers, all dispatches queued, then per chunk experts → combine.
    for tc in chunks:
        add("prep", "compute", h["prep"], 2 * tc * cfg.top_k * row_bytes / bw)
    dispatch = [add("D", "comm", prof.a2a_host_ms, a2a_ms(tc * cfg.top_k), after=(len(ops) - 1,)) for tc in chunks]
    combine = []
    for c, tc in enumerate(chunks):
        e = add("E", "compute", shape.expert_host_ms + extra, expert_ms(tc * cfg.top_k), after=(dispatch[c],))
        combine.append(add("C", "comm", prof.a2a_host_ms, a2a_ms(tc * cfg.top_k), after=(e,)))
    for c, tc in enumerate(chunks):
        add("K", "compute", h["combine"], (tc * cfg.top_k + tc) * row_bytes / bw, after=(combine[c],))
    if r > 1:
        add("cat", "compute", 0.01, 2 * tokens * row_bytes / bw)
    if mode == "fwd":
        return ops
    # Backward, the mirror image: all output-gradient all-to-alls queued at once, each chunk's
    # expert backward as its gradient arrives, its input-gradient all-to-all as soon as done.
    accumulate = 10 * expert_params(cfg, world) / bw if r > 1 else 0.0  # bf16 grad + fp32 read/write
    kb = [add("Kb", "compute", h["combine"], (tc + 2 * tc * cfg.top_k) * row_bytes / bw) for tc in chunks]
    grads = [add("Cb", "comm", prof.a2a_host_ms, a2a_ms(tc * cfg.top_k), after=(kb[-1],)) for tc in chunks]
    back = []
    for c, tc in enumerate(chunks):
        rows = tc * cfg.top_k
        e = add("Eb", "compute", shape.expert_host_ms + extra,
                2 * expert_ms(rows) + 2 * rows * row_bytes / bw + (accumulate if rows else 0.0), after=(grads[c],))
        back.append(add("Db", "comm", prof.a2a_host_ms, a2a_ms(rows), after=(e,)))
    if r > 1:
        add("convert", "compute", 0.02, 10 * expert_params(cfg, world) / bw)  # zero-fill + fp32 → bf16
    for c, tc in enumerate(chunks):
        add("Pb", "compute", h["combine"], (tc * cfg.top_k + tc) * row_bytes / bw, after=(back[c],))
    return ops


def overlapped_comm_ms(ops: list[Op], r: int) -> float:
    """Device time of the all-to-alls that can overlap compute: per pass, all but the first
    and the last (nothing to overlap with at r = 1)."""
    if r <= 1:
        return 0.0
    total = 0.0
    for names in (("D", "C"), ("Cb", "Db")):
        comm = [op.gpu for op in ops if op.name in names]
        if len(comm) >= 2:
            total += sum(comm) - comm[0] - comm[-1]
    return total


def model_terms(prof: Profile, cfg: MoEConfig, tokens: int, world: int, r: int, mode: str = "fwd",
                host_extra: float | None = None) -> tuple[float, float]:
    """(op-level simulated ms, overlappable all-to-all ms) of degree r."""
    ops = pipeline_ops(prof, cfg, tokens, world, r, mode, host_extra)
    total, _ = simulate_ops(ops)
    return total, overlapped_comm_ms(ops, r)


def calibrated_ms(cal: Calibration, sim: float, overlapped: float, rows: int, r: int, h_index: float) -> float:
    """The op-level simulation ``sim`` plus the fitted terms ``cal`` (the formula above)."""
    # The fixed line is fitted over a few token counts: never let it extrapolate below 0.
    total = sim + max(cal.fixed(rows), 0.0) + (r - 1) * h_index
    if r > 1:
        total += cal.pipe_ms + (r - 1) * cal.chunk_ms + cal.interference * overlapped
    return total


def residual_ratio(shape, mode: str, rows: int, r: int) -> float:
    """Measured/modelled ratio of the calibrated model at ``rows`` dispatched rows and degree
    r, interpolated from its raw calibration points (``ShapeProfile.residuals``): piecewise
    linear in log(rows) within a calibrated degree, then linear in log(r) between the
    calibrated degrees around r; held flat beyond the outermost points. 1 where the shape
    class has no residuals for ``mode`` (older profiles)."""
    pts = shape.residuals.get(mode) if shape.residuals else None
    if not pts or rows <= 0:
        return 1.0
    by_degree: dict[int, list[tuple[float, float]]] = {}
    for x, d, q in pts:
        by_degree.setdefault(int(d), []).append((x, q))

    def at(d: int) -> float:
        return interp_log_rows(by_degree[d], rows)

    if r in by_degree:
        return at(r)
    lower = [d for d in by_degree if d < r]
    upper = [d for d in by_degree if d > r]
    if not lower or not upper:
        return at(max(lower) if lower else min(upper))
    a, b = max(lower), min(upper)
    w = (math.log(r) - math.log(a)) / (math.log(b) - math.log(a))
    return (1 - w) * at(a) + w * at(b)


def fused_speedup(shape, rows: int, mode: str = "fwd") -> float | None:
    """Measured sequential / fused time at ``rows`` dispatched rows (T·k), from the shape
    class's raw pairs (``"fwd"``: ``fused`` forwards, ``ShapeProfile.fused``; ``"fwdbwd"``:
    ``fused:train`` forward + backward, ``ShapeProfile.fused_train``): piecewise linear in
    log(rows), held flat beyond the outermost pairs, repeats averaged. None without pairs
    (older profiles)."""
    pairs = shape.fused_pairs(mode)
    if not pairs:
        return None
    return interp_log_rows([(t * k, seq / fused) for t, k, fused, seq in pairs], rows)


def predict_layer_ms(prof: Profile, cfg: MoEConfig, tokens: int, world: int, r: int,
                     include_fixed: bool = True, mode: str = "fwd", corrected: bool = True) -> float:
    """Predicted ms of one layer call at degree r (``"fwdbwd"``: forward + backward).

    ``include_fixed=False``: the op-level simulation alone; ``corrected=False``: without the
    residual correction interpolated from the calibration points (:func:`residual_ratio`).
    """
    sim, overlapped = model_terms(prof, cfg, tokens, world, r, mode)
    if not include_fixed:
        return sim
    _, shape = prof.shape(shape_key(cfg, world))
    rows = tokens * cfg.top_k
    total = calibrated_ms(shape.terms(mode), sim, overlapped, rows, r, prof.host_ms["index"])
    return total * residual_ratio(shape, mode, rows, r) if corrected else total


@dataclass
class PipelinePlan:
    degree: int
    predicted_ms: float
    per_degree_ms: dict[int, float]
    theorem1: DegreeChoice
    profile_key: str
    shape_used: str
    notes: list[str] = field(default_factory=list)
    mode: str = "fwd"


def choose_degree(cfg: MoEConfig, tokens: int, world: int, profile: Profile | str | None = None,
                  max_degree: int = 16, degrees=DEFAULT_DEGREES, mode: str = "fwd") -> PipelinePlan:
    """The predicted-fastest pipeline degree for ``tokens`` tokens per rank, for a forward
    call (``mode="fwd"``) or a training step's forward + backward (``"fwdbwd"``).

    Raises FileNotFoundError if no profile is stored for this machine.
    """
    _check_mode(mode)
    prof = as_profile(profile, world)
    skey = shape_key(cfg, world)
    used, shape = prof.shape(skey)
    notes = [] if used == skey else [f"shape class {skey} not profiled; using nearest {used}"]
    if mode == "fwdbwd" and not shape.points("fwdbwd"):
        notes.append("no forward+backward calibration points: backward uses the forward's terms")
    allowed = [r for r in degrees if r <= max_degree] or [1]
    per = {r: predict_layer_ms(prof, cfg, tokens, world, r, mode=mode) for r in allowed}
    best = min(per, key=lambda r: (per[r], r))
    # Degree 1 is the calibrated baseline; leave it only for a predicted gain that beats the
    # model's own error on its calibration points (at least MIN_GAIN).
    margin = max(MIN_GAIN, 2 * shape.terms(mode).model_error)
    if best != 1 and 1 in per and per[best] > per[1] * (1 - margin):
        notes.append(f"r={best} predicted {100 * (1 - per[best] / per[1]):.1f}% faster than r=1, "
                     f"below the {100 * margin:.1f}% margin: keeping r=1")
        best = 1
    n_d = tokens * cfg.top_k * cfg.hidden * _element_size(cfg)  # bytes per rank, each direction
    rows = tokens * cfg.top_k
    th = pipemoe_theorem1(prof.a2a.line.alpha, prof.a2a.line.beta, shape.expert.line.alpha,
                          shape.expert.line.beta, n_d, rows, r_max=max(allowed))
    return PipelinePlan(best, per[best], per, th, prof.key, used, notes, mode)
