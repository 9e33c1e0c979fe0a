"""What the steady state leaves out: tierflow's saved-tensor hooks in iterations that
follow a plan, and torch's Dynamo wrapper around the mode (the runtime keeps Dynamo out
of its frames itself). Both must leave training bitwise equal to plain PyTorch."""

from __future__ import annotations

import warnings

import pytest
import torch

import tierflow
from tierflow.capture import zoo
from tierflow.runtime import executor

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def _steps(built, opt, x, y, n):
    losses = []
    for _ in range(n):
        loss = built.loss_fn(built.model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    return losses


@pytest.fixture
def counted_hooks(monkeypatch):
    calls = {"pack": 0, "unpack": 0}
    pack, unpack = executor.Run._pack, executor.Run._unpack

    def counted_pack(self, t):
        calls["pack"] += 1
        return pack(self, t)

    def counted_unpack(self, t):
        calls["unpack"] += 1
        return unpack(self, t)

    monkeypatch.setattr(executor.Run, "_pack", counted_pack)
    monkeypatch.setattr(executor.Run, "_unpack", counted_unpack)
    return calls


@pytest.mark.parametrize("budget", [None, "60%"])
def test_followed_iterations_run_without_the_saved_tensor_hooks(counted_hooks, budget):
    a, b = zoo.build("gpt-tiny", device="cpu", seed=0), zoo.build("gpt-tiny", device="cpu", seed=0)
    x, y = a.make_batch(4, 32)
    opt_a = torch.optim.AdamW(a.model.parameters(), lr=1e-3)
    opt_b = torch.optim.AdamW(b.model.parameters(), lr=1e-3)
    with tierflow.offload(a.model, opt_a, budget=budget) as run:
        got = _steps(a, opt_a, x, y, 3)
        assert counted_hooks["pack"] > 0  # (the profile used them)
        counted_hooks.update(pack=0, unpack=0)
        got += _steps(a, opt_a, x, y, 3)
        followed = run.stats.planned_steps
    want = _steps(b, opt_b, x, y, 6)
    assert followed >= 3 and run.stats.stale_plans == 0
    assert counted_hooks == {"pack": 0, "unpack": 0}
    assert all(torch.equal(p, q) for p, q in zip(got, want))
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))


def test_user_hooks_around_the_forward_are_kept():
    """A user's own saved-tensor hooks (here ``save_on_cpu``) opened inside the block
    stay in force: tierflow's are not taken off above them, and parity holds."""
    a, b = zoo.build("gpt-tiny", device="cpu", seed=0), zoo.build("gpt-tiny", device="cpu", seed=0)
    x, y = a.make_batch(4, 32)
    opt_a = torch.optim.AdamW(a.model.parameters(), lr=1e-3)
    opt_b = torch.optim.AdamW(b.model.parameters(), lr=1e-3)
    seen = {"unpack": 0}

    def unpack(t):
        seen["unpack"] += 1
        return t

    with tierflow.offload(a.model, opt_a, budget="60%") as run:
        for _ in range(5):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
                loss = a.loss_fn(a.model(x), y)
            loss.backward()
            opt_a.step()
            opt_a.zero_grad(set_to_none=True)
    for _ in range(5):
        b.loss_fn(b.model(x), y).backward()
        opt_b.step()
        opt_b.zero_grad(set_to_none=True)
    assert seen["unpack"] > 0 and run.stats.planned_steps >= 2 and run.stats.stale_plans == 0
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))


def test_dynamo_stays_out_of_the_runtime_frames():
    """torch.compile'd code under the runtime: Dynamo is kept out of the mode's frames
    (no attempt to trace them, so no warning about what it cannot trace), and training
    is bitwise that of the same loop without tierflow."""
    assert executor._LEAN_DISPATCH  # (this torch lets the runtime skip the wrapper)
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    b = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    b.load_state_dict(a.state_dict())
    x = torch.randn(8, 16)
    f = torch.compile(lambda t: (t * 2).sin(), backend="eager")
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tierflow.offload(a, opt_a) as run:
            for _ in range(4):
                f(a(x)).sum().backward()
                opt_a.step()
                opt_a.zero_grad()
    for _ in range(4):
        f(b(x)).sum().backward()
        opt_b.step()
        opt_b.zero_grad()
    assert not [w for w in caught if "trace" in str(w.message) and "eval_frame" in str(w.message)]
    assert run.stats.planned_steps >= 1
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
