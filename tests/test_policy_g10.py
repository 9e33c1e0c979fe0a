"""The ``g10`` policy: budgets, the shape of its moves, its bandwidth bookkeeping."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierflow import PlanError, Trace, load_hardware, validate
from tierflow.policies import make_plan, min_working_set
from tierflow.policies.g10 import _Budgets
from tierflow.simulate import simulate
from tierflow.synthetic import gpt_trace

HW = load_hardware("g10-a100")


def _slow_trace(factor: float = 200.0) -> Trace:
    """The small GPT trace with ops ``factor`` times longer, so that a transfer can hide
    behind compute the way it does in G10's workloads."""
    t = gpt_trace(HW, layers=4, d_model=1024, batch=8, seq=512)
    ops = [dataclasses.replace(o, duration_s=o.duration_s * factor) for o in t.ops]
    return Trace(ops, t.tensors, t.name + "-slow")


TRACE = _slow_trace()


def _budget(share: float) -> int:
    return int(share * TRACE.peak_live_bytes)


def test_budget_is_honoured_and_the_plan_beats_demand_paging():
    budget = _budget(0.6)
    plan = make_plan("g10", TRACE, HW, budget=budget)
    assert plan.budget_bytes == budget and plan.reactive and plan.frees_dead
    assert plan.count("evict") > 0 and plan.count("prefetch") > 0
    res = simulate(TRACE, HW, plan)
    assert res.error is None and res.peak_bytes["gpu"] <= budget
    lru = simulate(TRACE, HW, make_plan("lru", TRACE, HW, budget=budget))
    assert res.ratio > lru.ratio + 0.05


def test_refuses_a_budget_below_the_minimum_working_set():
    need, _ = min_working_set(TRACE)
    with pytest.raises(PlanError, match=rf"{need} bytes\), the minimum working set"):
        make_plan("g10", TRACE, HW, budget=need - 4096)


def test_nothing_moves_when_the_step_fits_under_the_line():
    # with the real memory curve (G10's own books count one tensor twice)
    plan = make_plan("g10", TRACE, HW, budget=int(TRACE.peak_live_bytes / 0.99) + 4096, g10_accounting=False)
    assert plan.moves == ()


def test_plans_are_deterministic():
    a = make_plan("g10", TRACE, HW, budget=_budget(0.5))
    b = make_plan("g10", TRACE, HW, budget=_budget(0.5))
    assert a.moves == b.moves


def test_planner_lowers_the_curve():
    budget = _budget(0.6)
    plan = make_plan("g10", TRACE, HW, budget=budget)
    before = int((TRACE.live_bytes > 0.99 * budget).sum())
    assert plan.meta["over_line_ops"] < before
    assert plan.meta["planned_peak_bytes"] < TRACE.peak_live_bytes


def test_without_host_memory_everything_goes_to_the_ssd():
    hw = HW.with_tier("host", capacity=0.0)
    plan = make_plan("g10", TRACE, hw, budget=_budget(0.6))
    assert plan.count("evict") > 0
    assert {m.tier for m in plan.moves if m.kind == "evict"} == {"ssd"}


def test_without_an_ssd_everything_goes_to_host():
    hw = dataclasses.replace(
        HW,
        tiers=tuple(t for t in HW.tiers if t.name != "ssd"),
        links=tuple(link for link in HW.links if "ssd" not in link.name),
    )
    plan = make_plan("g10", TRACE, hw, budget=_budget(0.6))
    assert plan.count("evict") > 0
    assert {m.tier for m in plan.moves} == {"host"}


@given(share=st.floats(0.35, 1.0), accounting=st.booleans(), earlier=st.booleans())
def test_every_move_belongs_to_an_inactive_period(share, accounting, earlier):
    budget = max(_budget(share), min_working_set(TRACE)[0])
    plan = make_plan("g10", TRACE, HW, budget=budget, g10_accounting=accounting, move_earlier=earlier)
    validate(plan, TRACE, HW)
    gaps = {(g.tensor, g.after_op): g for g in TRACE.gaps}
    evicted = {}
    for m in plan.moves:
        if m.kind == "evict":
            gap = gaps[(m.tensor, m.after_op)]  # issued right after a use that opens a gap
            evicted[(m.tensor, gap.before_op)] = gap
    n = TRACE.n_ops
    for m in plan.moves:
        if m.kind != "prefetch":
            continue
        gap = evicted[(m.tensor, m.needed_by)]  # only what this plan evicted comes back
        # issued inside the gap: after the eviction, before the use (cyclically)
        length = (gap.before_op - gap.after_op) % n or n  # a weight used once: a whole turn
        assert 0 < (m.after_op - gap.after_op) % n < length
    res = simulate(TRACE, HW, plan)
    assert res.error is None and res.peak_bytes["gpu"] <= budget


