"""tierflow.pool.ladder, decide and skyline: valid answers, never worse than the start,
and proofs that hold (checked against an exhaustive search on small problems)."""

from __future__ import annotations

import argparse
import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierflow import pool
from tierflow.pool import Buffer, Problem, generate
from tierflow.pool.decide import FEASIBLE, INFEASIBLE, Variant, bottom_up_order, decide_cpsat
from tierflow.pool.greedy import best_fit
from tierflow.pool.ladder import ladder
from tierflow.pool.reduce import reduce
from tierflow.pool.skyline import orders, skyline

pytest.importorskip("ortools")

# CP-SAT deterministic time for a whole ladder in these tests: small problems settle in
# far less, and the bound keeps every run the same on a loaded machine
DET = 0.05


@st.composite
def small_problems(draw, max_n: int = 6):
    n = draw(st.integers(1, max_n))
    scale = draw(st.sampled_from([1, 1024]))
    bufs = []
    for i in range(n):
        lo = draw(st.integers(0, 8))
        bufs.append(Buffer(str(i), lo, lo + draw(st.integers(1, 6)), draw(st.integers(1, 9)) * scale))
    return Problem(tuple(bufs))


def brute_optimum(p: Problem) -> int:
    """The minimal peak by trying every order and placing each buffer at its lowest
    free offset: sorting an optimal placement by offset gives an order that this
    first-fit reproduces no higher, so the minimum over orders is the optimum."""
    best = None
    for order in itertools.permutations(range(len(p))):
        placed: list[tuple[int, int]] = []  # (index, offset)
        for i in order:
            b = p.buffers[i]
            busy = sorted((o, o + p.buffers[j].size) for j, o in placed
                          if p.buffers[j].lower < b.upper and b.lower < p.buffers[j].upper)
            off = 0
            for lo, hi in busy:
                if off + b.size <= lo:
                    break
                off = max(off, hi)
            placed.append((i, off))
        peak = max(o + p.buffers[i].size for i, o in placed)
        best = peak if best is None else min(best, peak)
    return best


def greedy_start(red):
    return best_fit(red.lower, red.upper, red.size, np.lexsort((np.arange(len(red)), red.lower, -red.size)))


