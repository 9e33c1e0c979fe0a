"""tierflow.pool.lns: CP-SAT windows on a placement (domains against brute force,
validity, never worse, determinism, and a case only the window step solves)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import placed_problems
from tierflow import pool
from tierflow.pool import Buffer, Problem, best, lns
from tierflow.pool.exact import solve_exact
from tierflow.pool.greedy import best_fit, size_order, solve_greedy
from tierflow.pool.repair import repair

pytest.importorskip("ortools")

# every heuristic of best and the repair end at 17 here, the bound is 13: one window
# (the buffers starting or ending around the one at the peak) reaches it
WINDOW = Problem(tuple(Buffer(str(i), lo, hi, sz) for i, (lo, hi, sz) in enumerate(
    [(10, 16, 6), (8, 11, 2), (5, 8, 6), (6, 11, 5), (0, 6, 6)])))


def _peak(p: Problem, off: np.ndarray) -> int:
    return int((off + p.units).max()) if len(p) else 0


@given(
    st.integers(1, 8),
    st.integers(0, 40),
    st.lists(st.tuples(st.integers(0, 30), st.integers(0, 8)), max_size=6),
)
def test_allowed_offsets_match_brute_force(size, cap, obstacles):
    offs = np.array([o for o, _ in obstacles], dtype=np.int64)
    ends = offs + np.array([h for _, h in obstacles], dtype=np.int64)
    got = {o for a, b in lns.allowed_offsets(size, cap, offs, ends) for o in range(a, b + 1)}
    want = {
        o for o in range(0, cap - size + 1)
        # an empty obstacle occupies no byte
        if all(e == s or not (o < e and o + size > s) for s, e in zip(offs.tolist(), ends.tolist()))
    }
    assert got == want


def test_window_step_reaches_the_bound_the_repair_misses():
    p = WINDOW
    g = best_fit(p.lower, p.upper, p.units, size_order(p))
    r, _ = repair(p.lower, p.upper, p.units, g, p.lower_bound)
    assert _peak(p, r) > p.lower_bound  # the premise: band lifting does not get there
    off, facts = lns.improve(p.lower, p.upper, p.units, g, p.lower_bound)
    assert pool.validate(p, off).valid
    assert _peak(p, off) == p.lower_bound == facts["peak"]
    assert facts["steps"] and facts["steps"][-1][-1] == p.lower_bound


def test_best_uses_the_window_step_when_nothing_else_reaches_the_bound(monkeypatch):
    # best frees windows only on large problems (or where the search gave up): lower
    # the threshold so this five-buffer one takes that path
    monkeypatch.setattr(best, "LNS_MIN_BUFFERS", 0)
    monkeypatch.setattr(best, "LADDER_MAX_BUFFERS", 0)  # the ladder would settle it first
    p = WINDOW
    s = pool.solve(p, "best", time_limit=600, node_limit=0)
    assert pool.validate(p, s.offsets, s.peak).valid
    assert min(s.meta["heuristics"].values()) > p.lower_bound  # the premise
    assert s.meta["found_by"] in ("lns", "repair+lns") and s.peak == p.lower_bound


def test_best_without_ortools_skips_the_window_step(monkeypatch):
    monkeypatch.setattr(best, "LNS_MIN_BUFFERS", 0)
    monkeypatch.setattr(lns, "available", lambda: False)
    p = WINDOW
    s = pool.solve(p, "best", time_limit=600, node_limit=0)
    assert pool.validate(p, s.offsets, s.peak).valid
    assert "lns" not in s.meta and s.peak > p.lower_bound


def test_solve_window_reports_an_impossible_cap():
    p = WINDOW
    g = best_fit(p.lower, p.upper, p.units, size_order(p))
    every = np.arange(len(p))
    new, status = lns.solve_window(p.lower, p.upper, p.units, g, every, p.lower_bound - 1, 1.0, float("inf"))
    assert new is None and status in ("INFEASIBLE", "EMPTY_DOMAIN")


def test_solve_window_with_nothing_free_keeps_the_placement():
    p = WINDOW
    g = best_fit(p.lower, p.upper, p.units, size_order(p))
    none = np.zeros(0, dtype=np.int64)
    peak = _peak(p, g)
    kept, status = lns.solve_window(p.lower, p.upper, p.units, g, none, peak, 1.0, float("inf"))
    assert status == "OPTIMAL" and np.array_equal(kept, g)
    assert lns.solve_window(p.lower, p.upper, p.units, g, none, peak - 1, 1.0, float("inf")) == (None, "INFEASIBLE")


@settings(max_examples=60, deadline=None)
@given(placed_problems(25, 20, 9), st.integers(0, 6))
def test_improve_is_valid_never_worse_and_deterministic(case, steps):
    p, start = case
    off, facts = lns.improve(p.lower, p.upper, p.units, start, p.lower_bound, max_steps=steps)
    assert pool.validate(p, off).valid
    assert p.lower_bound <= _peak(p, off) <= _peak(p, start)
    assert len(facts["steps"]) <= steps
    again, _ = lns.improve(p.lower, p.upper, p.units, start, p.lower_bound, max_steps=steps)
    assert np.array_equal(off, again)


# HiGHS runs in a child process, where OR-Tools is never loaded: the MILP path as it
# runs without the "fast" extra (it once had to, when highspy's HiGHS build and
# OR-Tools' clashed in one process; scipy's HiGHS does not)
HIGHS_CHILD = """
import json, sys
from tierflow.pool import Buffer, Problem
from tierflow.pool.exact import solve_exact
out = []
for bufs in json.load(sys.stdin):
    s = solve_exact(Problem(tuple(Buffer(str(i), *b) for i, b in enumerate(bufs))), 20, backend="highs")
    out.append([s.peak, s.optimal, s.meta.get("backend")])
