"""Planned iterations do what their plan says: the runtime's trace counts memory as
PyTorch holds it (a tensor is freed when its last reference goes, not at its last use:
``TensorInfo.held_until``; the batch the loop made before the iteration is there from op
0 and is not the executor's to move: ``TensorInfo.external``), what the loop holds beside
the iteration is a reserve the plan keeps free, and the on-demand fetches of a planned
step stay within what the simulator predicts for its plan, on the three tiny zoo models
and two models outside the zoo (``benchmarks/outside_models.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from helpers import load_benchmark
from tierflow.errors import PlanError, TraceError
from tierflow.hardware import Compute, Hardware, Link, Tier
from tierflow.plan import Move, Plan, validate
from tierflow.runtime import BudgetError, offload
from tierflow.simulate import simulate
from tierflow.trace import Op, TensorInfo, Trace

outside = load_benchmark("outside_models")
MODELS = ("gpt-tiny", "bert-tiny", "vit-tiny", *outside.NAMES)


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


_build = outside.any_model


# -- the trace: held_until and external ------------------------------------------------------


def _three_op_trace(**a_fields) -> Trace:
    # tensor 0 made at op 0 and used at op 1; tensor 1 the batch, first read at op 2
    ops = [Op("make", "forward", 1e-3, (), (0,)), Op("use", "forward", 1e-3, (0,), (2,)),
           Op("late", "forward", 1e-3, (1, 2), (3,))]
    tensors = [TensorInfo(0, 100, "activation", **a_fields), TensorInfo(1, 1000, "input", external=True),
               TensorInfo(2, 10, "temporary"), TensorInfo(3, 10, "temporary")]
    return Trace(ops, tensors, name="t")


def test_held_until_keeps_a_tensor_in_memory_past_its_last_use():
    plain, held = _three_op_trace(), _three_op_trace(held_until=2)
    assert int(plain.death[0]) == 1 and int(held.death[0]) == 2
    assert int(held.live_bytes[2] - plain.live_bytes[2]) == 100


def test_an_external_tensor_is_in_memory_from_op_0_and_has_no_gaps():
    trace = _three_op_trace()
    assert int(trace.birth[1]) == 0
    assert all(int(x) >= 1000 for x in trace.live_bytes)
    assert not [g for g in trace.gaps if g.tensor == 1]


def test_held_until_and_external_survive_json_and_bad_values_are_named():
    trace = _three_op_trace(held_until=2)
    back = Trace.from_dict(trace.to_dict())
    assert back.tensors[0].held_until == 2 and back.tensors[1].external
    assert not back.tensors[2].external and back.tensors[2].held_until is None
    with pytest.raises(TraceError, match="tensor 0: field 'held_until' is 7"):
        _three_op_trace(held_until=7)


def _hw(device_bytes: float) -> Hardware:
    return Hardware("t", "gpu", (Tier("gpu", "device", device_bytes), Tier("host", "host", 1e9)),
                    (Link("d2h", "gpu", "host", 1e9), Link("h2d", "host", "gpu", 1e9)), Compute(1e12, 1e12, 1e11))


def test_a_plan_that_moves_an_external_tensor_fails_validation():
    trace = _three_op_trace()
    plan = Plan("p", (Move("evict", 1, 0, "host"), Move("prefetch", 1, 0, "host", needed_by=2)))
    with pytest.raises(PlanError, match="external"):
        validate(plan, trace, _hw(1e6))


def test_the_simulator_holds_an_external_tensor_from_the_iteration_s_start():
    trace = _three_op_trace()
    unflagged = Trace(trace.ops, tuple(TensorInfo(t.id, t.bytes, t.kind) for t in trace.tensors), name="t")
    got = simulate(trace, _hw(1e6), Plan("none"))
    # at op 0 the batch (1000 bytes) is already there beside tensor 0's 100
    times, used = got.memory["gpu"]
    assert used[np.searchsorted(times, got.op_end_s[0], side="right") - 1] >= 1100
    # as the trace counts it; unflagged, the batch came at op 2, after tensor 0 had died
    assert got.peak_bytes["gpu"] == trace.peak_live_bytes == 1110
    assert simulate(unflagged, _hw(1e6), Plan("none")).peak_bytes["gpu"] == unflagged.peak_live_bytes == 1020


# -- the runtime's trace ----------------------------------------------------------------------


class _HoldsALocal(nn.Module):
    """``h`` is read by the ReLU only, but the local keeps it until forward returns."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 8)

    def forward(self, x):
        h = self.a(x)
        y = self.b(torch.relu(h))
        return self.c(torch.relu(y))


