"""CPU mode: the plan's prediction made again from its first followed iteration
(:mod:`tierflow.runtime.retime`): that iteration's op times, and the model's time
outside the runtime's handler charged per op; the plan itself unchanged."""

from __future__ import annotations

import math
import time

import pytest
import torch

from tierflow import offload
from tierflow.capture import zoo
from tierflow.runtime.retime import RETIMED

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def _gpt_tiny(python_s: float = 0.0):
    """gpt-tiny and one training step; ``python_s``: seconds of the loop's own Python
    (no op) in each forward, such as a model's data preparation."""
    built = zoo.build("gpt-tiny", seed=0)
    opt = torch.optim.AdamW(built.model.parameters(), lr=1e-3, foreach=False)
    x, y = built.make_batch(zoo.spec("gpt-tiny").batch, None)

    def step() -> None:
        out = built.model(x)
        if python_s:
            time.sleep(python_s)
        built.loss_fn(out, y).backward()
        opt.step()
        opt.zero_grad()

    return built.model, opt, step


def test_first_followed_iterations_remake_the_prediction():
    net, opt, step = _gpt_tiny()
    with offload(net, opt, budget="50%") as run:
        for _ in range(2):  # (a warm-up, then the profiled step that plans)
            step()
        at_plan_trace, plan = run.trace, run.plan
        assert run.stats.predicted_step_time_s_at_plan == run.stats.predicted_step_time_s
        for _ in range(RETIMED - 1):  # (timed: the prediction stays until the last of them)
            step()
            assert run.trace is at_plan_trace
        step()
        st = run.stats
        assert st.planned_steps == RETIMED and run.plan is plan
        assert f"first {RETIMED} followed iterations (median)" in run.trace.meta["timing"]
        assert st.predicted_step_time_s_at_plan is not None and st.outside_handler_s > 0
        assert st.predicted_step_time_s != st.predicted_step_time_s_at_plan
        trace = run.trace
        assert trace is not at_plan_trace
        assert trace.tensors == at_plan_trace.tensors and trace.n_ops == at_plan_trace.n_ops
        assert [o.name for o in trace.ops] == [o.name for o in at_plan_trace.ops]
        changed = sum(a.duration_s != b.duration_s for a, b in zip(trace.ops, at_plan_trace.ops))
        assert changed > 0.9 * trace.n_ops  # (every op the lean path ran was timed)
        # the cost per op: the time outside the handler spread over the ops, plus the
        # lean path's own bookkeeping
        lean = run._host_costs.lean_op_s
        assert math.isclose(run.hardware.op_issue_s, st.outside_handler_s / trace.n_ops + lean, rel_tol=1e-9)
        assert st.ideal_step_time_s == trace.ideal_s
        assert run.prediction.time_s == st.predicted_step_time_s
        step()  # the first few only
        assert run.trace is trace and st.predicted_step_time_s == run.prediction.time_s
        # each op's time: its median over the timed iterations
        samples = run._retimer.op_samples
        assert all(len(d) == RETIMED for d in samples if d)
        assert all(o.duration_s == sorted(d)[RETIMED // 2] for o, d in zip(trace.ops, samples) if d)


def test_time_outside_the_ops_is_predicted():
    # 30 ms of the loop's own Python a step: the prediction made at the plan knows
    # nothing of it, the one remade from a followed iteration charges it
    net, opt, step = _gpt_tiny(python_s=0.03)
    with offload(net, opt, budget="50%") as run:
        for _ in range(2 + RETIMED):
            step()
        st = run.stats
        assert st.outside_handler_s >= 0.03
        assert st.predicted_step_time_s - st.predicted_step_time_s_at_plan >= 0.02
        assert st.predicted_step_time_s >= 0.03


def test_the_host_costs_are_measured_at_the_plan_and_are_the_plan_s():
    # (which of the lean path's cost and the cost through the mode is larger is a
    # measurement: BENCHMARKS.md "CPU-mode prediction", not a verdict here)
    net, opt, step = _gpt_tiny()
    with offload(net, opt, budget="50%") as run:
        for _ in range(2):
            step()
    costs = run._host_costs
    assert costs.lean_op_s > 0 and costs.op_issue_s > 0
    assert run.hardware.op_issue_s == costs.op_issue_s  # (before the retimed iterations)


def test_a_machine_model_the_user_gave_is_left_alone():
    net, opt, step = _gpt_tiny()
    with offload(net, opt, budget="50%", hardware="rtx4090-24g") as run:
        for _ in range(4):
            step()
        st = run.stats
        assert st.planned_steps >= 1
        assert st.predicted_step_time_s == st.predicted_step_time_s_at_plan
        assert st.outside_handler_s is None


def test_an_iteration_that_departs_is_not_used():
    built = zoo.build("gpt-tiny", seed=0)
    net = built.model
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=False)
    spec = zoo.spec("gpt-tiny")
    x, y = built.make_batch(spec.batch, None)

    def step(xb, yb):
        built.loss_fn(net(xb), yb).backward()
        opt.step()
        opt.zero_grad()

    with offload(net, opt, budget="50%") as run:
        step(x, y)
        step(x, y)  # profiled, planned
        # (a second forward and backward before the step, same shapes: departs from the
        # trace where the trace has the optimizer; a batch of another shape would be a
        # new signature, planned on its own: runtime/signatures.py)
        built.loss_fn(net(x), y).backward()
        step(x, y)
        assert run.stats.stale_plans >= 1
        assert run.stats.outside_handler_s is None


ZERO = {"reduce_bucket_size": 20000}  # (as tests/test_runtime_host_step.py)


def test_a_host_step_plan_is_re_timed_and_its_steps_cost_their_measured_issue():
    net, opt, step = _gpt_tiny()
    with offload(net, opt, budget="95%", policy="zero_offload", policy_options=ZERO) as run:
        for _ in range(2 + RETIMED):
            step()
        st, hw = run.stats, run.hardware
        assert run.plan.host_steps and st.host_steps > 0
        assert st.outside_handler_s is not None and st.predicted_step_time_s != st.predicted_step_time_s_at_plan
        # the optimizer's fixed cost per host step, measured at the plan (a scratch
        # parameter through the same proxy the host steps use)
        assert 0 < hw.host_step_issue_s < 0.05
        assert hw.host_step_issue_s == run._host_costs.host_step_issue_s


def test_a_recompute_plan_charges_its_replays_as_measured():
    net, opt, step = _gpt_tiny()
    with offload(net, opt, budget=None, policy="checkpoint", policy_options={"always": True}) as run:
        for _ in range(2 + RETIMED):
            step()
        assert run.plan.recomputes and run.stats.recomputed_ops > 0
        # per replayed op, beyond the op: the replay and the forward's recording and
        # drops, each timed iteration's, their median (not the probe's scratch chains)
        # (each sample is a difference of measured times, clamped at 0: on a loaded
        # machine the forward's own op times can exceed the replay's, so no verdict on
        # its size; the prediction must use these samples, not the probe's figure)
        samples = run._retimer.replay_samples
        assert len(samples) == RETIMED and all(x >= 0 for x in samples)
        assert run.hardware.recompute_issue_s == sorted(samples)[RETIMED // 2]
