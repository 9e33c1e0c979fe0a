"""The physical bound: a proof, so no plan the simulator runs may beat it."""

from __future__ import annotations

import dataclasses
import json
import math

from hypothesis import given
from hypothesis import strategies as st

from helpers import MB, simple_hw
from test_levers import _fit_budget, lever_cases
from test_simulator_properties import random_planned, traces
from tierflow import Op, Plan, TensorInfo, Trace
from tierflow.bound import choose_check_ops, levers_bound, physical_bound
from tierflow.cli import main
from tierflow.plan import Recompute
from tierflow.policies import make_plan, min_working_set
from tierflow.simulate import simulate
from tierflow.synthetic import gpt_trace


def _squeeze_trace(d1: float) -> Trace:
    """A (100 MB) is born by op 0 and read by op 2; op 1 needs 100 MB of scratch W, and
    the budget holds only A+C: A must leave before op 1 starts and come back for op 2."""
    ts = [
        TensorInfo(0, 100 * MB, "activation", False, "A"),
        TensorInfo(1, 50 * MB, "activation", False, "C"),
        TensorInfo(2, 100 * MB, "temporary", False, "W"),
    ]
    ops = [
        Op("f0", "forward", 0.0, (), (0,)),
        Op("f1", "forward", d1, (), (1, 2)),
        Op("f2", "forward", 0.010, (0, 1), ()),
    ]
    return Trace(ops, ts, "squeeze")


def test_forced_stall_is_exact_and_reached():
    # 10 GB/s: A needs 10 ms to leave before op 1 starts, and op 1 fills the budget until
    # it ends, so A's 10 ms return starts only then: 20 ms of stall, which a plan that
    # evicts after op 0 and fetches after op 1 reaches
    hw = simple_hw(pcie_gbps=10.0)
    trace = _squeeze_trace(0.004)
    budget = 150 * MB
    r = physical_bound(trace, hw, budget)
    assert r.status == "optimal"
    assert math.isclose(r.stall_s, 0.020, rel_tol=1e-4)
    plan = make_plan("tierflow", trace, hw, budget=budget)
    res = simulate(trace, hw, plan)
    assert res.fits and res.ratio <= r.bound_ratio + 1e-9
    assert res.ratio >= r.bound_ratio * 0.99


def test_no_pressure_gives_one_and_too_small_gives_zero():
    hw = simple_hw()
    trace = _squeeze_trace(0.004)
    assert physical_bound(trace, hw, float(trace.peak_live_bytes)).bound_ratio == 1.0
    need, _ = min_working_set(trace)
    r = physical_bound(trace, hw, need - 1)
    assert r.bound_ratio == 0.0 and r.status == "infeasible"


def test_tier_capacity_is_a_constraint():
    # with host and SSD both too small to hold A, nothing can make room for op 1
    hw = simple_hw(host_gib=0.05).with_tier("ssd", capacity=float(10 * MB))
    trace = _squeeze_trace(0.004)
    assert physical_bound(trace, hw, 150 * MB).status == "infeasible"


def test_check_ops_are_over_the_budget_and_bounded():
    hw = simple_hw()
    trace = gpt_trace(hw, layers=4, d_model=1024, batch=8, seq=512)
    budget = trace.peak_live_bytes * 0.5
    ops = choose_check_ops(trace, budget, 10)
    assert 0 < len(ops) <= 11 and (trace.live_bytes[ops] > budget).all()
    assert trace.peak_op in ops.tolist()


def test_more_points_only_tighten():
    hw = simple_hw(pcie_gbps=2.0)
    trace = gpt_trace(hw, layers=4, d_model=1024, batch=8, seq=512)
    budget = trace.peak_live_bytes * 0.45
    coarse = physical_bound(trace, hw, budget, points=5)
    fine = physical_bound(trace, hw, budget, points=10_000)
    assert fine.bound_ratio <= coarse.bound_ratio + 1e-9
    assert fine.bound_ratio < 1.0


@st.composite
def bound_cases(draw):
    trace = draw(traces())
    host = draw(st.sampled_from([0.05, 0.2, 64.0]))  # GiB: a small host pushes bytes to SSD
    hw = simple_hw(pcie_gbps=draw(st.sampled_from([2.0, 10.0, 50.0])), host_gib=host,
                   fault_us=draw(st.sampled_from([0.0, 45.0])))
    need, _ = min_working_set(trace)
    total = int(trace.sizes.sum())
    budget = draw(st.integers(need, max(need, total)))
    return trace, hw.with_tier("gpu", capacity=float(max(budget, 2**30))), budget


