import math

import pytest

from helpers import MB, chain_trace, simple_hw
from tierflow import Move, Plan, PlanError, validate


def plan(*moves, budget=math.inf, **kw):
    return Plan("test", moves, budget_bytes=budget, **kw)


def test_valid_plan_gives_planned_residency():
    t, hw = chain_trace(), simple_hw()
    res = validate(plan(Move("evict", 1, 0, "host"), Move("prefetch", 1, 1, "host", 2)), t, hw)
    # A leaves the device after op 0, is back (reserved) from op 2
    assert res.tier_bytes["gpu"].tolist() == [150 * MB, 100 * MB, 180 * MB, 130 * MB]
    assert res.tier_bytes["host"].tolist() == [0, 50 * MB, 0, 0]


def test_wrapping_prefetch_of_a_persistent_tensor():
    t, hw = chain_trace(), simple_hw()
    # W is used by ops 0, 2, 3: evict after 0 and bring it back for op 2
    res = validate(plan(Move("evict", 0, 0, "host"), Move("prefetch", 0, 1, "host", 2)), t, hw)
    assert res.start_tier[0] == "gpu"


def test_persistent_evicted_after_last_use_starts_away():
    from tierflow import Op, TensorInfo, Trace

    ts = [TensorInfo(0, 10, "parameter", True), TensorInfo(1, 10, "activation")]
    ops = [Op("a", "forward", 1, (1,)), Op("b", "forward", 1, (0, 1)), Op("c", "forward", 1, (1,))]
    t = Trace(ops, ts)
    res = validate(plan(Move("evict", 0, 1, "host"), Move("prefetch", 0, 0, "host", 1)), t, simple_hw())
    assert res.start_tier[0] == "host"


@pytest.mark.parametrize(
    "moves, message",
    [
        ((Move("prefetch", 1, 0, "host", 2),), "not away from the device"),
        ((Move("evict", 1, 0, "host"),), "used by op 2 while planned to be on host"),
        ((Move("evict", 1, 0, "host"), Move("prefetch", 1, 1, "ssd", 2)), "prefetched from ssd .* evicted to host"),
        ((Move("evict", 2, 3, "host"),), "outside its life"),
        ((Move("evict", 1, 0, "host"), Move("prefetch", 1, 1, "host", 3)), "needed by op 3, which does not use it"),
        ((Move("evict", 7, 0, "host"),), "tensor that does not exist"),
        ((Move("evict", 1, 9, "host"),), "'after_op' is outside"),
        ((Move("evict", 1, 0, "gpu"),), "not an off-device tier"),
        ((Move("move", 1, 0, "host"),), "field 'kind'"),
        ((Move("evict", 1, 0, None),), "must name its tier"),
    ],
)
def test_inconsistent_plans_are_rejected(moves, message):
    with pytest.raises(PlanError, match=message):
        validate(plan(*moves), chain_trace(), simple_hw())


def test_tier_over_capacity_at_planning_time():
    with pytest.raises(PlanError, match=r"tier gpu over capacity at op 0"):
        validate(plan(budget=100 * MB), chain_trace(), simple_hw())
    hw = simple_hw().with_tier("host", capacity=10 * MB)
    with pytest.raises(PlanError, match=r"tier host over capacity at op 1"):
        validate(plan(Move("evict", 1, 0, "host"), Move("prefetch", 1, 1, "host", 2)), chain_trace(), hw)


def test_reactive_plans_only_check_references():
    t, hw = chain_trace(), simple_hw()
    validate(plan(Move("prefetch", 1, 0, None, 2), budget=10, reactive=True), t, hw)
    with pytest.raises(PlanError, match="does not exist"):
        validate(plan(Move("prefetch", 9, 0, None, 2), reactive=True), t, hw)


def test_only_reactive_plans_may_keep_dead_tensors():
    with pytest.raises(PlanError, match="only a reactive plan"):
        validate(plan(frees_dead=False), chain_trace(), simple_hw())


def test_plan_file_round_trip(tmp_path):
    p = plan(Move("evict", 1, 0, "host"), Move("prefetch", 1, 1, "host", 2), budget=200 * MB)
    assert Plan.load(p.save(tmp_path / "plan.json")) == p


def test_plan_file_errors(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text('{"format": "tierflow-plan", "version": 1, "moves": [{"kind": "evict"}]}')
    with pytest.raises(PlanError, match=r"p.json: move 0: bad or missing field"):
        Plan.load(bad)