print(json.dumps(out))
"""


def test_exact_backends_agree_on_the_optimum():
    # small problems where greedy misses the bound (else both return greedy's answer)
    rng = np.random.default_rng(7)
    cases = [[list(b) for b in [(10, 16, 6), (8, 11, 2), (5, 8, 6), (6, 11, 5), (0, 6, 6)]]]
    while len(cases) < 10:
        lo = rng.integers(0, 12, int(rng.integers(5, 9)))
        bufs = [[int(a), int(a + rng.integers(1, 8)), int(rng.integers(1, 7))] for a in lo]
        p = Problem(tuple(Buffer(str(i), *b) for i, b in enumerate(bufs)))
        if solve_greedy(p).peak > p.lower_bound:
            cases.append(bufs)
    child = subprocess.run([sys.executable, "-c", HIGHS_CHILD], input=json.dumps(cases), capture_output=True,
                           text=True, check=True, timeout=300)
    highs = json.loads(child.stdout)
    assert sum(h[0] < solve_greedy(Problem(tuple(Buffer(str(i), *b) for i, b in enumerate(bufs)))).peak
               for bufs, h in zip(cases, highs)) >= 3  # the premise: the MILP beats greedy on several
    for bufs, (h_peak, h_opt, h_backend) in zip(cases, highs):
        p = Problem(tuple(Buffer(str(i), *b) for i, b in enumerate(bufs)))
        c = solve_exact(p, time_limit=20, backend="cpsat")
        assert pool.validate(p, c.offsets, c.peak).valid
        assert p.lower_bound <= c.peak <= solve_greedy(p).peak
        assert c.meta["backend"] == "cpsat" and h_backend in ("highs", None)
        assert c.optimal  # a handful of buffers: CP-SAT proves it at once
        if h_opt:
            assert c.peak == h_peak


def test_exact_rejects_an_unknown_backend():
    with pytest.raises(pool.PoolError, match="unknown backend"):
        solve_exact(WINDOW, backend="gurobi")
