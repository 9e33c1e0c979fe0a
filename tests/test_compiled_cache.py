"""The compiled front-end with torch's caches, and the forward graph's saved views.

One test compiles with inductor (the FX graph cache is inductor's); the others use
``aot_eager`` or build FX graphs by hand."""

from __future__ import annotations

import torch
from torch import fx

import tierflow.compiled as tc
from test_compiled_frontend import plain, planned, same, train
from tierflow.compiled.hook import hoist_saved_views
from tierflow.compiled.memo import PlanMemo, graph_key

aten = torch.ops.aten


def _forward_with_a_late_saved_view() -> fx.GraphModule:
    """``mm = x @ w; out = relu(mm).sum()``, returning ``out`` and a view of ``mm``
    made last, as torch's partitioner lays out a forward graph's saved views."""
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.placeholder("w")
    mm = g.call_function(aten.mm.default, (x, w))
    relu = g.call_function(aten.relu.default, (mm,))
    out = g.call_function(aten.sum.default, (relu,))
    view = g.call_function(aten.view.default, (mm, [-1]))
    g.output((out, view))
    return fx.GraphModule(torch.nn.Module(), g)


def test_saved_view_moves_next_to_its_base_and_computes_the_same():
    gm = _forward_with_a_late_saved_view()
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    before = gm(x, w)
    assert hoist_saved_views(gm, n_out=1) == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.index(aten.view.default) == targets.index(aten.mm.default) + 1
    after = gm(x, w)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_chained_and_sibling_views_all_move_up_in_a_valid_order():
    # a view of a view, and two views of one base, all made last: each lands right
    # after what it reads, the graph stays topological and computes the same
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    mm = g.call_function(aten.mm.default, (x, w))
    mm2 = g.call_function(aten.mm.default, (mm, g.call_function(aten.t.default, (w,))))
    out = g.call_function(aten.sum.default, (g.call_function(aten.relu.default, (mm2,)),))
    v1 = g.call_function(aten.view.default, (mm, [-1]))
    v2 = g.call_function(aten.view.default, (v1, [2, -1]))
    v3 = g.call_function(aten.view.default, (mm, [5, -1]))
    g.output((out, v1, v2, v3))
    gm = fx.GraphModule(torch.nn.Module(), g)
    x_, w_ = torch.randn(4, 3), torch.randn(3, 5)
    before = gm(x_, w_)
    assert hoist_saved_views(gm, n_out=1) == 3
    at = {n: i for i, n in enumerate(gm.graph.nodes)}
    assert at[mm] < at[v1] < at[v2] < at[mm2]
    assert at[mm] < at[v3] < at[mm2]
    assert all(torch.equal(a, b) for a, b in zip(before, gm(x_, w_), strict=True))


def test_views_already_next_to_their_base_and_user_outputs_stay():
    gm = _forward_with_a_late_saved_view()
    assert hoist_saved_views(gm, n_out=2) == 0  # the view is a user output there, not saved
    hoist_saved_views(gm, n_out=1)
    assert hoist_saved_views(gm, n_out=1) == 0


def test_graph_key_changes_with_the_partitioner_key_and_the_inputs():
    gm = _forward_with_a_late_saved_view()
    a = [torch.randn(4, 3), torch.randn(3, 5)]
    assert graph_key(gm, a, "k1") == graph_key(gm, a, "k1")
    assert graph_key(gm, a, "k1") != graph_key(gm, a, "k2")
    assert graph_key(gm, a, "k1") != graph_key(gm, [torch.randn(8, 3), a[1]], "k1")


def test_memo_round_trips_through_its_file(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    PlanMemo().save("abc", {"report": {"offloaded": 3}, "reserve": [[1, 64]]})
    monkeypatch.setattr(PlanMemo, "_memory", {})
    assert PlanMemo().load("abc") == {"report": {"offloaded": 3}, "reserve": [[1, 64]]}
    assert PlanMemo().load("missing") is None


def test_inductor_cache_hit_keeps_the_plan_and_a_new_plan_recompiles(monkeypatch, tmp_path):
    """The same plan a second time: torch's cache answers (the partitioner does not run),
    the graph still offloads and reports what it did; another budget partitions anew."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(PlanMemo, "_memory", {})
    torch._inductor.config.fx_graph_cache = True
    ref = train(plain("inductor"), steps=2)
    first = train(planned("40%", backend="inductor"), steps=2)
    first_moved = first[2].stats.compiled_offloads  # (stats count from a run's start to now)
    second = train(planned("40%", backend="inductor"), steps=2)
    second_moved = second[2].stats.compiled_offloads
    other = train(planned("60%", backend="inductor"), steps=2)
    assert len(first[2].records) == 1 and second[2].records == []  # a hit: no partition
    assert len(other[2].records) == 1  # a new plan: partitioned and compiled again
    g1, g2 = first[2].graphs[0], second[2].graphs[0]
    assert g2.offloaded == g1.offloaded > 0 and g2.offloaded_bytes == g1.offloaded_bytes
    assert second_moved == first_moved == 2 * g1.offloaded
    assert same(first, ref) and same(second, ref) and same(other, ref)


def test_the_plan_sees_the_loss_on_the_forward_s_largest_output():
    """A loss computed outside the graph holds about three times the logits while the
    forward's saved tensors are live: the plan's curve carries it where the forward ends."""
    from tierflow.compiled.frontend import LOSS_WORKING_SET, with_loss_between

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 256))
    run = tc.compile(model, budget="50%", backend="aot_eager")
    x = torch.randn(8, 16, 32)
    run.model(x).logsumexp(-1).mean().backward()
    facts = run.records[0].facts
    seen = with_loss_between(facts)
    n = facts.n_fwd
    logits = 8 * 16 * 256 * 4
    assert int(seen.curve[n - 1] - facts.curve[n - 1]) == LOSS_WORKING_SET * logits
    assert (seen.curve[: n - 1] == facts.curve[: n - 1]).all() and (seen.curve[n:] == facts.curve[n:]).all()


def test_a_scalar_output_adds_no_loss_estimate_beyond_its_bytes():
    from tierflow.compiled.frontend import with_loss_between

    _, _, run = train(planned("50%"), steps=1)
    facts = run.records[0].facts
    assert int(with_loss_between(facts).curve.max() - facts.curve.max()) <= 3 * 4
