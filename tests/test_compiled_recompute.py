"""Per-tensor recompute in the compiled front-end's plan: the planner's choice
(:func:`tierflow.compiled.plan.plan_graph`) and the partitioner's tags
(:func:`tierflow.compiled.hook.tag_recompute`), on tiny models with ``aot_eager``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tierflow.compiled as tc
from compiled_fit import fit, fit_compiled
from tierflow.compiled import hook
from tierflow.compiled.graph_trace import is_random
from tierflow.compiled.plan import GraphPlan, copy_s, plan_graph, recompute_s


class Block(nn.Module):
    def __init__(self, d: int = 32, p: float = 0.0) -> None:
        super().__init__()
        self.ln, self.a, self.b, self.drop = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.b(nn.functional.gelu(self.a(self.ln(x)))).tanh())


class Net(nn.Module):
    def __init__(self, n: int = 2, p: float = 0.0, d: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, p) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


def recompute_all(run: tc.CompiledOffload, with_inputs: bool = False) -> None:
    """Make ``run``'s planner ask for every saved tensor to be recomputed (the ones the
    facts call recomputable; with ``with_inputs``, every one, to test the hook's refusals)."""

    def decide(facts, report):
        names = frozenset(s.name for s in facts.saved if with_inputs or s.recomputable)
        return GraphPlan(recompute=names, target_bytes=0)

    run._decide = decide


def train(p: float = 0.0, planned: bool = True, force: bool = True, steps: int = 3, d: int = 32,
          budget: str = "50%"):
    """Losses, final parameters and the handle of ``steps`` AdamW steps of a seeded Net."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net(p=p, d=d)
    if planned:
        run = tc.compile(model, budget=budget, backend="aot_eager")
        if force:
            recompute_all(run, with_inputs=p > 0)
        fn = run.model
    else:
        run = None
        fn = torch.compile(model, backend="aot_eager")
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(2)  # the dropout's draws: the same sequence in both runs
    return *fit(model, fn, (torch.randn(4, 64, d, generator=gen) for _ in range(steps))), run


def same(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def test_recompute_is_bitwise_equal_to_plain_compile_and_saves_less():
    ref, got = train(planned=False), train()
    assert same(ref, got)
    rec = got[2].records[0]
    assert rec.recomputed and not rec.tags_dropped
    assert rec.saved_count_after < len(rec.facts.saved)
    assert rec.saved_after < rec.facts.saved_bytes
    report = got[2].graphs[0]
    assert report.recomputed == len(rec.recomputed)
    assert report.kept + report.offloaded == rec.saved_count_after
    assert report.saved - report.recomputed <= rec.saved_count_after  # recompute may add frontier tensors


def test_the_planner_own_recomputes_are_done_and_bitwise_equal():
    """No forced plan: the budget's plan recomputes (the layer norm outputs are cheap to
    re-make), torch honours it, and training equals plain compile."""
    ref, got = train(planned=False, d=128), train(force=False, d=128, budget="30%")
    assert same(ref, got)
    rec = got[2].records[0]
    assert rec.plan.recompute and set(rec.recomputed) & rec.plan.recompute
    assert got[2].graphs[0].recomputed == len(rec.recomputed)


def test_key_changes_when_only_the_recompute_set_does():
    a, b = GraphPlan(offload=frozenset({"x"})), GraphPlan(offload=frozenset({"x"}), recompute=frozenset({"y"}))
    assert a.key() != b.key()
    assert b.key() == GraphPlan(offload=frozenset({"x"}), recompute=frozenset({"y"})).key()


def test_dropout_is_never_tagged_and_training_stays_equal(monkeypatch):
    tagged_random: list[str] = []
    real = hook.tag_recompute

    def spy(gm, names):
        done = real(gm, names)
        tagged_random.extend(n.name for n in gm.graph.nodes if "recompute" in n.meta and is_random(n))
        return done

    monkeypatch.setattr(hook, "tag_recompute", spy)
    ref, got = train(p=0.2, planned=False), train(p=0.2)
    assert same(ref, got)
    rec = got[2].records[0]
    assert rec.recomputed  # the other tensors were recomputed
    assert tagged_random == []
    facts_random = [s.name for s in rec.facts.saved if not s.recomputable and s.name.startswith("getitem")]
    assert facts_random and not set(facts_random) & set(rec.recomputed)


def test_graph_inputs_are_never_recomputed_even_when_asked():
    got = train(force=True, p=0.2, steps=1)
    rec = got[2].records[0]
    inputs = {s.name for s in rec.facts.saved if rec.facts.trace.tensors[s.tensor].external}
    assert inputs and not inputs & set(rec.recomputed)


def facts_of_net():
    _, _, run = train(planned=True, force=False, steps=1)
    return run.records[0].facts


def test_plan_never_recomputes_a_graph_input():
    facts = facts_of_net()
    plan = plan_graph(facts, target_bytes=0, min_bytes=0)
    inputs = {s.name for s in facts.saved if facts.trace.tensors[s.tensor].external}
    assert inputs and plan.recompute and not plan.recompute & inputs
    assert not plan.recompute & plan.offload


def test_plan_chooses_recompute_or_offload_by_cost():
    """Bounds that hold whatever order the greedy took: a tensor's recompute cost grows as
    fewer tensors stay saved, from all saved (the first choice) to the plan's final set."""
    facts = facts_of_net()
    plan = plan_graph(facts, target_bytes=0, min_bytes=0)
    by_name = {s.name: s for s in facts.saved}
    all_saved = {s.tensor for s in facts.saved}
    final = all_saved - {by_name[n].tensor for n in plan.recompute}
    shared = {t for t in all_saved if sum(1 for s in facts.saved if s.tensor == t) > 1}
    for name in plan.recompute:
        s = by_name[name]
        assert s.recomputable
        if s.offloadable and s.tensor not in shared:
            assert recompute_s(facts, s.tensor, all_saved) < copy_s(s.bytes)
    for name in plan.offload:
        s = by_name[name]
        assert s.offloadable
        if s.recomputable:
            assert recompute_s(facts, s.tensor, final) >= copy_s(s.bytes)
    assert plan.offload and plan.recompute  # this net exercises both choices


