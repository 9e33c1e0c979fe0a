"""Following a plan at ticks (runtime/hook_follow.py, ``offload(follow="hooks")``): no
dispatch mode through forward and backward, the plan made from the coarsened trace,
training bitwise equal to plain PyTorch; departures and what it does not follow."""

from __future__ import annotations

import pytest
import torch

import tierflow
from tierflow.capture import zoo
from tierflow.runtime import OffloadError, train

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


@pytest.mark.parametrize("model", ["gpt-tiny", "vit-tiny"])
@pytest.mark.parametrize("budget", ["50%", "30%"])
def test_followed_at_ticks_trains_bitwise_within_the_budget(model, budget):
    res = train(model, budget=budget, steps=6, check_parity=True, follow="hooks")
    s = res.stats
    assert res.parity, res.parity_detail
    assert s.follow == "hooks" and s.planned_steps >= 3 and s.stale_plans == 0
    assert s.planned_moves > 0
    assert s.peak_device_bytes_planned <= s.budget_bytes


def test_the_dispatch_mode_is_off_through_forward_and_backward_and_back_for_the_optimizer():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    built = zoo.build("gpt-tiny")
    x, y = built.make_batch(4)
    model = built.model.train()
    opt = torch.optim.AdamW(model.parameters())
    seen = []
    with tierflow.offload(model, opt, budget="50%", follow="hooks") as run:
        for _ in range(5):
            loss = built.loss_fn(model(x), y)
            seen.append(("backward", len(_get_current_dispatch_mode_stack())))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            seen.append(("after", len(_get_current_dispatch_mode_stack())))
    assert run.stats.follow == "hooks" and run.stats.planned_steps >= 2
    # steps 0-1 are the warm-up and the profile (mode on); from step 2 the forward ran without it
    assert [n for k, n in seen if k == "backward"][2:] == [0, 0, 0]
    assert all(n == 1 for k, n in seen if k == "after")  # (back for the optimizer, and after it)
    assert _get_current_dispatch_mode_stack() == []


class _Net(torch.nn.Module):
    """Two layers, and a third its forward calls only when told to."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.extra = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64), torch.nn.Linear(64, 64)
        self.detour = False

    def forward(self, x):
        h = self.b(torch.relu(self.a(x)))
        return self.extra(h) if self.detour else h


def test_a_loop_that_departs_at_a_tick_finishes_on_the_pager_and_stays_bitwise():
    """In one iteration the model calls a module it did not call when profiled: a tick
    the profile did not have. That iteration finishes through the dispatch mode, on the
    pager; the next is profiled again; training equals plain PyTorch's."""
    import copy

    torch.manual_seed(0)
    net = _Net()
    plain = copy.deepcopy(net)
    xs = [torch.randn(32, 64, generator=torch.Generator().manual_seed(i)) for i in range(9)]

    def loop(n, opt):
        losses = []
        for i, x in enumerate(xs):
            n.detour = i == 5
            loss = n(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().clone())
        return losses

    want = loop(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    # (85%: at less, one of this toy's segments alone is over the budget, and the plan is
    # followed op by op: see the next test's kind)
    with tierflow.offload(net, opt, budget="85%", follow="hooks") as run:
        got = loop(net, opt)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), net.parameters()))
    s = run.stats
    assert any("tick" in r for r in s.stale_reasons), s.stale_reasons
    assert s.follow == "hooks" and s.planned_steps >= 3


def test_a_plan_that_recomputes_is_followed_op_by_op_and_says_why():
    res = train("gpt-tiny", budget="90%", steps=6, policy="checkpoint", follow="hooks", check_parity=True)
    assert res.parity, res.parity_detail
    # (checkpointing's blocks are not segments: on the coarse trace the policy has no
    # plan, or one that recomputes; either way the fine trace's plan is followed op by op)
    assert res.stats.follow.startswith("ops (") and res.run.plan.recomputes


def test_a_budget_below_a_segments_working_set_is_followed_op_by_op_and_says_why():
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with tierflow.offload(net, opt, budget="60%", follow="hooks") as run:
        for i in range(4):
            net(torch.randn(32, 64, generator=torch.Generator().manual_seed(i))).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert run.stats.follow.startswith("ops (a segment needs") and run.stats.planned_steps >= 1


def test_follow_must_be_ops_or_hooks():
    net = torch.nn.Linear(4, 4)
    with pytest.raises(OffloadError, match="follow='ticks'"):
        tierflow.offload(net, torch.optim.SGD(net.parameters(), lr=0.1), follow="ticks")
