"""Property tests of simulator invariants over random traces, budgets and plans."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from helpers import MB, simple_hw
from tierflow import Move, Op, Plan, TensorInfo, Trace, validate
from tierflow.policies import make_plan, min_working_set
from tierflow.simulate import simulate


@st.composite
def traces(draw):
    n_t = draw(st.integers(1, 10))
    n_ops = draw(st.integers(1, 14))
    tensors = [
        TensorInfo(i, draw(st.integers(1, 120)) * MB, "parameter" if p else "activation", p)
        for i, p in enumerate(draw(st.lists(st.booleans(), min_size=n_t, max_size=n_t)))
    ]
    uses = [set(draw(st.lists(st.integers(0, n_t - 1), max_size=3))) for _ in range(n_ops)]
    for t in range(n_t):  # every tensor is used somewhere
        uses[draw(st.integers(0, n_ops - 1))].add(t)
    ops = [
        Op(f"op{i}", "forward", draw(st.integers(0, 40)) * 1e-3, tuple(sorted(u)))
        for i, u in enumerate(uses)
    ]
    return Trace(ops, tensors, "random")


@st.composite
def cases(draw):
    trace = draw(traces())
    hw = simple_hw(pcie_gbps=draw(st.sampled_from([2.0, 10.0, 50.0])), fault_us=draw(st.sampled_from([0.0, 45.0])))
    need, _ = min_working_set(trace)
    total = int(trace.sizes.sum())
    budget = draw(st.integers(need, max(need, total)))
    return trace, hw.with_tier("gpu", capacity=float(max(budget, 2**30))), budget


def random_planned(draw, trace, hw):
    """Evict and prefetch in a random subset of gaps: always a consistent plan."""
    moves = []
    for g in trace.gaps:
        if g.wraps or not draw(st.booleans()):
            continue
        tier = draw(st.sampled_from(["host", "ssd"]))
        issue = draw(st.integers(g.after_op, g.before_op - 1))
        moves += [Move("evict", g.tensor, g.after_op, tier), Move("prefetch", g.tensor, issue, tier, g.before_op)]
    return Plan("random", moves, budget_bytes=hw.device_capacity)


def check_invariants(trace, hw, plan, r, levers=False):
    """``levers``: the plan may recompute and host-step (the stream then also runs the
    chains and no longer runs the host-stepped ops)."""
    if not r.fits and r.error:
        return
    # never over capacity, on any tier, at any moment of the reported iteration
    for tier in hw.tiers:
        cap = plan.budget_bytes if tier.name == hw.device else tier.capacity
        assert r.peak_bytes[tier.name] <= cap
        _, used = r.memory[tier.name]
        assert used.size == 0 or used.max() <= cap + 1e-6
    # time is at least the ideal (plus recompute, less what the host took over), and
    # at least what each link's traffic needs
    stream_s = r.ideal_s + r.recompute_s - r.host_op_s
    assert levers or (r.recompute_s == 0 and r.host_op_s == 0)
    assert r.time_s >= stream_s - 1e-12 * max(1.0, r.ideal_s)
    for link in hw.links:
        assert r.traffic_bytes[link.name] / link.bandwidth <= r.time_s * (1 + 1e-9) + 1e-12
    # ops run in order, one at a time, each for its duration
    starts, ends = r.op_start_s, r.op_end_s
    assert all(ends[i] <= starts[i + 1] + 1e-12 for i in range(len(starts) - 1))
    assert math.isclose(float((ends - starts).sum()), trace.ideal_s - r.host_op_s, rel_tol=1e-9, abs_tol=1e-12)
    if levers and len(starts):
        # between ops: their stalls and the chains run before them; the stream ends
        # when the iteration does
        gaps = starts - np.concatenate([[0.0], ends[:-1]])
        assert math.isclose(float(gaps.sum()), r.stall_s + r.recompute_s, rel_tol=1e-9, abs_tol=1e-12)
        for c in r.recomputes:
            assert starts[c.before_op] >= c.end_s - 1e-12 and c.end_s - c.start_s <= gaps[c.before_op] + 1e-12
        assert math.isclose(r.time_s, float(ends[-1]), rel_tol=1e-9, abs_tol=1e-12)


@given(cases(), st.sampled_from(["lru", "deepum"]), st.booleans())
def test_reactive_policies_keep_invariants(case, policy, liveness):
    trace, hw, budget = case
    plan = make_plan(policy, trace, hw, budget=budget, liveness=liveness)
    r = simulate(trace, hw, plan)
    assert r.fits, r.error
    check_invariants(trace, hw, plan, r)


@given(st.data())
def test_planned_moves_keep_invariants_and_are_deterministic(data):
    trace = data.draw(traces())
    hw = simple_hw(pcie_gbps=data.draw(st.sampled_from([1.0, 10.0])))
    plan = random_planned(data.draw, trace, hw)
    validate(plan, trace, hw)
    r = simulate(trace, hw, plan)
    check_invariants(trace, hw, plan, r)
    again = simulate(trace, hw, plan)
    assert again.to_dict() == r.to_dict() and again.transfers == r.transfers


@given(traces())
def test_ideal_is_exact(trace):
    hw = simple_hw()
    r = simulate(trace, hw, make_plan("ideal", trace, hw))
    assert r.time_s == trace.ideal_s and r.stall_s == 0 and r.peak_bytes["gpu"] == trace.peak_live_bytes
