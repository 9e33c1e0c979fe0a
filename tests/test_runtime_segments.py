"""Ticks and segments (runtime/segments.py): the profiled iteration logs the points a
hook-driven follower could act at, and the trace coarsened to them keeps every tensor's
life, moves nothing a tick cannot reach, and plans within the budget."""

from __future__ import annotations

import pytest
import torch

import tierflow
from tierflow.capture import zoo
from tierflow.hardware import load_hardware
from tierflow.plan import validate
from tierflow.policies import make_plan
from tierflow.runtime.segments import coarsen
from tierflow.simulate import simulate

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


@pytest.fixture(scope="module")
def profiled():
    torch.manual_seed(0)
    built = zoo.build("gpt-tiny")
    x, y = built.make_batch(4)
    model = built.model.train()
    opt = torch.optim.AdamW(model.parameters())
    with tierflow.offload(model, opt) as run:
        for _ in range(2):  # warm-up, profiled
            built.loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return run.trace


def test_the_profiled_trace_has_its_ticks(profiled):
    ticks = profiled.meta["ticks"]
    kinds = {k for _op, k, _i in ticks}
    assert kinds == {"enter", "leave", "pack", "unpack", "grad"}
    assert all(0 <= op <= profiled.n_ops for op, _k, _i in ticks)
    assert [op for op, *_ in ticks] == sorted(op for op, *_ in ticks)  # logged in time order
    keys = {t.key for t in profiled.tensors}
    packed = [i for _op, k, i in ticks if k == "pack"]
    # every saved activation of the trace was handed over by a pack tick
    assert {k for k in keys if k and k.startswith("saved:")} <= {f"saved:{i}" for i in packed}
    phases = {profiled.ops[min(op, profiled.n_ops - 1)].phase for op, k, _i in ticks if k == "unpack"}
    assert phases == {"backward"}


def test_coarsening_keeps_tensors_and_lives_and_moves_only_what_ticks_reach(profiled):
    co = coarsen(profiled)
    tr = co.trace
    assert tr.n_tensors == profiled.n_tensors and co.n_segments < profiled.n_ops
    assert list(co.segment_of) == sorted(co.segment_of)
    assert tr.ideal_s == pytest.approx(profiled.ideal_s)
    # a segment holds what its ops held at once, or more: never less
    assert tr.peak_live_bytes >= profiled.peak_live_bytes
    for t in range(profiled.n_tensors):  # each life maps to the segments of its ends
        assert tr.first_use[t] == co.segment_of[profiled.first_use[t]]
        assert tr.last_use[t] == co.segment_of[profiled.last_use[t]]
    gapped = {g.tensor for g in tr.gaps if not g.wraps}
    assert not gapped & co.unreachable
    for g in tr.gaps:
        if g.tensor in co.bound_at and not g.wraps:
            assert g.after_op >= co.bound_at[g.tensor]  # moved only once a tick handed it over
    assert co.unreachable and co.bound_at


@pytest.mark.parametrize("share", [0.5, 0.3])
def test_a_plan_from_the_coarse_trace_fits_the_budget(profiled, share):
    co = coarsen(profiled)
    hw = load_hardware("h100-80g-pcie5-nvme")
    budget = int(share * profiled.peak_live_bytes)
    plan = make_plan("tierflow", co.trace, hw, budget=budget)
    validate(plan, co.trace, hw)
    assert plan.moves
    assert not {m.tensor for m in plan.moves} & co.unreachable
    sim = simulate(co.trace, hw, plan)
    assert sim.peak_bytes[hw.device] <= budget
