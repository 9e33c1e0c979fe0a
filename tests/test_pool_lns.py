"""tierflow.pool.lns: CP-SAT windows on a placement (domains against brute force,
validity, never worse, determinism, and a case only the window step solves)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierflow import pool
from tierflow.pool import Buffer, Problem, lns
from tierflow.pool.greedy import best_fit, size_order
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


def test_best_uses_the_window_step_when_nothing_else_reaches_the_bound():
    p = WINDOW
    s = pool.solve(p, "best", time_limit=600, node_limit=0)
    assert pool.validate(p, s.offsets, s.peak).valid
    assert min(s.meta["heuristics"].values()) > p.lower_bound  # the premise
    assert s.meta["found_by"] in ("lns", "repair+lns") and s.peak == p.lower_bound


def test_best_without_ortools_skips_the_window_step(monkeypatch):
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


@st.composite
def placed(draw):
    n = draw(st.integers(1, 25))
    bufs = []
    for i in range(n):
        lo = draw(st.integers(0, 20))
        bufs.append(Buffer(str(i), lo, lo + draw(st.integers(1, 9)), draw(st.integers(0, 9))))
    p = Problem(tuple(bufs))
    order = np.array(draw(st.permutations(range(n))), dtype=np.int64)
    return p, best_fit(p.lower, p.upper, p.units, order)


@settings(max_examples=60, deadline=None)
@given(placed(), st.integers(0, 6))
def test_improve_is_valid_never_worse_and_deterministic(case, steps):
    p, start = case
    off, facts = lns.improve(p.lower, p.upper, p.units, start, p.lower_bound, max_steps=steps)
    assert pool.validate(p, off).valid
    assert p.lower_bound <= _peak(p, off) <= _peak(p, start)
    assert len(facts["steps"]) <= steps
    again, _ = lns.improve(p.lower, p.upper, p.units, start, p.lower_bound, max_steps=steps)
    assert np.array_equal(off, again)
