"""The runtime's own cost per op in the CPU-mode hardware model
(:mod:`tierflow.runtime.host_costs`): measured at the first plan, charged by the
simulator to every op, and measured without leaving a trace on the run."""

from __future__ import annotations

import math

import pytest
import torch

from tierflow import offload
from tierflow.capture import zoo
from tierflow.runtime.host_costs import measure_host_costs

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def _gpt_tiny():
    built = zoo.build("gpt-tiny", seed=0)
    opt = torch.optim.AdamW(built.model.parameters(), lr=1e-3, foreach=False)
    x, y = built.make_batch(zoo.spec("gpt-tiny").batch, None)

    def step() -> float:
        loss = built.loss_fn(built.model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return built.model, opt, step


def test_cpu_mode_prediction_charges_every_op_the_measured_cost():
    net, opt, step = _gpt_tiny()
    with offload(net, opt, budget=None) as run:
        for _ in range(2):  # (a warm-up, then the profiled step that plans)
            step()
    hw, sim = run.hardware, run.prediction
    assert hw is not None and sim is not None and not hw.async_launch and hw.host_copies
    # (sanity bounds only, 100x what an unloaded machine measures)
    assert 0 < hw.op_issue_s < 1e-2 and 0 < hw.recompute_issue_s < 1e-1
    # nothing is planned without a budget: the step is its ops, each with its cost
    assert not run.plan.moves and not run.plan.recomputes and not run.plan.host_steps
    assert math.isclose(sim.host_wait_s, run.trace.n_ops * hw.op_issue_s, rel_tol=1e-9)
    assert math.isclose(run.stats.predicted_step_time_s, run.trace.ideal_s + sim.host_wait_s, rel_tol=1e-9)


def test_measuring_leaves_the_run_as_it_was():
    net, opt, step = _gpt_tiny()
    with offload(net, opt, budget="60%") as run:
        for _ in range(3):
            step()
        run._reap()
        before = (run.stats.to_dict(), run._ledger.used, run._ledger.peak, set(run._entries), run._optab, run._n_ops,
                  run._recomputer, run._recomputer.chains, run.budget, run._quiet, run._fast)
        costs = measure_host_costs(run, ops=8, rounds=2)
        run._reap()
        after = (run.stats.to_dict(), run._ledger.used, run._ledger.peak, set(run._entries), run._optab, run._n_ops,
                 run._recomputer, run._recomputer.chains, run.budget, run._quiet, run._fast)
        assert costs.op_issue_s > 0 and costs.recompute_issue_s > 0
        assert after == before
        for _ in range(2):  # the plan is still followed
            step()
    assert run.stats.stale_plans == 0 and run.stats.planned_steps >= 3
