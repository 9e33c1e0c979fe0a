"""The compiled front-end with torch's caches, and the forward graph's saved views.

One test compiles with inductor (the FX graph cache is inductor's); the others use
``aot_eager`` or build FX graphs by hand."""

from __future__ import annotations

import torch
from torch import fx

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
