"""tierflow.pool.repair: band-lifting moves on a placement (validity, never worse, a
hole that greedy leaves and the repair closes, determinism)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from helpers import placed_problems
from tierflow import pool
from tierflow.pool import Buffer, Problem
from tierflow.pool.greedy import best_fit, size_order
from tierflow.pool.repair import place, repair

# greedy by size puts the 6-unit buffers first; the 4-unit one [3, 8) then rests on
# top of both, and the 5-unit one [6, 7) above it: peak 19 where 15 is live at most
HOLE = Problem(tuple(Buffer(str(i), lo, hi, sz) for i, (lo, hi, sz) in enumerate(
    [(2, 4, 6), (3, 8, 4), (0, 7, 3), (9, 12, 1), (0, 3, 6), (6, 7, 5)])))


def _peak(p: Problem, off: np.ndarray) -> int:
    return int((off + p.units).max()) if len(p) else 0


def test_repair_closes_the_hole_greedy_leaves():
    p = HOLE
    g = best_fit(p.lower, p.upper, p.units, size_order(p))
    assert _peak(p, g) > p.lower_bound  # the premise: greedy misses the bound
    off, facts = repair(p.lower, p.upper, p.units, g, p.lower_bound)
    assert pool.validate(p, off).valid
    assert _peak(p, off) == p.lower_bound
    assert facts["moves"] >= 1 and facts["peaks"][-1] == p.lower_bound


# every heuristic of best misses the bound here (greedy and lowest-first/S: 13, the
# other preorders 15; the bound is 11): with no search nodes only the repair can reach it
NO_NODES = Problem(tuple(Buffer(str(i), lo, hi, sz) for i, (lo, hi, sz) in enumerate(
    [(7, 11, 4), (7, 8, 1), (6, 11, 1), (0, 5, 6), (4, 7, 5), (5, 12, 1), (5, 8, 4)])))


def test_best_returns_the_repaired_peak_when_the_search_cannot_run():
    p = NO_NODES
    s = pool.solve(p, "best", time_limit=600, node_limit=0)
    assert pool.validate(p, s.offsets, s.peak).valid
    assert min(s.meta["heuristics"].values()) > p.lower_bound  # the premise
    assert s.meta["nodes"] == 0
    assert s.meta["found_by"] == "repair" and s.peak == p.lower_bound
    assert s.meta["repair"]["peaks"][-1] == s.peak


@given(placed_problems(30, 25, 10), st.integers(0, 6))
def test_repair_is_valid_never_worse_and_deterministic(case, moves):
    p, start = case
    off, facts = repair(p.lower, p.upper, p.units, start, p.lower_bound, max_moves=moves)
    assert pool.validate(p, off).valid
    assert _peak(p, off) <= _peak(p, start)
    assert facts["moves"] <= moves
    again, _ = repair(p.lower, p.upper, p.units, start, p.lower_bound, max_moves=moves)
    assert np.array_equal(off, again)


def test_place_keeps_fixed_buffers_and_fills_the_tightest_gap():
    lower = np.array([0, 0, 0, 0])
    upper = np.array([4, 4, 4, 4])
    units = np.array([2, 3, 2, 2])
    off = np.array([0, 5, 0, 0])  # 0 at [0, 2), 1 at [5, 8): a 3-unit gap between
    fixed = np.array([True, True, False, False])
    new = place(lower, upper, units, off, fixed, np.array([2, 3]), tight=True)
    assert new[0] == 0 and new[1] == 5
    assert sorted(new[2:].tolist()) == [2, 8]  # the gap holds one, the other goes on top
