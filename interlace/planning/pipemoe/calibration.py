"""Fitting the pipelined planner's terms from a profile's raw layer timings.

Per shape class, :func:`calibrate` finds ``chunk_host_ms`` (the host time the strategy's own
Python spends per chunk; it differs by shape class) by a 1-D search, then the other terms of
:mod:`interlace.planning.pipemoe.degree`'s formula per mode by (non-negative) least squares on
relative errors, and keeps what they still miss at every raw point as residual ratios. Without
forward + backward points a shape class predicts ``fwdbwd`` with its forward terms.

:func:`merge_points` pools the raw points of several profiles of one machine kind and refits:
layer timings drift between phases of a job and between machine leases, and pooled points
average that out.
"""

from __future__ import annotations

import itertools

import numpy as np

from interlace.config import MoEConfig
from interlace.planning.pipemoe.degree import calibrated_ms, model_terms
from interlace.planning.profile import MODES, Calibration, Profile, parse_shape_key

HOST_GRID_MS = tuple(0.1 * i for i in range(21))  # coarse candidates for Profile.chunk_host_ms (refined ±0.1)


def _nonneg_lstsq(A, b) -> np.ndarray:
    """Least squares with non-negative unknowns, by trying every subset of free columns
    (A has at most a few columns)."""
    A = np.asarray(A, dtype=float)
    b = np.asarray(b, dtype=float)
    n = A.shape[1]
    best, best_err = np.zeros(n), float(b @ b)
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            x_sub = np.linalg.lstsq(A[:, cols], b, rcond=None)[0]
            if np.any(x_sub < 0):
                continue
            x = np.zeros(n)
            x[list(cols)] = x_sub
            err = float(np.sum((A @ x - b) ** 2))
            if err < best_err - 1e-15:
                best, best_err = x, err
    return best


def _shape_cfg(prof: Profile, skey: str, top_k: int) -> MoEConfig:
    n, k_ffn, e_local, act = parse_shape_key(skey)
    return MoEConfig(hidden=n, ffn=k_ffn, num_experts=e_local * prof.world, top_k=top_k, activation=act)


def _fit_terms(prof: Profile, skey: str, points, mode: str, host_extra: float) -> tuple[Calibration, list[float]]:
    """Calibration terms of one shape class and mode from its raw points ``(T, k, r, ms)``,
    and the relative errors of the calibrated model on them."""
    h_index = prof.host_ms["index"]
    sims = {}
    for T, k, r, _ in points:
        sims[(T, k, r)] = model_terms(prof, _shape_cfg(prof, skey, k), T, prof.world, r, mode, host_extra)
    cal = Calibration()
    ones = [(T * k, ms - sims[(T, k, r)][0]) for T, k, r, ms in points if r == 1]
    if ones:
        xs = np.array([x for x, _ in ones], dtype=float)
        ys = np.array([y for _, y in ones], dtype=float)
        if len(set(xs.tolist())) > 1:
            beta, alpha = np.polyfit(xs, ys, 1)
            cal.fixed = type(cal.fixed)(float(alpha), float(beta))
        else:
            cal.fixed = type(cal.fixed)(float(ys.mean()), 0.0)
    rows, target = [], []
    for T, k, r, ms in points:
        if r == 1:
            continue
        sim, overlapped = sims[(T, k, r)]
        w = 1.0 / ms  # relative errors: small layers count as much as large ones
        rows.append([w, (r - 1) * w, overlapped * w])
        target.append((ms - sim - max(cal.fixed(T * k), 0.0) - (r - 1) * h_index) * w)
    if rows:
        cal.pipe_ms, cal.chunk_ms, cal.interference = (float(v) for v in _nonneg_lstsq(rows, target))
    errors = [calibrated_ms(cal, *sims[(T, k, r)], T * k, r, h_index) / ms - 1 for T, k, r, ms in points]
    cal.model_error = float(np.sqrt(np.mean(np.square(errors)))) if errors else 0.0
    return cal, errors


def calibrate(prof: Profile, skey: str, host_grid=HOST_GRID_MS) -> None:
    """Fit one shape class's terms from its raw points, in place: its per-chunk host cost by
    a 1-D search (coarse ``host_grid``, then refined: the value whose least-squares fits leave
    the smallest squared relative error over both modes' points), then each mode's terms."""
    shape = prof.shapes[skey]
    modes = [m for m in MODES if shape.points(m)]

    def total_error(h):
        return sum(float(np.sum(np.square(_fit_terms(prof, skey, shape.points(m), m, h)[1]))) for m in modes)

    if any(r > 1 for m in modes for _, _, r, _ in shape.points(m)):
        coarse = min(host_grid, key=total_error)
        step = min((abs(a - b) for a, b in zip(host_grid, host_grid[1:])), default=0.0) / 5
        fine = [max(0.0, coarse + step * i) for i in range(-4, 5)] if step > 0 else [coarse]
        shape.chunk_host_ms = float(min(fine, key=total_error))
    shape.residuals = {}
    for mode in modes:
        cal, errors = _fit_terms(prof, skey, shape.points(mode), mode, shape.chunk_host_ms or 0.0)
        shape.set_terms(mode, cal)
        # What the fitted terms still miss at each raw point, for residual_ratio to interpolate.
        shape.residuals[mode] = [[T * k, r, 1.0 / (1.0 + e)] for (T, k, r, _), e in zip(shape.points(mode), errors)]


def calibrate_profile(prof: Profile, host_grid=HOST_GRID_MS) -> None:
    """Calibrate every shape class from the profile's own raw points (:func:`calibrate`);
    ``Profile.chunk_host_ms`` becomes the median of the classes' host costs (the value for a
    class without pipelined points)."""
    hosts = []
    for skey in prof.shapes:
        calibrate(prof, skey, host_grid)
        if prof.shapes[skey].chunk_host_ms is not None:
            hosts.append(prof.shapes[skey].chunk_host_ms)
    if hosts:
        prof.chunk_host_ms = float(np.median(hosts))


def merge_points(prof: Profile, others: list[Profile]) -> Profile:
    """Add the raw layer timings of ``others`` (earlier runs on the same machine kind) to the
    shape classes ``prof`` has, in place, and refit (the curves stay ``prof``'s own).

    Why: a profile's layer timings drift between phases of a job and between machine leases
    (host-bound points most), and each profile's calibration then carries its own lease's
    bias. Points pooled over several runs average that out.
    """
    merged = []
    for other in others:
        if other.key != prof.key:
            raise ValueError(f"cannot merge profile {other.key} into {prof.key}: another machine or world size")
        for skey, shape in prof.shapes.items():
            if skey in other.shapes:
                shape.calibration = list(shape.calibration) + list(other.shapes[skey].calibration)
                shape.calibration_fwdbwd = list(shape.calibration_fwdbwd) + list(other.shapes[skey].calibration_fwdbwd)
        merged.append(other.meta.get("created", "?"))
    prof.meta["merged_points_from"] = prof.meta.get("merged_points_from", []) + merged
    calibrate_profile(prof)
    return prof