def test_a_partition_that_fails_with_tags_is_retried_without_them(monkeypatch):
    """A min-cut that cannot honour the tags: the graph is partitioned untagged, said once,
    and nothing counts as recomputed."""
    import torch._functorch.partitioners as partitioners

    real = partitioners.min_cut_rematerialization_partition

    def refuses_tags(gm, *args, **kwargs):
        if any("recompute" in n.meta for n in gm.graph.nodes):
            raise RuntimeError("cannot honour the recompute tags")
        return real(gm, *args, **kwargs)

    monkeypatch.setattr(partitioners, "min_cut_rematerialization_partition", refuses_tags)
    monkeypatch.setattr(hook, "_warned_untagged", False)
    ref = train(planned=False)
    with pytest.warns(RuntimeWarning, match="partitioned without them"):
        got = train()
    assert same(ref, got)
    rec = got[2].records[0]
    assert rec.tags_dropped and rec.recomputed == [] and got[2].graphs[0].recomputed == 0


def test_recompute_under_dynamic_shapes_adds_no_recompile_and_stays_equal():
    def run(planned: bool):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Net()
        if planned:
            handle = tc.compile(model, budget="50%", backend="aot_eager", dynamic=True)
            recompute_all(handle)
            fn = handle.model
        else:
            handle = tc.CallCounter("aot_eager")
            fn = torch.compile(model, backend=handle, dynamic=True)
        gen = torch.Generator().manual_seed(1)
        return *fit(model, fn, (torch.randn(4, seq, 32, generator=gen) for seq in (48, 80, 112))), handle

    ref, got = run(False), run(True)
    assert same(ref, got)
    assert got[2].compiles == ref[2].graphs
    assert all(rec.recomputed and not rec.tags_dropped for rec in got[2].records)


def test_attention_and_layer_norm_outputs_are_tagged_whole_and_stay_equal():
    """SDPA and layer norm return several tensors: their units are tagged together, so
    the partition succeeds with the tags and torch recomputes them."""

    def run(planned: bool):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        handle = None
        if planned:
            handle = tc.compile(model, budget="50%", backend="aot_eager")
            recompute_all(handle)
            fn = handle.model
        else:
            fn = torch.compile(model, backend="aot_eager")
        gen = torch.Generator().manual_seed(1)
        inputs = (torch.randn(4, 32, 32, generator=gen) for _ in range(2))
        return *fit(model, fn, inputs, loss=lambda y: y.pow(2).mean()), handle

    ref, got = run(False), run(True)
    assert same(ref, got)
    (rec,) = got[2].records
    assert not rec.tags_dropped and rec.saved_after < rec.facts.saved_bytes
    multi = [s.name for s in rec.facts.saved if "getitem" in s.name and s.recomputable]  # tuple outputs
    assert multi and set(multi) & set(rec.recomputed)


def test_offload_only_plans_recompute_nothing_and_keep_what_cannot_move():
    facts = facts_of_net()
    plan = plan_graph(facts, target_bytes=0, min_bytes=0, allow_recompute=False)
    by_name = {s.name: s for s in facts.saved}
    assert not plan.recompute and plan.offload
    assert all(by_name[n].offloadable for n in plan.offload)


def test_inductor_plans_offload_only_unless_asked():
    """Under inductor a recomputed op is not held back to its first use (measured: the
    peak rose), so recompute is off there by default and on under aot_eager."""
    m = nn.Linear(4, 4)
    assert tc.compile(m, backend="inductor").recompute is False
    assert tc.compile(m, backend="inductor", recompute=True).recompute is True
    assert tc.compile(m, backend="aot_eager").recompute is True


class _Stack(nn.Module):
    """Residual MLP blocks: the first blocks' gradients are made long before the backward
    graph returns them."""

    def __init__(self, d: int = 64, h: int = 512, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))
                                    for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x.pow(2).mean()


def _train_stack(budget: str | float | None) -> tuple[list[float], list[torch.Tensor], tc.CompiledOffload | None]:
    gen = torch.Generator().manual_seed(1)
    return fit_compiled(_Stack, [torch.randn(4, 32, 64, generator=gen) for _ in range(2)], budget)


def test_gradients_leave_inside_the_backward_graph_and_training_stays_bitwise():
    want = _train_stack(None)
    got = _train_stack(0.05)
    assert got[0] == want[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    run = got[2]
    (rec,) = run.records
    assert rec.plan.offload_grads and rec.grads_offloaded
    assert set(rec.grads_offloaded) <= rec.plan.offload_grads
    assert run.graphs[0].grads_offloaded == len(rec.grads_offloaded) > 0
    moved = [g for g in rec.facts.grads if g.name in rec.plan.offload_grads]
    assert all(g.offloadable and g.last_fwd_use < g.first_bwd_use - 1 for g in moved)


def test_gradients_move_only_when_saved_tensors_cannot_reach_the_target():
    facts = facts_of_net()
    assert not plan_graph(facts, target_bytes=facts.peak_bytes - 1, min_bytes=0).offload_grads
    assert not plan_graph(facts, target_bytes=0, min_bytes=0, move_grads=False).offload_grads
    a = GraphPlan(offload=frozenset({"x"}))
    assert a.key() != GraphPlan(offload=frozenset({"x"}), offload_grads=frozenset({"g"})).key()
