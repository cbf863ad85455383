"""Schedules of the pipelined MoE layer: exact event simulations and PipeMoE's solver.

Notation (PipeMoE §III–IV): r chunks; chunk i has dispatch time t_d⁽ⁱ⁾, expert time t_e⁽ⁱ⁾,
combine time t_c⁽ⁱ⁾. With the α–β models, equal chunks of a layer with n_d dispatched
elements and n_e expert work have ``a = α_a + β_a·n_d/r`` and ``b = α_e + β_e·n_e/r``.

Two schedules:

* :func:`simulate_eqs_9_12` — Eqs. 9–12 exactly as written: dispatches back to back, E_i after
  E_{i−1} and D_i, C_i after E_i and C_{i−1}. Nothing stops a combine from running while a
  later dispatch is on the wire (two independent links). For equal chunks its time is
  ``2a + b + (r−1)·max(a, b)`` (proof: τ_e⁽ⁱ⁾ = a + (i−1)·max(a, b) by induction on Eq. 10,
  then Eq. 11 gives τ_c⁽ʳ⁾ + a = 2a + r·b if b ≥ a, else (r+1)·a + b), which
  :func:`optimal_degree_eqs_9_12` minimises exactly.
* :func:`simulate_shared_link` — one FIFO link carrying D_1..D_r and then C_1..C_r (one NCCL
  communicator; what ``interlace``'s ``pipelined`` strategy does). PipeMoE's case analysis
  (Q1, Q2; f₂, f₃, f₄; Theorem 1) is exact for this schedule, not for Eqs. 9–12 alone: with
  a ≥ b the time is 2r·a (f₂), with b > a it is max(2r·a, 2a + r·b) (f₄ or f₃, split by Q2).
  :func:`pipemoe_theorem1` is Theorem 1 / Algorithm 1 with the convex case solved exactly
  over the integers.

Both solvers are checked against brute force over their simulators in the tests.
:func:`simulate_ops` is the general event simulation (host issue costs, several streams,
cross-stream waits) the run-time planner uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def chunk_sizes(tokens: int, degree: int) -> list[int]:
    """Split ``tokens`` into ``min(degree, tokens)`` near-equal chunks (first ones larger).

    The split the ``pipelined`` and ``tp_ep`` strategies run, and the one the planner models."""
    r = max(1, min(degree, tokens))
    base, extra = divmod(tokens, r)
    return [base + (1 if c < extra else 0) for c in range(r)]


# ----------------------------------------------------------------------------- Eqs. 9–12
def simulate_eqs_9_12(t_d, t_e, t_c) -> float:
    """Completion time of Eqs. 9–12 for per-chunk times (lists of length r); Eq. 12 for r = 1."""
    r = len(t_d)
    if not (len(t_e) == len(t_c) == r) or r == 0:
        raise ValueError("t_d, t_e and t_c need the same positive length")
    tau_d = [0.0] * r
    tau_e = [0.0] * r
    tau_c = [0.0] * r
    for i in range(r):
        tau_d[i] = 0.0 if i == 0 else tau_d[i - 1] + t_d[i - 1]  # Eq. 9
        tau_e[i] = tau_d[0] + t_d[0] if i == 0 else max(tau_e[i - 1] + t_e[i - 1], tau_d[i] + t_d[i])  # Eq. 10
        tau_c[i] = tau_e[0] + t_e[0] if i == 0 else max(tau_e[i] + t_e[i], tau_c[i - 1] + t_c[i - 1])  # Eq. 11
    return tau_c[-1] + t_c[-1] - tau_d[0]  # Eq. 12 (r = 1 gives t_d + t_e + t_c)


def simulate_shared_link(t_d, t_e, t_c) -> float:
    """Eqs. 9–12 plus one FIFO link: C_1 also waits for D_r (the dispatches were queued first)."""
    r = len(t_d)
    if not (len(t_e) == len(t_c) == r) or r == 0:
        raise ValueError("t_d, t_e and t_c need the same positive length")
    link = 0.0
    d_end = []
    for i in range(r):
        link += t_d[i]
        d_end.append(link)
    e_end = []
    t = 0.0
    for i in range(r):
        t = max(t, d_end[i]) + t_e[i]
        e_end.append(t)
    for i in range(r):
        link = max(link, e_end[i]) + t_c[i]
    return link


@dataclass(frozen=True)
class DegreeChoice:
    degree: int
    time: float
    regime: str


def _chunk_times(alpha_a, beta_a, alpha_e, beta_e, n_d, n_e, r):
    return alpha_a + beta_a * n_d / r, alpha_e + beta_e * n_e / r


def _sqrt_ratio(num: float, den: float) -> float:
    """Continuous minimiser sqrt(num/den) of c + den·r + num/r: ∞ without a start-up cost
    (den ≤ 0), 0 when the size term vanishes or has the wrong sign (num ≤ 0)."""
    if den <= 0:
        return math.inf
    return math.sqrt(num / den) if num > 0 else 0.0


def _convex_integer_min(f, r_star: float, feasible: list[int]) -> tuple[int, float] | None:
    """Minimum of a convex f over the feasible integers (a union of runs): per run, the
    continuous minimiser clamped into the run, rounded both ways."""
    if not feasible:
        return None
    runs, start = [], feasible[0]
    for prev, cur in zip(feasible, feasible[1:] + [None]):
        if cur != prev + 1:
            runs.append((start, prev))
            start = cur
    best = None
    for lo, hi in runs:
        c = min(max(r_star, lo), hi) if math.isfinite(r_star) else hi
        for r in {max(lo, min(hi, math.floor(c))), max(lo, min(hi, math.ceil(c)))}:
            v = f(r)
            if best is None or v < best[1] - 1e-15 or (abs(v - best[1]) <= 1e-15 and r < best[0]):
                best = (r, v)
    return best


def optimal_degree_eqs_9_12(alpha_a, beta_a, alpha_e, beta_e, n_d, n_e, r_max: int = 64) -> DegreeChoice:
    """Exact minimiser over r ∈ 1..r_max of Eqs. 9–12 with equal chunks.

    Two regimes: comm-bound chunks (a ≥ b) with ``f_C(r) = (r+1)·a + b`` and compute-bound
    chunks (b > a) with ``f_P(r) = 2a + r·b`` — both convex in r, each on the integers where its
    regime holds.
    """
    def a_b(r):
        return _chunk_times(alpha_a, beta_a, alpha_e, beta_e, n_d, n_e, r)

    def f_comm(r):
        a, b = a_b(r)
        return (r + 1) * a + b

    def f_comp(r):
        a, b = a_b(r)
        return 2 * a + r * b

    best = DegreeChoice(1, 2 * (alpha_a + beta_a * n_d) + alpha_e + beta_e * n_e, "r=1")
    rs = range(2, r_max + 1)
    comm_ok = [r for r in rs if a_b(r)[0] >= a_b(r)[1]]
    comp_ok = [r for r in rs if a_b(r)[1] > a_b(r)[0]]
    r_comm = _sqrt_ratio(beta_a * n_d + beta_e * n_e, alpha_a)
    r_comp = _sqrt_ratio(2 * beta_a * n_d, alpha_e)
    for name, f, r_star, ok in (("comm-bound", f_comm, r_comm, comm_ok), ("compute-bound", f_comp, r_comp, comp_ok)):
        found = _convex_integer_min(f, r_star, ok)
        if found and found[1] < best.time - 1e-15:
            best = DegreeChoice(found[0], found[1], name)
    return best


def pipemoe_theorem1(alpha_a, beta_a, alpha_e, beta_e, n_d, n_e, r_max: int = 64) -> DegreeChoice:
    """PipeMoE's Theorem 1 / Algorithm 1 over r ∈ 1..r_max (exact for :func:`simulate_shared_link`).

    t₁ = 2(α_a + β_a·n_d) + α_e + β_e·n_e (Eq. 19);
    Q1 (a ≥ b): f₂(r) = 2r·α_a + 2β_a·n_d, increasing, so the smallest r where Q1 holds (Eq. 28);
    ¬Q1 ∧ Q2: f₃(r) = 2α_a + β_e·n_e + 2β_a·n_d/r + α_e·r, convex (Eqs. 34–37), minimised over
    the integers satisfying (35) and (36) — the feasible set of (36) is quadratic in r and can
    be a union of runs, each handled by :func:`_convex_integer_min`;
    ¬Q1 ∧ ¬Q2: f₄(r) = 2α_a·r + 2β_a·n_d, increasing, so the smallest feasible r (Eqs. 41–44).
    """
    def a_b(r):
        return _chunk_times(alpha_a, beta_a, alpha_e, beta_e, n_d, n_e, r)

    def q1(r):
        a, b = a_b(r)
        return a >= b

    def q2(r):
        a, b = a_b(r)
        return 2 * (r - 1) * a < r * b  # Eq. 30

    def f2(r):
        return 2 * r * alpha_a + 2 * n_d * beta_a

    def f3(r):
        return 2 * alpha_a + beta_e * n_e + 2 * beta_a * n_d / r + alpha_e * r

    best = DegreeChoice(1, 2 * (alpha_a + beta_a * n_d) + alpha_e + beta_e * n_e, "r=1")
    rs = list(range(2, r_max + 1))
    candidates = []
    ok2 = [r for r in rs if q1(r)]
    if ok2:
        candidates.append((ok2[0], f2(ok2[0]), "Q1: comm hides compute (f2)"))
    ok3 = [r for r in rs if not q1(r) and q2(r)]
    r3 = _sqrt_ratio(2 * beta_a * n_d, alpha_e)
    found = _convex_integer_min(f3, r3, ok3)
    if found:
        candidates.append((found[0], found[1], "not Q1, Q2: compute-bound (f3)"))
    ok4 = [r for r in rs if not q1(r) and not q2(r)]
    if ok4:
        candidates.append((ok4[0], f2(ok4[0]), "not Q1, not Q2: comm-bound (f4)"))
    for r, t, name in candidates:
        if t < best.time - 1e-15:
            best = DegreeChoice(r, t, name)
    return best


# ----------------------------------------------------------------------------- op-level
@dataclass
class Op:
    """One GPU operation issued by the host.

    ``stream`` names the FIFO queue it runs on; ``host`` is the host time to issue it;
    ``gpu`` its device time; ``after`` lists ops (indices) it must wait for besides its
    stream predecessor (a cross-stream wait or an implicit NCCL dependency).
    """

    name: str
    stream: str
    host: float
    gpu: float
    after: tuple[int, ...] = ()


def simulate_ops(ops: list[Op], start: float = 0.0) -> tuple[float, list[float]]:
    """Event simulation: the host issues ops in order (each costs ``host``); an op starts
    when issued, when its stream is free and when its ``after`` ops are done.

    Returns (time when everything is done, end time of every op).
    """
    host_t = start
    stream_free: dict[str, float] = {}
    ends: list[float] = []
    for op in ops:
        host_t += op.host
        begin = max(host_t, stream_free.get(op.stream, start), *(ends[j] for j in op.after)) if op.after else \
            max(host_t, stream_free.get(op.stream, start))
        end = begin + op.gpu
        stream_free[op.stream] = end
        ends.append(end)
    return max([host_t] + ends), ends