def check_decision_against_the_optimum(p, red, delta: int, variant: Variant) -> None:
    """Decide ``red`` at its exhaustive optimum's capacity shifted by ``delta`` with
    ``variant``: a placement must be valid and under the cap, a refusal must be true."""
    opt = brute_optimum(p)
    if not len(red):
        return
    cap = max(1, opt // red.scale + delta)
    a = decide_cpsat(red, cap, variant, det_time=1.0, deadline=float("inf"))
    # the reduced problem's optimum is opt / scale when something overlaps at the peak;
    # set-aside buffers can only make the whole optimum larger than the kept part's
    if a.status == FEASIBLE:
        assert red.peak(a.offsets) <= cap
        assert pool.validate(p, red.expand(a.offsets)).valid
    if a.status == INFEASIBLE:
        assert cap * red.scale < opt


@settings(max_examples=25, deadline=None)
@given(small_problems())
def test_ladder_answers_are_valid_and_proofs_true(p):
    red = reduce(p)
    start = greedy_start(red)
    res = ladder(red, start, time_limit=600, det_budget=DET)
    offsets = red.expand(res.offsets)
    report = pool.validate(p, offsets)
    assert report.valid
    assert res.peak <= red.peak(start)  # never worse than where it started
    opt = brute_optimum(p)
    # the floor is a proven lower bound in bytes (gcd scaling included), the answer is
    # feasible, and an optimality claim is the truth
    assert res.floor * red.scale <= max(opt, 0)
    assert report.peak >= opt
    if res.optimal:
        assert max(report.peak, p.lower_bound) == opt


@settings(max_examples=25, deadline=None)
@given(small_problems(), st.integers(-2, 2))
def test_decision_matches_the_exhaustive_optimum(p, delta):
    red = reduce(p)
    check_decision_against_the_optimum(p, red, delta, Variant("t", hint=False))


@settings(max_examples=25, deadline=None)
@given(small_problems(), st.integers(-1, 1), st.integers(0, 7))
def test_bottom_up_decision_matches_the_exhaustive_optimum(p, delta, k):
    red = reduce(p)
    check_decision_against_the_optimum(p, red, delta, Variant("bu", hint=False, fixed=True, order=k))


@settings(max_examples=25, deadline=None)
@given(small_problems(max_n=10), st.integers(0, 12))
def test_bottom_up_orders_are_permutations(p, k):
    red = reduce(p)
    assert sorted(bottom_up_order(red, k).tolist()) == list(range(len(red)))


def test_bottom_up_finds_the_perfect_packing_of_a_full_set():
    p, _ = generate.strips(80, steps=160, height=64, seed=3)
    red = reduce(p)
    a = decide_cpsat(red, red.lower_bound, Variant("bu", hint=False, fixed=True, order=0), det_time=1.0,
                     deadline=float("inf"))
    assert a.status == FEASIBLE
    report = pool.validate(p, red.expand(a.offsets))
    assert report.valid and report.peak == p.lower_bound


@pytest.mark.parametrize("make", [generate.guillotine, generate.strips])
def test_skyline_finds_the_perfect_packing_of_a_full_set(make):
    p, _ = make(60, steps=120, height=64, seed=3)
    red = reduce(p)
    found = None
    for order in orders(red.lower, red.upper, red.size, 6, seed=0):
        found, _ = skyline(red.lower, red.upper, red.size, red.lower_bound, order, node_limit=20_000)
        if found is not None:
            break
    assert found is not None
    report = pool.validate(p, red.expand(found))
    assert report.valid and report.peak == p.lower_bound


@settings(max_examples=25, deadline=None)
@given(small_problems(max_n=10), st.integers(0, 3))
def test_skyline_answers_respect_the_capacity(p, extra):
    red = reduce(p)
    cap = red.lower_bound + extra
    for order in orders(red.lower, red.upper, red.size, 3):
        off, _ = skyline(red.lower, red.upper, red.size, cap, order, node_limit=2_000)
        if off is not None:
            assert red.peak(off) <= cap
            assert pool.validate(p, red.expand(off)).valid


@settings(max_examples=20, deadline=None)
@given(small_problems())
def test_best_with_the_ladder_never_above_greedy_and_proofs_true(p):
    s = pool.solve(p, "best", time_limit=600, node_limit=50, ladder_det_budget=DET)
    assert pool.validate(p, s.offsets, s.peak).valid
    assert s.peak <= pool.solve(p, "greedy").peak
    if s.optimal:
        assert s.peak == brute_optimum(p)


def test_ladder_is_deterministic_under_a_deterministic_budget():
    p, w = generate.strips(80, steps=200, height=32, seed=5)
    q, _ = generate.with_free_space(p, w, 0.2, seed=5)
    red = reduce(q)
    runs = [ladder(red, greedy_start(red), time_limit=600, det_budget=DET, seed=1) for _ in range(2)]
    assert np.array_equal(runs[0].offsets, runs[1].offsets)
    assert [(a.cap, a.variant, a.status) for a in runs[0].attempts] == [
        (a.cap, a.variant, a.status) for a in runs[1].attempts]


def _cli(argv):
    from tierflow.pool import cli

    ap = argparse.ArgumentParser()
    cli.register(ap.add_subparsers())
    args = ap.parse_args(argv)
    return args.func(args)


def test_cli_says_why_the_result_is_optimal(tmp_path, capsys):
    p, _ = generate.guillotine(40, steps=60, height=16, seed=2)
    f = tmp_path / "perfect.csv"
    pool.write_csv(f, p, np.zeros(len(p), dtype=np.int64))
    assert _cli(["pool", str(f), "--solver", "best", "--node-limit", "1000", "--det-time", str(DET), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["valid"] and doc["optimal"] and doc["proof"] == "lower-bound"
    assert _cli(["pool", str(f), "--solver", "best", "--node-limit", "1000", "--det-time", str(DET)]) == 0
    assert "proven optimal" in capsys.readouterr().out


def test_cli_says_when_nothing_is_proven(tmp_path, capsys):
    f = tmp_path / "p.csv"
    # greedy peaks at 7 here, the bound is 5
    f.write_text("id,lower,upper,size\n0,0,2,2\n1,2,5,2\n2,3,6,3\n3,0,3,2\n4,1,3,1\n")
    assert _cli(["pool", str(f), "--solver", "greedy", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["proof"] == "none" and not doc["optimal"]
