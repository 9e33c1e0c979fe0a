"""The compiled front-end (tierflow.compiled): plans carried inside torch.compile's graphs.

Small models on ``aot_eager`` (the hook and the graph rewrite are the same objects with
inductor; one test compiles with inductor for the FX graph cache)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import tierflow.compiled as tc
from tierflow.compiled import frontend
from tierflow.compiled.plan import curve_with, plan_graph


class GatedMLP(nn.Module):
    def __init__(self, d: int = 64, h: int = 256, n: int = 4, brk: bool = False) -> None:
        super().__init__()
        self.brk = brk
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"g": nn.Linear(d, h), "u": nn.Linear(d, h), "o": nn.Linear(h, d), "ln": nn.LayerNorm(d)})
            for _ in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = len(self.blocks) // 2
        x = self.run_blocks(x, self.blocks[:half])
        if self.brk:  # outside the loops: Dynamo skips a frame that breaks inside one
            torch._dynamo.graph_break()
        return self.run_blocks(x, self.blocks[half:]).pow(2).mean()

    @staticmethod
    def run_blocks(x: torch.Tensor, blocks) -> torch.Tensor:
        for b in blocks:
            y = b["ln"](x)
            x = x + b["o"](nn.functional.silu(b["g"](y)) * b["u"](y))
        return x


def train(make, steps: int = 3, seqs=(64,), brk: bool = False):
    """Losses and final parameters of ``steps`` AdamW steps of a fresh seeded model."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GatedMLP(brk=brk)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fn, handle = make(model)
    losses = []
    gen = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = torch.randn(16, seqs[i % len(seqs)], 64, generator=gen)
        loss = fn(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()], handle


def plain(backend: str = "aot_eager", **kw):
    counter = tc.CallCounter(backend)
    return lambda m: (torch.compile(m, backend=counter, **kw), counter)


def planned(budget="50%", backend: str = "aot_eager", **kw):
    def make(m):
        run = tc.compile(m, budget=budget, backend=backend, **kw)
        return run.model, run

    return make


def same(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def test_planned_compiled_training_is_bitwise_equal_to_plain_compile():
    ref, got = train(plain()), train(planned("30%"))
    assert got[2].stats.compiled_offloads > 0
    assert same(ref, got)


def test_compiled_calls_under_plan_equal_plain_compile():
    ref, got = train(plain()), train(planned())
    assert ref[2].calls == got[2].calls == 3
    assert ref[2].graphs == got[2].compiles == 1


def test_plan_reaches_target_on_the_graphs_trace():
    run = train(planned("50%"))[2]
    (g,) = run.stats.compiled_graphs
    assert g["offloaded"] > 0 and g["kept"] + g["offloaded"] == g["saved"] and not g["unreachable"]
    assert g["plan_peak_bytes"] <= g["target_bytes"] == int(0.5 * 0.9 * g["predicted_peak_bytes"])


def test_planner_curve_matches_an_independent_recount():
    run = train(planned("30%"), steps=1)[2]
    (rec,) = run.records
    chosen = [s for s in rec.facts.saved if s.name in rec.plan.offload | rec.plan.recompute]
    chosen += [g for g in rec.facts.grads if g.name in rec.plan.offload_grads]
    assert int(curve_with(rec.facts, chosen).max()) == rec.plan.predicted_peak_bytes
    assert plan_graph(rec.facts, None).offload == frozenset()


def test_no_budget_plans_nothing_and_moves_nothing():
    run = train(planned(None))[2]
    assert run.stats.compiled_offloads == 0 and run.stats.compiled_graphs[0]["offloaded"] == 0


def test_graph_break_gives_one_plan_per_graph_and_stays_equal():
    ref, got = train(plain(), brk=True), train(planned("50%"), brk=True)
    assert same(ref, got)
    assert got[2].compiles == ref[2].graphs == 2
    assert all(g["offloaded"] > 0 for g in got[2].stats.compiled_graphs)
    assert got[2].calls == ref[2].calls


def test_dynamic_shapes_compile_once_without_specializing():
    seqs = (48, 80, 112)
    ref = train(plain(dynamic=True), steps=3, seqs=seqs)
    got = train(planned("50%", dynamic=True), steps=3, seqs=seqs)
    assert same(ref, got)
    # The plan adds no recompile: as many graphs as plain compile (which recompiles once
    # here, from the first shape's graph to a symbolic one), fewer than the shapes.
    assert got[2].compiles == ref[2].graphs < len(seqs)
    assert got[2].stats.compiled_offloads > 0


@pytest.mark.parametrize("budget", ["0%", -3, "lots"])
def test_bad_budget_is_refused_by_name(budget):
    with pytest.raises(ValueError, match="budget"):
        tc.compile(nn.Linear(2, 2), budget=budget)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend"):
        tc.compile(nn.Linear(2, 2), backend="cudagraphs")


def test_missing_hook_falls_back_to_eager_once(monkeypatch):
    monkeypatch.setattr(frontend, "hook_support", lambda: "torch 0.0 lacks the partitioner hook")
    monkeypatch.setattr(frontend, "_warned_fallback", False)
    model = nn.Linear(4, 4)
    with pytest.warns(RuntimeWarning, match="lacks the partitioner hook"):
        first = tc.compile(model, budget="50%")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = tc.compile(model, budget="50%")
    assert isinstance(first, frontend.EagerFallback) and isinstance(second, frontend.EagerFallback)
    assert first.model is model


def test_hook_uuid_keys_on_the_plan():
    def hook(key):
        return tc.hook.PlanPartitioner(decide=lambda f: None, key=key, on_partition=lambda r: None)

    assert hook("share=0.5:graph=0").uuid() == hook("share=0.5:graph=0").uuid()
    assert hook("share=0.5:graph=0").uuid() != hook("share=0.3:graph=0").uuid()
    import pickle

    assert pickle.loads(pickle.dumps(hook("k"))) == hook("k").uuid()


def test_cli_train_compile_prints_each_graph(capsys):
    from tierflow.cli import main

    assert main(["train", "--model", "gpt-tiny", "--compile", "aot_eager", "--budget", "50%", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "offloaded" in out and "compiled calls 2" in out


def test_cli_train_compile_json_counts_the_steps_the_loop_recorded(capsys):
    import json

    from tierflow.cli import main

    assert main(["train", "--model", "gpt-tiny", "--compile", "aot_eager", "--budget", "50%", "--steps", "3",
                 "--json"]) == 0
    st = json.loads(capsys.readouterr().out)["stats"]
    assert st["steps"] == 3 and len(st["step_times_s"]) == 3
    # the median of the steps after the first (compiling) one
    assert st["step_time_s"] == sorted(st["step_times_s"][1:])[1]
