"""tierflow's own policy: planned, valid, within the budget, deterministic, and better
than the UVM baselines."""

from __future__ import annotations

import pytest

from helpers import chain_trace, simple_hw
from tierflow import PlanError, load_hardware, load_trace, validate
from tierflow.policies import make_plan, min_working_set
from tierflow.simulate import simulate
from tierflow.synthetic import gpt_trace


@pytest.fixture(scope="module")
def gpt():
    hw = load_hardware("rtx4090-24g")
    return gpt_trace(hw, layers=4, d_model=1024, batch=8, seq=512), hw


def test_plan_is_planned_valid_and_within_budget(gpt):
    trace, hw = gpt
    budget = int(trace.peak_live_bytes * 0.5)
    plan = make_plan("tierflow", trace, hw, budget=budget)
    assert not plan.reactive and plan.frees_dead and plan.moves
    residency = validate(plan, trace, hw)
    assert residency.tier_bytes[hw.device].max() <= budget
    r = simulate(trace, hw, plan)
    assert r.fits and r.error is None and r.peak_bytes[hw.device] <= budget


def test_deterministic(gpt):
    trace, hw = gpt
    budget = int(trace.peak_live_bytes * 0.5)
    a = make_plan("tierflow", trace, hw, budget=budget)
    b = make_plan("tierflow", trace, hw, budget=budget)
    assert a.moves == b.moves


@pytest.mark.parametrize("share", [0.35, 0.5, 0.7])
def test_beats_lru_and_deepum(gpt, share):
    trace, hw = gpt
    budget = int(trace.peak_live_bytes * share)
    ours = simulate(trace, hw, make_plan("tierflow", trace, hw, budget=budget)).ratio
    for base in ("lru", "deepum"):
        theirs = simulate(trace, hw, make_plan(base, trace, hw, budget=budget)).ratio
        assert ours >= theirs, (base, share, ours, theirs)


def test_no_plan_when_nothing_fits():
    hw = simple_hw()
    trace = chain_trace()
    need, op = min_working_set(trace)
    with pytest.raises(PlanError, match=f"{need} bytes"):
        make_plan("tierflow", trace, hw, budget=need - 1)


def test_nothing_moves_when_everything_fits():
    hw = simple_hw()
    trace = chain_trace()
    plan = make_plan("tierflow", trace, hw)
    assert plan.moves == () and simulate(trace, hw, plan).ratio == 1.0


def test_uses_ssd_when_host_is_small(gpt):
    trace, hw = gpt
    small = hw.with_tier("host", capacity=float(trace.peak_live_bytes * 0.1))
    budget = int(trace.peak_live_bytes * 0.4)
    plan = make_plan("tierflow", trace, small, budget=budget)
    assert {m.tier for m in plan.moves} >= {"ssd"}
    r = simulate(trace, small, plan)
    assert r.fits and r.peak_bytes["host"] <= small.tier("host").capacity


def test_bert_matches_g10_published(g10_dir):
    hw = load_hardware("g10-a100")
    trace = load_trace(g10_dir / "bert-256")
    r = simulate(trace, hw, make_plan("tierflow", trace, hw))
    assert r.ratio >= 0.997  # G10's published prefetch_lru ratio on this case