def test_ssd_traffic_spends_the_shared_pcie_budget():
    durations = np.array([1.0, 1.0, 1.0])
    b = _Budgets(HW, durations, 1.0)
    ssd_in, host_in = b.resources("ssd", "gpu"), b.resources("host", "gpu")
    assert "bus:pcie-h2d" in ssd_in and "bus:pcie-h2d" in host_in
    np.testing.assert_allclose(b.avail(ssd_in, 0, 3), 3.2e9)
    b.spend(ssd_in, 4.0e9, 0)  # fills slot 0, spills 0.8 GB into slot 1
    np.testing.assert_allclose(b.avail(ssd_in, 0, 3), [0.0, 2.4e9, 3.2e9])
    np.testing.assert_allclose(b.avail(host_in, 0, 3), [15.754e9 - 3.2e9, 15.754e9 - 0.8e9, 15.754e9])
    # forward and backward fills find where a transfer ends and where it must start
    assert b.fill_forward(ssd_in, 2.0e9, 0) == 1
    assert b.fill_forward(ssd_in, 3.0e9, 0) == 2
    assert b.fill_backward(ssd_in, 3.0e9, 3) == 2
    assert b.fill_backward(ssd_in, 4.0e9, 3) == 1
    assert b.fill_backward(ssd_in, 1.0e9, 3) == 2
    assert b.fill_backward(ssd_in, 99e9, 3) == 0


def test_quick_check_on_a_g10_case(g10_dir):
    from tierflow import load_trace

    trace = load_trace(g10_dir / "bert-256")
    plan = make_plan("g10", trace, HW)
    assert plan.meta["plan_s"] < 10
    assert plan.meta["evictions_ssd"] > 0 and plan.meta["evictions_host"] > 0
    res = simulate(trace, HW, plan)
    assert res.ratio == pytest.approx(0.997, abs=0.05)  # G10's published ratio for BERT


def _fills_by_running_sum(b: _Budgets, res: tuple[str, ...], size: float, at: int) -> tuple[int, int]:
    """(fill_forward from ``at``, fill_backward to ``at``) the straightforward way: one
    running sum over the whole rest of the iteration, as the planner first did."""
    a = np.maximum(np.minimum.reduce([b.cap[r] - b.used[r] for r in res]), 0.0)
    n = len(a)
    fwd = min(at + int(np.searchsorted(np.cumsum(a[at:]), size, side="left")), n - 1)
    bwd = 0 if at <= 0 else max(at - 1 - int(np.searchsorted(np.cumsum(a[:at][::-1]), size, side="left")), 0)
    return fwd, bwd


@given(st.integers(0, 2**32 - 1))
def test_fills_by_prefix_sums_match_the_running_sum(seed):
    """The fills place their answer with prefix sums and fall back to the running sum
    where rounding could tell the two apart; the slot must be the running sum's, to the
    slot, sizes that hit a partial sum exactly (or one float away) included, and so
    after spends (which update the cached sums in place of recomputing them)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    durations = rng.uniform(1e-6, 1e-2, n) * (rng.random(n) < 0.8)  # some ops take no time
    b = _Budgets(HW, durations, 1.0)
    out, back = b.resources("gpu", "ssd"), b.resources("ssd", "gpu")
    for _ in range(4):
        for res in (out, back):
            a = b.avail(res, 0, n)
            for _ in range(10):
                at = int(rng.integers(0, n + 1))
                sums = [0.0, float(rng.uniform(0, 1.2 * a.sum())), 1e30]
                if at < n:
                    sums.append(float(np.cumsum(a[at:])[rng.integers(0, n - at)]))
                if at > 0:
                    sums.append(float(np.cumsum(a[:at][::-1])[rng.integers(0, at)]))
                for x in sums:
                    for size in (x, np.nextafter(x, 0.0), np.nextafter(x, np.inf)):
                        size = float(size)
                        got = b.fill_forward(res, size, at), b.fill_backward(res, size, at)
                        assert got == _fills_by_running_sum(b, res, size, at)
        # spend part of the budget, as a move does
        res = out if rng.random() < 0.5 else back
        b.spend(res, float(rng.uniform(0, b.cap[res[0]].sum() / 2)), int(rng.integers(0, n)))
