"""foreach and fused optimizers under a budget their whole state exceeds: the step runs in
parameter chunks (tierflow.runtime.optim_chunks), bitwise equal to plain PyTorch."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_training_equal
from tierflow.capture import zoo
from tierflow.runtime import BudgetError, offload, train

OPTIMIZERS = {
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "sgd-foreach": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
}
STEPS = 8


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def _train(make_opt, budget=None, steps=STEPS, sched=False, **kw):
    """gpt-tiny for ``steps`` steps; under ``offload`` when a budget is given. Returns
    model, optimizer, losses, every step's gradients, the learning rates, the run."""
    m = zoo.build("gpt-tiny", seed=0)
    x, y = m.make_batch(4)
    opt = make_opt(m.model.parameters())
    lr_sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if sched else None
    losses, grads, lrs = [], [], []
    run = offload(m.model, opt, budget=budget, **kw) if budget is not None else None
    if run is not None:
        run.__enter__()
    try:
        for _ in range(steps):
            loss = m.loss_fn(m.model(x), y)
            loss.backward()
            if run is not None:
                with run.untracked():
                    grads.append([p.grad.clone() for p in m.model.parameters()])
            else:
                grads.append([p.grad.clone() for p in m.model.parameters()])
            opt.step()
            opt.zero_grad()
            if lr_sched is not None:
                lr_sched.step()
                lrs.append(opt.param_groups[0]["lr"])
            losses.append(loss.item())
    finally:
        if run is not None:
            run.__exit__(None, None, None)
    return m.model, opt, losses, grads, lrs, run


def _assert_same(a, b):
    assert_training_equal(a, b)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_multi_tensor_step_fits_a_30pct_budget_bitwise(name, tmp_path):
    ref = _train(OPTIMIZERS[name])
    got = _train(OPTIMIZERS[name], budget="30%", ssd_dir=str(tmp_path))
    _assert_same(got, ref)
    s = got[-1].stats
    assert s.optimizer_chunks > 1
    assert s.planned_steps >= 3 and s.stale_plans == 0
    assert s.peak_device_bytes <= s.budget_bytes
    assert sum(s.moved_bytes.values()) > 0


def test_chunks_spill_through_the_ssd_bitwise(tmp_path):
    """A host pool too small for the moves: chunked steps with state on the SSD."""
    ref = _train(OPTIMIZERS["adamw-foreach"], steps=5)
    got = _train(OPTIMIZERS["adamw-foreach"], budget="30%", steps=5, ssd_dir=str(tmp_path), host_bytes="256KiB")
    _assert_same(got, ref)
    s = got[-1].stats
    assert s.moved_bytes["ssd"] > 0 and s.peak_device_bytes <= s.budget_bytes


def test_state_dict_and_lr_scheduler_are_the_users():
    make = OPTIMIZERS["adamw-foreach"]
    ref = _train(make, sched=True, steps=6)
    got = _train(make, budget="30%", sched=True, steps=6)
    _assert_same(got, ref)
    assert got[4] == ref[4]  # the learning rates a StepLR set, step by step
    opt = got[1]
    assert "_wrapped_by_lr_sched" in opt.step.__dict__  # the scheduler's own wrapper is back
    sd = opt.state_dict()
    fresh = make(got[0].parameters())
    fresh.load_state_dict(sd)
    for p in got[0].parameters():
        for k, v in opt.state[p].items():
            assert torch.equal(fresh.state[p][k], v)


def test_an_error_inside_the_step_leaves_the_groups_intact():
    m = zoo.build("gpt-tiny", seed=0)
    x, y = m.make_batch(4)
    opt = OPTIMIZERS["adamw-foreach"](m.model.parameters())
    groups, params = opt.param_groups, list(opt.param_groups[0]["params"])
    with offload(m.model, opt, budget="30%") as run:
        for _ in range(3):
            m.loss_fn(m.model(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert run._chunker.cap is not None

        def boom(o, args, kwargs):
            assert len(o.param_groups) > 1  # the chunk groups are in place
            raise RuntimeError("boom")

        h = opt.register_step_pre_hook(boom)
        m.loss_fn(m.model(x), y).backward()
        with pytest.raises(RuntimeError, match="boom"):
            opt.step()
        h.remove()
    assert opt.param_groups is groups and opt.param_groups[0]["params"] == params


def test_no_budget_no_chunks():
    got = _train(OPTIMIZERS["adamw-foreach"], budget=None, steps=3)
    assert got[-1] is None  # (plain run: nothing wrapped)
    m = zoo.build("gpt-tiny", seed=0)
    x, y = m.make_batch(4)
    opt = OPTIMIZERS["adamw-fused"](m.model.parameters())
    with offload(m.model, opt) as run:
        for _ in range(3):
            m.loss_fn(m.model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert run._chunker.cap is None and run.stats.optimizer_chunks == 0
    assert "step" not in opt.__dict__


def test_a_parameter_larger_than_the_budget_is_still_refused():
    m = zoo.build("gpt-tiny", seed=0)
    x, y = m.make_batch(4)
    opt = OPTIMIZERS["adamw-foreach"](m.model.parameters())
    with pytest.raises(BudgetError, match="minimum working set"):
        with offload(m.model, opt, budget="2%"):
            for _ in range(3):
                m.loss_fn(m.model(x), y).backward()
                opt.step()
                opt.zero_grad()


def test_train_accepts_the_multi_tensor_optimizers():
    res = train("gpt-tiny", budget="30%", steps=5, optimizer="sgd-foreach", check_parity=True)
    assert res.parity, res.parity_detail
    assert res.stats.optimizer_chunks > 1


@pytest.mark.parametrize("kind", ["adamw-foreach", "adamw-fused"])
def test_a_byte_budget_chunks_the_first_step_too(kind):
    """A budget in bytes is known before the first step, whose state does not exist yet:
    the chunk size counts the state that step makes, so every step, the first included,
    stays within the budget (gpt-tiny: 2.26 MiB of parameters, gradients and moments)."""
    budget = int(2.5 * 2**20)
    plain = _train(OPTIMIZERS[kind])
    model, opt, losses, grads, lrs, run = _train(OPTIMIZERS[kind], budget=budget, policy="lru")
    _assert_same(plain, (model, opt, losses, grads, lrs, run))
    assert run.stats.peak_device_bytes <= budget
    assert run.stats.optimizer_chunks > 1
