"""The runtime's own host costs in the simulator (``Hardware.op_issue_s``,
``recompute_issue_s``, ``host_step_issue_s``, ``async_launch``): additive where the
dispatching thread runs the ops (CPU mode), a host timeline the device waits for only
when it falls behind (a GPU), and no change at all when they are zero."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import (
    MB,
    chain_trace,
    host_hw,
    host_steps_of,
    lever_trace,
    lever_traces,
    pick_recomputes,
    simple_hw,
)
from tierflow import Move, Op, Plan, TensorInfo, Trace
from tierflow.plan import Recompute
from tierflow.simulate import simulate


def _steady_ops(n: int, op_s: float) -> Trace:
    """``n`` ops of ``op_s`` each, one small tensor passed along: nothing to move."""
    ts = [TensorInfo(k, MB, "activation") for k in range(n + 1)]
    return Trace([Op(f"op{k}", "forward", op_s, (k,), (k + 1,)) for k in range(n)], ts, "steady")


def _plan(budget: float, *moves: Move, **kw) -> Plan:
    return Plan("t", tuple(moves), budget_bytes=budget, **kw)


def test_async_launch_scores_a_launch_bound_step_by_the_host():
    tr, hw = _steady_ops(10, 1e-3), dataclasses.replace(simple_hw(), async_launch=True)
    # the host needs 2 ms to issue each 1 ms op: the device waits 1 ms before each
    slow_host = simulate(tr, dataclasses.replace(hw, op_issue_s=2e-3), _plan(hw.device_capacity))
    assert slow_host.time_s == pytest.approx(10 * 2e-3)
    assert slow_host.host_wait_s == pytest.approx(10 * 1e-3)
    assert slow_host.op_start_s[1] - slow_host.op_start_s[0] == pytest.approx(2e-3)


def test_async_launch_leaves_a_device_bound_step_alone():
    tr, hw = _steady_ops(10, 1e-3), dataclasses.replace(simple_hw(), async_launch=True)
    # 0.5 ms to issue a 1 ms op: the host runs ahead (after the first iteration's first
    # launch), the measured iteration never waits for it
    fast_host = simulate(tr, dataclasses.replace(hw, op_issue_s=0.5e-3), _plan(hw.device_capacity))
    assert fast_host.time_s == tr.ideal_s and fast_host.host_wait_s == 0.0


def test_cpu_mode_adds_each_ops_issue_cost_to_the_step():
    tr, hw = chain_trace(), simple_hw()
    r = simulate(tr, dataclasses.replace(hw, op_issue_s=1e-3), _plan(hw.device_capacity))
    assert r.host_wait_s == pytest.approx(tr.n_ops * 1e-3)
    assert r.time_s == pytest.approx(tr.ideal_s + tr.n_ops * 1e-3)
    # each op starts one issue cost after the previous one ended
    for k in range(1, tr.n_ops):
        assert r.op_start_s[k] == pytest.approx(r.op_end_s[k - 1] + 1e-3)


def _lever_plan(tr: Trace, budget: float, *, recompute: bool = False, host_steps: bool = False) -> Plan:
    h0 = next(t.id for t in tr.tensors if t.name == "h0")
    lin0 = next(i for i, o in enumerate(tr.ops) if o.name == "lin0")
    bwd0 = next(i for i, o in enumerate(tr.ops) if o.name == "bwd0")
    return _plan(budget, recomputes=(Recompute((h0,), (lin0,), bwd0),) if recompute else (),
                 host_steps=tuple(host_steps_of(tr)) if host_steps else ())


def test_cpu_mode_charges_each_replayed_op_its_issue_cost():
    tr, hw = lever_trace(3, [10] * 20, [5] * 13), host_hw()
    plan = _lever_plan(tr, hw.device_capacity, recompute=True)
    free = simulate(tr, hw, plan)
    costly = simulate(tr, dataclasses.replace(hw, recompute_issue_s=2e-3), plan)
    assert free.recompute_ops == 1 and costly.host_wait_s == pytest.approx(2e-3)
    assert costly.recompute_s == free.recompute_s  # (the replay's host cost is not compute)
    assert costly.stall_s == pytest.approx(0.0, abs=1e-12) and free.stall_s == pytest.approx(0.0, abs=1e-12)
    assert costly.time_s == pytest.approx(free.time_s + 2e-3)


def test_cpu_mode_charges_each_host_step_its_issue_cost():
    # links and host updates so fast that no update is waited for: only the issue costs
    tr, hw = lever_trace(3, [10] * 20, [5] * 13), host_hw(pcie_gbps=1e9, host_gbps=1e9)
    plan = _lever_plan(tr, hw.device_capacity, host_steps=True)
    free = simulate(tr, hw, plan)
    costly = simulate(tr, dataclasses.replace(hw, host_step_issue_s=3e-3), plan)
    n_steps = len(plan.host_steps)
    assert n_steps == 3 and costly.host_wait_s == pytest.approx(n_steps * 3e-3)
    assert costly.stall_s == pytest.approx(free.stall_s, abs=1e-6)
    assert costly.time_s == pytest.approx(free.time_s + n_steps * 3e-3, abs=1e-6)


def test_zero_costs_give_the_same_result_with_or_without_async_launch():
    tr, hw = chain_trace(), simple_hw(pcie_gbps=10.0)
    plan = _plan(2**30, Move("evict", 1, 0, "host"), Move("prefetch", 1, 1, "host", 2))
    a = simulate(tr, hw, plan)
    b = simulate(tr, dataclasses.replace(hw, async_launch=True), plan)
    assert (a.time_s, a.stall_s, a.host_wait_s) == (b.time_s, b.stall_s, b.host_wait_s)
    assert a.op_start_s.tolist() == b.op_start_s.tolist()
    assert [(t.issue_s, t.end_s) for t in a.transfers] == [(t.issue_s, t.end_s) for t in b.transfers]


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_zero_costs_change_nothing_with_recomputes_and_host_steps(data):
    tr = data.draw(lever_traces())
    hw = host_hw()
    plan = _plan(hw.device_capacity, recomputes=tuple(pick_recomputes(data.draw, tr)),
                 host_steps=tuple(host_steps_of(tr)[: data.draw(st.integers(0, 4))]))
    a = simulate(tr, hw, plan)
    b = simulate(tr, dataclasses.replace(hw, async_launch=True), plan)
    assert a.time_s == b.time_s and a.host_wait_s == b.host_wait_s == 0.0
    assert a.op_start_s.tolist() == b.op_start_s.tolist()
    # the step is the same sum of parts it always was
    assert math.isclose(a.time_s, tr.ideal_s + a.stall_s + a.recompute_s - a.host_op_s, abs_tol=1e-12)


def test_async_launch_puts_the_move_issue_cost_on_the_host():
    tr, hw = chain_trace(), simple_hw(pcie_gbps=10.0)
    plan = _plan(2**30, Move("evict", 1, 0, "host"), Move("prefetch", 1, 1, "host", 2))
    # 1 ms per transfer on a 10-45 ms step: the host keeps ahead of the device
    r = simulate(tr, dataclasses.replace(hw, move_issue_s=1e-3, async_launch=True), plan)
    free = simulate(tr, hw, plan)
    assert r.issuing_s == 0.0 and r.host_wait_s == 0.0 and r.time_s == free.time_s


def test_host_copies_cost_the_thread_their_bytes():
    tr, hw = chain_trace(), simple_hw(pcie_gbps=10.0)
    plan = _plan(2**30, Move("evict", 1, 0, "host"), Move("prefetch", 1, 1, "host", 2))
    free = simulate(tr, hw, plan)
    r = simulate(tr, dataclasses.replace(hw, host_copies=True), plan)
    # the 50 MB eviction and prefetch, each 5 ms at 10 GB/s, on the thread that runs the ops
    assert r.issuing_s == pytest.approx(2 * 50 * MB / 10e9) and free.issuing_s == 0.0
    assert r.time_s == pytest.approx(tr.ideal_s + r.stall_s + r.issuing_s)
    # the prefetch, issued 5 ms later (after the eviction's copy), still arrives for op 2
    # no later than the thread is free: op 2 waits no longer than it did
    assert r.stall_s <= free.stall_s + 1e-12
