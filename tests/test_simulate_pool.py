"""Device memory through a planned pool (tierflow.simulate.pooled)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import MB, chain_trace, simple_hw
from tierflow import Op, TensorInfo, Trace, load_hardware, pool
from tierflow.cli import POOL_CHOICES as CLI_POOL_CHOICES
from tierflow.cli import build_parser, main
from tierflow.errors import PlanError
from tierflow.plan import Move, Plan, validate
from tierflow.policies import make_plan
from tierflow.simulate import POOL_CHOICES, simulate, simulate_pooled
from tierflow.simulate.pooled import _Recorder, periodic_problem
from tierflow.synthetic import gpt_trace

NODES = 300  # a node budget for ``best``: deterministic and quick


def ring(k: int, width: int) -> Trace:
    """``k`` persistent 100 MB tensors on a ring; op ``i`` uses tensors i..i+width-1."""
    ts = [TensorInfo(i, 100 * MB, "parameter", True, f"P{i}") for i in range(k)]
    ops = [Op(f"op{i}", "forward", 0.1, tuple((i + j) % k for j in range(width)), ()) for i in range(k)]
    return Trace(ops, ts, f"ring{k}x{width}")


def ring_plan(budget: float) -> Plan:
    """For ``ring(4, 1)``: evict each tensor after its use, fetch it two ops ahead, so
    each stays for three ops of four: four arcs that pairwise overlap with three live."""
    moves = []
    for i in range(4):
        moves += [Move("evict", i, i, "host"), Move("prefetch", (i + 2) % 4, i, "host", (i + 2) % 4)]
    return Plan("ring", tuple(moves), budget_bytes=budget)


@pytest.fixture(scope="module")
def gpt():
    hw = load_hardware("rtx4090-24g")
    trace = gpt_trace(hw, layers=4, d_model=1024, batch=8, seq=512)
    return trace, hw, make_plan("g10", trace, hw, budget="60%")


def recorded(trace, hw, plan):
    sim = _Recorder(trace, hw, plan, validate(plan, trace, hw).start_tier)
    sim.run(2, None)
    return sim


def test_none_is_plain_simulate(gpt):
    trace, hw, plan = gpt
    a, b = simulate(trace, hw, plan), simulate_pooled(trace, hw, plan, "none")
    assert a.to_dict() == b.to_dict() and "pool" not in b.to_dict() and b.pool is None
    assert repr(a.transfers) == repr(b.transfers)  # repr: unfinished transfers end at nan
    np.testing.assert_array_equal(a.op_end_s, b.op_end_s)


def test_recording_does_not_change_the_simulation(gpt):
    trace, hw, plan = gpt
    plain = simulate(trace, hw, plan)
    sim = recorded(trace, hw, plan)
    res = sim.result()
    assert res.time_s == plain.time_s and repr(res.transfers) == repr(plain.transfers)
    assert res.peak_bytes == plain.peak_bytes


def test_chain_blocks_by_hand():
    trace, hw = chain_trace(), simple_hw()
    sim = recorded(trace, hw, Plan("all", (), budget_bytes=float(2**30)))
    problem, spanning = sim.problem()
    # W resident all along (one block over the iteration); A born at op 0 (allocation 1)
    # and G at op 2 (allocation 2), both freed at the end
    got = {b.id: (b.lower, b.upper, b.size) for b in problem.buffers}
    assert got == {"0": (0, 3, 100 * MB), "1": (1, 3, 50 * MB), "2": (2, 3, 30 * MB)}
    assert spanning == 1 and problem.lower_bound == 180 * MB


def test_layout_is_valid_and_bounded(gpt):
    trace, hw, plan = gpt
    sim = recorded(trace, hw, plan)
    problem, _ = sim.problem()
    live = int(sim.peak[hw.device])
    greedy = pool.solve(problem, "greedy")
    best = pool.solve(problem, "best", node_limit=NODES, time_limit=2)
    for sol in (greedy, best):
        report = pool.validate(problem, sol.offsets, sol.peak)
        assert report.valid, report.errors
        assert sol.peak >= problem.lower_bound >= live
    assert greedy.peak >= best.peak


def test_pooled_reports_arena_against_live_peak(gpt):
    trace, hw, plan = gpt
    g = simulate_pooled(trace, hw, plan, "greedy")
    # best's final repair runs until its time limit whatever the node budget: a short
    # limit keeps this quick, and nothing below depends on how far it got
    b = simulate_pooled(trace, hw, plan, "best", node_limit=NODES, time_limit=0.3)
    for r in (g, b):
        p = r.pool
        assert p.arena_peak_bytes >= p.lower_bound_bytes >= p.live_peak_bytes > 0
        assert p.live_peak_bytes == r.peak_bytes[hw.device]
        assert p.fragmentation_bytes == p.arena_peak_bytes - p.live_peak_bytes
        assert r.fits == (p.arena_peak_bytes <= plan.budget_bytes) and r.budget_bytes == plan.budget_bytes
        assert p.rounds == len(p.history) and p.history[0]["budget_bytes"] == plan.budget_bytes
        d = r.to_dict()["pool"]
        assert d["arena_peak_bytes"] == p.arena_peak_bytes and d["solver"] == p.solver
        json.dumps(d)


def test_complementary_arcs_share_one_slot():
    # tensor 0 held on [2, 4) and [0, 1) (across the boundary), tensor 1 on [1, 2): cut at
    # 1, neither is held across it, so one 100-byte slot serves both
    problem, spanning = periodic_problem([(0, 0, 1), (1, 1, 2), (0, 2, 4)], [100, 100], 4)
    assert problem.lower_bound == 100 and spanning == 0
    assert pool.solve(problem, "greedy").peak == 100


def test_three_overlapping_arcs_need_three_slots():
    # on a circle of 6, three arcs of length 4 pairwise overlap though only two are ever
    # live: no cut avoids them all, so a periodic layout needs three slots
    blocks = [(0, 0, 4), (1, 2, 6), (2, 0, 2), (2, 4, 6)]
    live = pool.lower_bound(pool.Problem(tuple(pool.Buffer(str(i), lo, hi, 1) for i, (_, lo, hi) in enumerate(blocks))))
    problem, spanning = periodic_problem(blocks, [1, 1, 1], 6)
    assert live == 2 and problem.lower_bound == 3 and spanning == 1


def test_fragmentation_lowers_the_budget_and_slows_the_step():
    trace, hw = ring(4, 1), simple_hw(pcie_gbps=1.0)
    plan = ring_plan(300 * MB)
    plain = simulate(trace, hw, plan)
    assert plain.peak_bytes["gpu"] <= 300 * MB and plain.time_s == pytest.approx(trace.ideal_s)
    for solver in ("greedy", "best"):
        r = simulate_pooled(trace, hw, plan, solver, node_limit=NODES, time_limit=2)
        p = r.pool
        assert p.history[0]["arena_peak_bytes"] > 300 * MB  # byte counting fit, the layout did not
        assert p.fits and r.fits and r.error is None
        assert p.arena_peak_bytes <= 300 * MB and p.effective_budget_bytes < 300 * MB
        assert r.time_s > plain.time_s * 1.2 and p.shrink == "same plan"


def test_a_plan_whose_arena_never_fits_is_reported():
    # three tensors, ops use two neighbours, two slots: the demand pager cycles them
    trace, hw = ring(3, 2), simple_hw(pcie_gbps=1.0)
    plan = Plan("demand", (), budget_bytes=float(200 * MB), reactive=True)
    assert simulate(trace, hw, plan).fits
    r = simulate_pooled(trace, hw, plan, "greedy")
    assert not r.fits and not r.pool.fits and r.time_s == float("inf") and r.ratio == 0.0
    assert "arena needs 300000000 bytes" in r.error and "minimum working set" in r.error


def test_replan_is_called_with_lower_budgets():
    trace, hw = ring(4, 1), simple_hw(pcie_gbps=1.0)
    asked = []

    def replan(budget: float) -> Plan:
        asked.append(budget)
        return ring_plan(budget)

    r = simulate_pooled(trace, hw, ring_plan(300 * MB), "greedy", replan=replan)
    assert asked and all(b < 300 * MB for b in asked) and r.pool.shrink == "replan"
    assert r.pool.effective_budget_bytes in asked


def test_a_budget_that_cannot_be_planned_makes_the_search_back_off():
    trace, hw = ring(4, 1), simple_hw(pcie_gbps=1.0)

    def replan(budget: float) -> Plan:
        if budget < 250 * MB:
            raise PlanError(f"no plan for {budget:.0f} bytes")
        return ring_plan(budget)

    r = simulate_pooled(trace, hw, ring_plan(300 * MB), "greedy", replan=replan)
    errors = [h for h in r.pool.history if h["error"]]
    assert errors and "no plan for the budget lowered to" in errors[0]["error"]
    assert r.fits and r.error is None and 250 * MB <= r.pool.effective_budget_bytes < 300 * MB


def test_bad_pool_arguments():
    trace, hw = chain_trace(), simple_hw()
    plan = Plan("all", (), budget_bytes=float(2**30))
    with pytest.raises(pool.PoolError, match="unknown pool 'exact'"):
        simulate_pooled(trace, hw, plan, "exact")
    with pytest.raises(pool.PoolError, match="max_rounds"):
        simulate_pooled(trace, hw, plan, "greedy", max_rounds=0)


# -- CLI ---------------------------------------------------------------------------------

@pytest.fixture
def trace_file(tmp_path):
    return str(chain_trace().save(tmp_path / "chain.json.gz"))


def test_cli_choices_match_the_library():
    assert CLI_POOL_CHOICES == POOL_CHOICES


def test_cli_parses_pool():
    p = build_parser()
    assert p.parse_args(["simulate", "t.json"]).pool == "none"
    args = p.parse_args(["compare", "t.json", "--pool", "best", "--pool-time", "2.5"])
    assert args.pool == "best" and args.pool_time == 2.5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pool", "perfect"], "argument --pool: invalid choice: 'perfect'"),
        (["--pool", "best", "--pool-time", "0"], "argument --pool-time: must be a positive number"),
        (["--pool", "best", "--pool-time", "soon"], "argument --pool-time: not a number of seconds"),
    ],
)
def test_cli_bad_pool_values(trace_file, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["simulate", trace_file, *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_cli_pool_with_gpus_is_refused(trace_file):
    with pytest.raises(SystemExit, match="--pool lays out one device"):
        main(["simulate", trace_file, "--hardware", "rtx4090-24g", "--policy", "lru", "--pool", "greedy",
              "--gpus", "2"])


def test_cli_simulate_json_has_pool_only_when_asked(trace_file, capsys):
    base = ["simulate", trace_file, "--hardware", "rtx4090-24g", "--policy", "lru", "--json"]
    assert main(base) == 0
    assert "pool" not in json.loads(capsys.readouterr().out)
    assert main([*base, "--pool", "greedy"]) == 0
    p = json.loads(capsys.readouterr().out)["pool"]
    assert p["solver"] == "greedy" and p["arena_peak_bytes"] >= p["live_peak_bytes"] > 0


def test_cli_compare_table_shows_the_arena(trace_file, capsys):
    assert main(["compare", trace_file, "--hardware", "rtx4090-24g", "--policies", "ideal,lru",
                 "--pool", "best", "--pool-time", "1"]) == 0
    out = capsys.readouterr().out
    assert "arena gpu" in out and "frag" in out and "lru: best pool: arena" in out