@given(bound_cases(), st.data())
def test_no_policy_beats_the_bound(case, data):
    trace, hw, budget = case
    bound = physical_bound(trace, hw, budget)
    plans = [make_plan(p, trace, hw, budget=budget) for p in ("lru", "deepum", "tierflow")]
    plans.append(make_plan("lru", trace, hw, budget=budget, liveness=True))
    rnd = random_planned(data.draw, trace, hw)
    plans.append(type(rnd)("random", rnd.moves, budget_bytes=budget))
    for plan in plans:
        try:
            r = simulate(trace, hw, plan)
        except Exception:  # a random plan may overfill a tier: then it does not run
            continue
        if r.error:
            continue
        assert r.ratio <= bound.bound_ratio + 1e-9, (plan.policy, r.ratio, bound)


def test_cli_json(tmp_path, capsys):
    hw = simple_hw()
    path = _squeeze_trace(0.004).save(tmp_path / "sq.json")
    assert main(["bound", str(path), "--hardware", "g10-a100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"bound_ratio", "bound_time_s", "ideal_s", "seconds"} <= set(out)
    assert out["bound_ratio"] == 1.0
    assert main(["bound", str(path), "--hardware", "g10-a100", "--budget", "150MB"]) == 0
    assert "no plan that only moves tensors can step faster" in capsys.readouterr().out
    del hw


# -- the levers bound -----------------------------------------------------------------


def test_levers_bound_is_never_below_the_move_bound():
    hw = simple_hw(pcie_gbps=10.0)
    trace = _squeeze_trace(0.004)
    for budget in (150 * MB, 200 * MB, 260 * MB):
        assert levers_bound(trace, hw, budget).bound_ratio >= physical_bound(trace, hw, budget).bound_ratio - 1e-12


def test_levers_bound_prices_a_drop_at_its_op():
    # A is born by op 0 (2 ms): dropping it over op 1 costs re-running op 0, 2 ms, less
    # than the 18 ms of stall moving it costs (8 ms to leave beyond op 0, 10 to return)
    hw = simple_hw(pcie_gbps=10.0)
    ts = [TensorInfo(0, 100 * MB, "activation", False, "A"), TensorInfo(1, 50 * MB, "activation", False, "C"),
          TensorInfo(2, 100 * MB, "temporary", False, "W")]
    ops = [Op("f0", "forward", 0.002, (), (0,)), Op("f1", "forward", 0.004, (), (1, 2)),
           Op("f2", "forward", 0.010, (0, 1), ())]
    trace = Trace(ops, ts, "squeeze")
    budget = 150 * MB
    moving, levers = physical_bound(trace, hw, budget), levers_bound(trace, hw, budget)
    assert math.isclose(moving.stall_s, 0.018, rel_tol=1e-4)
    # at most the drop's 2 ms (less where moving a part of A during op 0 and fetching it
    # back while the chain runs helps), and more than nothing: A must go somehow
    assert 0.001 < levers.stall_s <= 0.002 + 1e-9
    r = Recompute((0,), (0,), 2)
    res = simulate(trace, hw, Plan("rc", budget_bytes=budget, recomputes=(r,)))
    assert res.fits and math.isclose(res.time_s, trace.ideal_s + 0.002)
    assert res.ratio <= levers.bound_ratio + 1e-9


@given(lever_cases(), st.floats(0.3, 1.0))
def test_no_lever_plan_beats_the_levers_bound(case, share):
    tr, hw, plan = case
    fitted = _fit_budget(tr, hw, plan).budget_bytes
    need, _ = min_working_set(tr)
    budget = float(max(need, int(fitted * share)))
    plan = dataclasses.replace(plan, budget_bytes=budget)
    r = simulate(tr, hw, plan, check_plan=False)
    if r.error:
        return
    bound = levers_bound(tr, hw, budget)
    assert r.ratio <= bound.bound_ratio + 1e-9, (r.ratio, bound)
    # the move-only bound does not cover these plans, but it still covers moves alone
    moves_only = simulate(tr, hw, Plan("none", budget_bytes=budget), check_plan=False)
    if not moves_only.error:
        assert moves_only.ratio <= physical_bound(tr, hw, budget).bound_ratio + 1e-9
