"""Performance models and pipeline-degree solvers (pure CPU, no torch distributed)."""

import math
import random

import numpy as np
import pytest

from interlace.planning.pipemoe.models import SizeCurve, fit_alpha_beta
from interlace.planning.pipemoe.schedule import (
    Op,
    optimal_degree_eqs_9_12,
    pipemoe_theorem1,
    simulate_eqs_9_12,
    simulate_ops,
    simulate_shared_link,
)


def brute(sim, aa, ba, ae, be, nd, ne, r_max):
    best = None
    for r in range(1, r_max + 1):
        a, b = aa + ba * nd / r, ae + be * ne / r
        t = sim([a] * r, [b] * r, [a] * r)
        if best is None or t < best[1] - 1e-12:
            best = (r, t)
    return best


def random_params(rng):
    # Span comm-bound, compute-bound and balanced layers, with tiny and large start-up costs.
    aa = 10 ** rng.uniform(-3, -0.5)
    ae = 10 ** rng.uniform(-3, -0.5)
    nd = 10 ** rng.uniform(4, 9)
    ne = 10 ** rng.uniform(8, 13)
    ba = 10 ** rng.uniform(-1, 1) / nd  # β_a·n_d between 0.1 and 10 ms
    be = 10 ** rng.uniform(-1, 1) / ne
    return aa, ba, ae, be, nd, ne


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("solver,simulator", [(optimal_degree_eqs_9_12, simulate_eqs_9_12),
                                              (pipemoe_theorem1, simulate_shared_link)],
                         ids=["exact-eqs-9-12", "pipemoe-theorem1-shared-link"])
def test_solver_matches_brute_force_over_its_simulator(seed, solver, simulator):
    rng = random.Random(seed)
    for _ in range(500):
        p = random_params(rng)
        r_max = rng.choice([1, 2, 5, 16, 64])
        choice = solver(*p, r_max=r_max)
        r_b, t_b = brute(simulator, *p, r_max)
        assert math.isclose(choice.time, t_b, rel_tol=1e-9), (p, choice, r_b, t_b)
        r = choice.degree
        a, b = p[0] + p[1] * p[4] / r, p[2] + p[3] * p[5] / r
        assert math.isclose(simulator([a] * r, [b] * r, [a] * r), choice.time, rel_tol=1e-9)


def test_closed_form_of_eqs_9_12():
    for a, b, r in [(1.0, 2.0, 4), (2.0, 1.0, 4), (1.0, 1.0, 3), (0.5, 3.0, 1)]:
        assert math.isclose(simulate_eqs_9_12([a] * r, [b] * r, [a] * r), 2 * a + b + (r - 1) * max(a, b))


def test_simulators_on_uneven_chunks_and_regimes():
    # Unequal chunk times: the recurrences, by hand.
    assert simulate_eqs_9_12([1, 2], [3, 1], [1, 1]) == 6.0  # D:0-1,1-3  E:1-4,4-5  C:4-5,5-6
    assert simulate_shared_link([1, 2], [3, 1], [1, 1]) == 6.0
    assert simulate_shared_link([2, 2], [1, 1], [2, 2]) == 8.0  # comm-bound: 2·r·a
    assert simulate_eqs_9_12([2, 2], [1, 1], [2, 2]) == 7.0  # (r+1)·a + b


def test_alpha_beta_fit_recovers_parameters_from_noisy_data():
    rng = np.random.default_rng(0)
    for alpha, beta in [(0.03, 2e-6), (0.5, 2e-8), (0.0, 3e-4)]:
        xs = np.geomspace(1e3, 1e8, 25) if beta < 1e-5 else np.geomspace(10, 1e4, 25)
        ts = (alpha + beta * xs) * (1 + rng.normal(0, 0.02, xs.size))
        fit = fit_alpha_beta(xs, ts)
        assert fit.beta == pytest.approx(beta, rel=0.05)
        assert fit.alpha == pytest.approx(alpha, rel=0.1, abs=2e-3 * max(alpha, 0.01))
        assert fit.r2 > 0.99


def test_fit_and_solvers_survive_noise_that_slopes_downwards():
    fit = fit_alpha_beta([1e3, 1e4, 1e5], [0.30, 0.25, 0.20])
    assert fit.beta == 0.0 and 0.2 < fit.alpha < 0.3
    for solver in (optimal_degree_eqs_9_12, pipemoe_theorem1):
        for params in [(0.01, -1e-9, 0.02, 1e-12, 1e6, 1e10), (0.01, 1e-9, 0.02, -1e-12, 1e6, 1e10),
                       (0.0, 1e-9, 0.0, 1e-12, 1e6, 1e10)]:
            choice = solver(*params, r_max=16)
            assert 1 <= choice.degree <= 16 and math.isfinite(choice.time)


def test_size_curve_interpolates_measurements_and_extrapolates_with_the_line():
    sizes = [1e3, 1e4, 1e5, 1e6]
    times = [0.02, 0.025, 0.06, 0.45]
    curve = SizeCurve(sizes, times)
    for s, t in zip(sizes, times):
        assert curve(s) == pytest.approx(t, rel=1e-9) or s in (sizes[0], sizes[-1])
    assert times[1] < curve(3e4) < times[2]
    # Above the measured range: the sustained rate of the largest size, not the line.
    assert curve(1e7) == pytest.approx(0.45 * 10)
    assert curve(1e2) == pytest.approx(max(curve.line(1e2), 0.0))
    assert SizeCurve.from_json(curve.to_json())(5e4) == pytest.approx(curve(5e4))


def test_simulate_ops_host_bound_and_cross_stream_waits():
    ops = [Op("a", "compute", host=1.0, gpu=0.5), Op("b", "comm", host=1.0, gpu=3.0, after=(0,)),
           Op("c", "compute", host=0.1, gpu=1.0, after=(1,))]
    total, ends = simulate_ops(ops)
    assert ends == [1.5, 5.0, 6.0] and total == 6.0
    # Host-bound: tiny GPU work finishes when the host has issued it.
    total, _ = simulate_ops([Op("x", "compute", host=1.0, gpu=0.01)] * 5)
    assert total == pytest.approx(5.01)
