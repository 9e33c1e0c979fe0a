"""Recompute chains executed in real training (tierflow.runtime.recompute): activations
dropped after their last forward use and re-made before backward, bitwise equal to
plain PyTorch, dropout's random masks and BatchNorm's running statistics included."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import assert_training_equal
from tierflow.runtime import offload, train

MODELS = ("gpt-tiny", "bert-tiny", "vit-tiny", "resnet-tiny")


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


@pytest.mark.parametrize("policy", ["checkpoint", "selective"])
@pytest.mark.parametrize("model", MODELS)
def test_block_recompute_is_bitwise(model, policy):
    """Every block (the model's, from the runtime trace's scopes) recomputed."""
    res = train(model, budget=None, steps=20, policy=policy, check_parity=True, policy_options={"always": True})
    assert res.parity, res.parity_detail  # losses, gradients, parameters, optimizer state, buffers
    s = res.stats
    assert res.run.plan.recomputes and s.recomputed_ops > 0 and s.dropped_bytes > 0
    assert s.skipped_drops == 0 and s.early_recomputes == 0 and s.stale_plans == 0


@pytest.mark.parametrize("model", ["gpt-tiny", "bert-tiny"])
def test_checkpoint_at_90pct_plans_and_keeps_the_budget(model):
    """(Tighter budgets on these models are below what keeping every parameter and all
    optimizer state on the device needs: checkpointing alone cannot reach them.)"""
    res = train(model, budget="90%", steps=20, policy="checkpoint", check_parity=True)
    assert res.parity, res.parity_detail
    s = res.stats
    assert s.plan_error is None and s.policy == "checkpoint" and s.recomputed_ops > 0
    assert s.peak_device_bytes <= s.budget_bytes and s.stale_plans == 0


class DropNorm(nn.Module):
    """An MLP with dropout (p > 0) and training-mode BatchNorm in every block."""

    def __init__(self, width=256, depth=6):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.2))
            for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _dropnorm_run(steps, budget=None, policy=None, **kw):
    torch.manual_seed(0)
    net = DropNorm()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    # (each batch made when used, as a loader would: in CPU mode a dataset kept in a list
    # would count as device memory)
    data = ((torch.randn(512, 256, generator=g), torch.randint(0, 10, (512,), generator=g)) for _ in range(steps))
    torch.manual_seed(123)  # the dropout masks' stream, the same for both runs
    losses, grads = [], []
    run = offload(net, opt, budget=budget, policy=policy, **kw) if policy else None
    if run is not None:
        run.__enter__()
    try:
        for x, y in data:
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            with (run.untracked() if run is not None else torch.no_grad()):
                grads.append([p.grad.clone() for p in net.parameters()])
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        if run is not None:
            run.__exit__(None, None, None)
    return net, opt, losses, grads, run


def _assert_bitwise(a, b):
    assert_training_equal(a, b)  # (BatchNorm's running statistics: updated once per step)


def test_dropout_and_batchnorm_under_checkpoint_at_a_budget():
    ref = _dropnorm_run(20)
    got = _dropnorm_run(20, budget="70%", policy="checkpoint")
    _assert_bitwise(got, ref)
    s = got[-1].stats
    assert got[-1].plan.policy == "checkpoint" and got[-1].plan.recomputes, s.plan_error
    assert s.recomputed_ops > 0 and s.stale_plans == 0
    assert s.peak_device_bytes <= s.budget_bytes


def test_a_dropped_tensor_needed_early_is_remade_on_the_spot(monkeypatch):
    """No chain is re-made at its planned op (as if the plan were wrong): backward's ops
    need the dropped activations first, and each chain is re-made when one asks."""
    from tierflow.runtime.recompute import Recomputer

    for_plan = Recomputer.for_plan

    def never_planned(self, trace, plan):
        rc = for_plan(self, trace, plan)
        rc.remakes = [()] * trace.n_ops
        return rc

    monkeypatch.setattr(Recomputer, "for_plan", never_planned)
    ref = _dropnorm_run(6)
    got = _dropnorm_run(6, policy="checkpoint", policy_options={"always": True})
    _assert_bitwise(got, ref)
    s = got[-1].stats
    assert s.early_recomputes > 0 and s.recomputed_ops > 0


def test_checkpoint_fits_where_hf_gradient_checkpointing_does():
    """A Hugging Face GPT-2 under ``policy="checkpoint"`` at the peak its own
    ``gradient_checkpointing_enable()`` reaches: the plan's chains let go of their
    temporaries after their last read, as torch.utils.checkpoint's re-run forward does,
    so the plan fits there (it fell back to the reactive pager when a chain's
    temporaries were counted until it ended: 3.43 MiB planned against 2.91)."""
    pytest.importorskip("transformers")
    from helpers import load_benchmark

    w = load_benchmark("gpu_suite").hf_gpt2(torch.device("cpu"), tiny=True)
    run, peak, before = _checkpoint_at_the_peers_peak(w)
    s = run.stats
    assert s.plan_error is None and s.policy == "checkpoint", s.plan_error
    assert s.recomputed_ops > 0 and s.planned_steps == 3
    assert (s.stalls, s.unplanned_evictions) == before, s.departures  # none in a planned step
    assert s.peak_device_bytes <= peak


def _checkpoint_at_the_peers_peak(w):
    """``w`` (a gpu_suite workload) under ``policy="checkpoint"`` at the peak its own
    checkpointing reaches: ``(run, that peak, (stalls, unplanned evictions) before the
    planned steps)``; a warm-up, the profiled step, then 3 planned steps."""
    from helpers import load_benchmark

    suite = load_benchmark("gpu_suite")
    model, opt = w.build()
    w.checkpoint(model)
    step = suite.make_step(w, model, opt)
    for i in range(2):
        step(i)
    peak = suite.cpu_step_peak(model, opt, lambda: step(0), w.batch(0))
    model, opt = w.build()
    step = suite.make_step(w, model, opt)
    with offload(model, opt, budget=peak, policy="checkpoint") as run:
        for i in range(2):  # (under the reactive pager)
            step(i)
        before = (run.stats.stalls, run.stats.unplanned_evictions)
        for i in range(2, 5):
            step(i)
    return run, peak, before


def test_checkpoint_fits_where_torch_utils_checkpoint_does():
    """gpt-tiny under ``policy="checkpoint"`` at the peak of ``torch.utils.checkpoint``
    around each block: no room made beyond the plan. (It made some twice: for a replayed
    view's result, its argument's storage; for temporaries the replay had let go; and,
    at the op a chain runs before, for the inputs the chain had just re-made.)"""
    from helpers import load_benchmark

    w = load_benchmark("gpu_suite").zoo_model("gpt-tiny", 4, 32, torch.device("cpu"))
    run, peak, before = _checkpoint_at_the_peers_peak(w)
    s = run.stats
    assert s.policy == "checkpoint" and s.planned_steps == 3 and s.recomputed_ops > 0
    assert (s.stalls, s.unplanned_evictions) == before, s.departures
    assert s.peak_device_bytes <= peak
