"""The plan being followed is one record (runtime/followed_plan.py): the run's plan
attributes are its fields, the plan cache keeps and hands back the record itself, and a
plan that cannot be made leaves the one followed until then whole."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from torch import nn

from tierflow.runtime import OffloadError, offload
from tierflow.runtime.followed_plan import FollowedPlan

# the fields Run keeps without a leading underscore (the rest are ``_<field>``)
PUBLIC = {"trace", "plan", "hardware", "prediction"}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


def _fixed_hw():
    from tierflow.synthetic import toy_hardware

    return toy_hardware(10.0, 64)


def _setup():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    return net, torch.optim.Adam(net.parameters(), lr=1e-3)


def _step(net, opt, x) -> None:
    opt.zero_grad()
    net(x).pow(2).mean().backward()
    opt.step()


def _batches(sizes: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(n, 16, generator=g) for n in sizes]


def _attr(name: str) -> str:
    return name if name in PUBLIC else f"_{name}"


def test_every_field_of_the_followed_plan_is_the_runs_attribute():
    net, opt = _setup()
    data = _batches([4, 4, 4, 4])
    with offload(net, opt, budget=40_000, hardware=_fixed_hw()) as run:
        for x in data:
            _step(net, opt, x)
    fp = run._followed
    assert isinstance(fp, FollowedPlan) and run.stats.planned_steps >= 2
    for f in fields(FollowedPlan):
        assert getattr(run, _attr(f.name)) is getattr(fp, f.name), f.name


def test_a_returning_signature_follows_the_record_the_cache_kept():
    net, opt = _setup()
    sizes = [4, 4, 8, 4, 8]
    data = _batches(sizes)
    with offload(net, opt, budget=40_000, hardware=_fixed_hw()) as run:
        records = {}
        for n, x in zip(sizes, data):
            _step(net, opt, x)
            records.setdefault(n, run._followed)
        cache = run._plans
        assert run._followed is cache.plans[cache.current].state
        assert records[4] is not records[8]
    assert run.stats.signature_hits == 2 and run.stats.plans_by_reason == {"first": 1, "new signature": 1}


def test_a_plan_that_cannot_be_fitted_leaves_the_followed_plan_whole(monkeypatch):
    from tierflow.runtime.follow import PlanFollowing

    net, opt = _setup()
    data = _batches([4, 4, 4, 8, 8])
    run = offload(net, opt, budget=40_000, hardware=_fixed_hw())
    with pytest.raises(OffloadError, match="no room"):
        with run:
            for x in data[:3]:
                _step(net, opt, x)
            before = run._followed
            assert before is not None

            def refuse(self, trace, plan, hw, layout):
                raise OffloadError("offload: no room (test)")

            monkeypatch.setattr(PlanFollowing, "_fit_tiers", refuse)
            for x in data[3:]:  # a new signature: profiled, its plan refused
                _step(net, opt, x)
    assert run._followed is before
    for f in fields(FollowedPlan):
        assert getattr(run, _attr(f.name)) is getattr(before, f.name), f.name


def test_the_first_plan_starts_its_ssd_tensors_on_the_ssd(tmp_path):
    """The start state's tiers come from the plan's own machine model: ZeRO-Infinity with
    ``device="nvme"`` starts its persistent tensors on the SSD from the first plan (they
    were looked up in the previous plan's machine model, none at the first: "host")."""
    from tierflow.capture import zoo

    m = zoo.build("mlp-tiny", seed=0)
    x, y = m.make_batch(4)
    opt = torch.optim.AdamW(m.model.parameters(), lr=1e-3)
    with offload(m.model, opt, budget="60%", policy="zero_infinity", ssd_dir=str(tmp_path),
                 policy_options={"reduce_bucket_size": 1000, "device": "nvme"},
                 hardware="h100-80g-pcie5-nvme") as run:
        for _ in range(3):
            m.loss_fn(m.model(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert run.stats.plan_error is None and run.stats.replans == 1
        assert run._start_away and set(run._start_away.values()) == {"ssd"}
