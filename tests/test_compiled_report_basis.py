"""GraphReport's trace peak and planned peak have one basis: the graph's own ops on its
partition's trace (issue 30). The plan's curve, with the loss's estimate and the other
graphs' terms its target is set on, is a field of its own (``plan_peak_bytes``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tierflow.compiled as tc
from test_compiled_frontend import planned, train
from tierflow.compiled.prefetch import offloaded_curve


@pytest.fixture(scope="module")
def at_30():
    return train(planned("30%", recompute=False), steps=1)[2]


def test_without_a_plan_the_planned_peak_is_the_trace_peak():
    torch._dynamo.reset()
    torch.manual_seed(0)
    # logits to the caller: the plan's curve adds the loss's estimated working set
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 512))
    with tc.compile(model, budget=None, backend="aot_eager") as run:
        run.model(torch.randn(1024, 16)).pow(2).mean().backward()
    (g,) = run.stats.compiled_graphs
    assert g["predicted_peak_bytes_planned"] == g["predicted_peak_bytes"] < g["plan_peak_bytes"]


def test_the_planned_peak_is_the_real_partition_with_its_offloads_and_moved_gradients(at_30):
    (rec,) = at_30.records
    (g,) = at_30.stats.compiled_graphs
    assert g["offloaded"] > 0 and rec.grads_offloaded and not any(rec.prefetch_ops.values())
    saved = {s.name: s for s in rec.real.saved}
    grads = {s.name: s for s in rec.real.grads}
    moved = [saved[n] for n in rec.offloaded] + [grads[n] for n in rec.grads_offloaded]
    recount = offloaded_curve(rec.real, moved)  # (prefetch.py's: a second count of the same curve)
    assert g["predicted_peak_bytes_planned"] == int(recount.max()) < g["predicted_peak_bytes"]


def test_the_plans_own_curve_meets_its_target(at_30):
    (g,) = at_30.stats.compiled_graphs
    assert g["plan_peak_bytes"] == at_30.records[0].plan.predicted_peak_bytes
    assert g["plan_peak_bytes"] <= g["target_bytes"] or g["unreachable"]


def test_a_moved_tangent_is_off_the_planned_peak():
    from test_compiled_tangents import _skip_train

    run = _skip_train("30%")[2]
    (rec,) = run.records
    (g,) = run.stats.compiled_graphs
    assert rec.tangents_moved and g["tangents_moved"] == 1
    # a recount on the real partition's curve: saved tensors and gradients moved inside
    # their gaps, the received gradient between its readers and after its last one
    real, curve = rec.real, rec.real.curve.copy()
    for s in {s.tensor: s for s in real.saved if s.name in rec.offloaded}.values():
        curve[s.last_fwd_use + 1 : s.first_bwd_use] -= s.bytes
    for s in real.grads:
        if s.name in rec.grads_offloaded:
            curve[s.last_fwd_use + 1 : s.first_bwd_use] -= s.bytes
    held = int(curve.max())
    (t,) = [t for t in real.tangents if t.name in rec.tangents_moved]
    curve[t.last_early_use + 1 : t.first_late_use] -= t.bytes
    curve[t.last_use + 1 :] -= t.bytes
    assert g["predicted_peak_bytes_planned"] == int(curve.max()) < held


def test_the_floor_takes_a_storage_group_off_whole_and_is_no_higher_than_the_planned_peak():
    from test_compiled_floor import _train as train_qkv
    from tierflow.compiled.plan import floor_curve

    run = train_qkv("10%", steps=1)[2]
    (rec,) = run.records
    (g,) = run.stats.compiled_graphs
    groups = {s.group for s in rec.real.saved if s.group}
    assert groups and g["offloaded"] > 0
    # every view of an offloaded group leaves with it: the floor (all movable moved) is
    # at most what the plan left (HF GPT-2 4L: 94.3 MiB against 78.3 with the first view's alone)
    assert g["floor_bytes"] == int(floor_curve(rec.real).max()) <= g["predicted_peak_bytes_planned"]