def test_the_runtime_s_trace_holds_a_local_until_pytorch_frees_it():
    torch.manual_seed(0)
    model = _HoldsALocal()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 64), torch.randn(32, 8)
    with offload(model, opt, budget=None) as run:
        for _ in range(3):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    trace = run.trace
    ops = [o.name for o in trace.ops]
    first_mm = ops.index("aten::addmm")
    h = trace.ops[first_mm].outputs[0]
    last_forward_mm = max(i for i, o in enumerate(trace.ops) if o.name == "aten::addmm" and o.phase == "forward")
    assert int(trace.last_use[h]) < last_forward_mm <= trace.tensors[h].held_until
    batch = [t for t in trace.tensors if t.kind == "input"]
    assert batch and all(t.external and t.held_until == trace.n_ops - 1 for t in batch)
    assert all(t.held_until is None for t in trace.tensors if t.kind == "gradient")


# -- planned steps follow the plan ------------------------------------------------------------


follow_plan = load_benchmark("follow_plan")


def _planned(name: str, budget: str) -> dict:
    """benchmarks/follow_plan.py's count: per planned step (the first after each plan
    left out: it starts from the profile's residency), its on-demand fetches; the plan."""
    return follow_plan.measure(name, budget, steps=8, batches=2, outside=outside)


@pytest.mark.parametrize("budget", ["50%", "30%"])
@pytest.mark.parametrize("name", MODELS)
def test_on_demand_fetches_per_planned_step_stay_within_the_prediction(name, budget):
    r = _planned(name, budget)
    assert r["fetches"], f"{name} at {budget}: no planned step to measure ({r['policy']}, {r['plan_error']})"
    assert r["reactive"] is False and r["plan_error"] is None
    allowed = r["predicted_faults"] + max(1, r["moves"] // 100)
    assert max(r["fetches"]) <= allowed, r
    assert r["peak_over_budget"] <= 1


def test_departures_are_counted_by_reason():
    r = _planned("vit-tiny", "30%")
    d = r["departures"]
    assert all(k.split(":")[0] in ("on-demand fetch", "eviction", "late prefetch", "skipped move") for k in d)
    # (gradients live until zero_grad, past their last use, which the plan counts free)
    assert d.get("eviction: a gradient held past its last use, for a planned prefetch", 0) > 0
    fetched = sum(v for k, v in d.items() if k.startswith("on-demand fetch"))
    assert fetched <= r["stalls"]


# -- what the loop holds ----------------------------------------------------------------------


def _hold_batches(budget: str, batches: int, steps: int, *, made_inside: bool = True):
    model, make_batch, loss_fn = outside.build("unet-mini")
    opt = torch.optim.AdamW(model.parameters())
    kept = [] if made_inside else [make_batch(i) for i in range(batches)]
    with offload(model, opt, budget=budget) as run:
        for k in range(steps):
            if len(kept) < batches:  # the loop makes a batch and keeps it
                kept.append(make_batch(k))
            x, y = kept[k % batches]
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return run


def test_batches_the_loop_keeps_are_a_reserve_the_plan_keeps_free():
    run = _hold_batches("50%", 4, 9)
    s = run.stats
    one_batch = sum(t.numel() * t.element_size() for t in outside.build("unet-mini")[1](0))
    # the loop met a new batch in each of its first iterations: planned again as it grew
    assert s.held_replans >= 1 and s.held_device_bytes >= 3 * one_batch
    assert s.planned_steps >= 2 and s.peak_device_bytes_planned <= s.budget_bytes
    assert run.plan.budget_bytes <= s.budget_bytes - 3 * one_batch


def test_a_budget_the_kept_batches_leave_too_small_is_refused_naming_them():
    with pytest.raises(BudgetError, match="the loop holds beside the iteration"):
        _hold_batches("30%", 4, 9)


def test_batches_made_before_the_block_are_not_the_budget_s():
    # as torch.cuda.max_memory_allocated less what was allocated when the block opened
    run = _hold_batches("30%", 4, 9, made_inside=False)
    s = run.stats
    assert s.held_device_bytes == 0 and s.held_replans == 0
    assert s.planned_steps >= 6 and s.peak_device_bytes_planned <= s.budget_bytes
    assert all(t.bytes == 0 for t in run.trace.tensors if t.external and t.kind == "input")


# -- memory outside the runtime's tensors, before a plan keeps it free -------------------------


def test_untracked_device_memory_counts_against_a_byte_budget_from_the_first_forward(monkeypatch):
    # CUDA's figure (memory_allocated less the tracked storages: cuBLAS's workspaces, the
    # allocator's rounding) stood in for by a constant: the warm-up and profiled
    # iterations keep the tracked bytes below the budget less it, as a plan then does
    from tierflow.runtime.executor import Run

    model, make_batch, loss_fn = _build("gpt-tiny")
    budget = 1_400_000
    extra = 200_000
    monkeypatch.setattr(Run, "_untracked_now", lambda self: extra)
    opt = torch.optim.AdamW(model.parameters())
    x, y = make_batch(0)
    with offload(model, opt, budget=budget, policy="lru") as run:
        for _ in range(2):  # warm-up and profile: no plan yet
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert run.stats.profiled_steps == 2 and run.stats.planned_steps == 0
    assert 0.8 * (budget - extra) < run.stats.peak_device_bytes <= budget - extra
