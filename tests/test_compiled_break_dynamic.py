"""Budgets across graph breaks and under dynamic shapes (tierflow.compiled.frontend).

A graph break runs the later graphs between an earlier graph's forward and backward,
and their parameter gradients under its backward; a Dynamo recompile (a new shape)
runs instead of the graph it replaces. Small models on ``aot_eager``."""

from __future__ import annotations

import pytest
import torch

import tierflow.compiled as tc
from test_compiled_frontend import GatedMLP, planned, train
from tierflow.compiled import frontend
from tierflow.compiled.plan import floor_curve


@pytest.fixture(scope="module")
def broken():
    return train(planned("50%"), steps=2, brk=True)[2]


@pytest.fixture(scope="module")
def dynamic():
    return train(planned("50%", dynamic=True), steps=2, seqs=(48, 80))[2]


def _param_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def test_each_half_of_a_broken_model_knows_its_own_parameters(broken):
    g0, g1 = broken.graphs
    half = _param_bytes(GatedMLP().parameters()) // 2  # two blocks of four on each side
    assert g0.param_grad_bytes == g1.param_grad_bytes == half


def test_earlier_graphs_backward_runs_under_the_later_graphs_gradients(broken):
    g0, g1 = broken.graphs
    # graph 1's backward runs first: its gradients are held while graph 0's runs
    assert g0.other_grads_bytes == g1.param_grad_bytes
    assert g1.other_grads_bytes == 0
    # and graph 1 runs on top of what graph 0 keeps saved
    assert g1.carried_bytes == g0.made_saved_bytes - g0.offloaded_bytes > 0


def test_only_the_graph_ending_at_the_break_estimates_the_rest_of_the_model(broken):
    r0, r1 = broken.records
    assert broken.graphs[0].ends_at_break and not broken.graphs[1].ends_at_break
    f0 = frontend.with_loss_between(r0.facts)
    est = frontend.with_rest_of_model(f0)
    outputs = max(t.bytes for t in f0.trace.tensors if t.held_until == f0.n_fwd and t.kind != "gradient" and not t.external)
    extra = int(floor_curve(f0, move_tangents=False)[f0.n_fwd:].max()) - frontend.LOSS_WORKING_SET * outputs
    assert extra > 0
    diff = est.curve - f0.curve
    assert diff[f0.n_fwd - 1] == extra and int(abs(diff).sum()) == extra
    # graph 1 returns the loss (a scalar): its backward follows at once
    f1 = frontend.with_loss_between(r1.facts)
    assert frontend.with_rest_of_model(f1) is f1


def test_earlier_graph_moves_what_it_keeps_across_the_break(broken):
    rec = broken.records[0]
    f, plan = rec.facts, rec.plan
    end = f.n_fwd - 1
    across = [s for s in f.saved if s.offloadable and s.bytes >= 1 << 16 and s.last_fwd_use < end < s.first_bwd_use]
    assert across
    assert all(s.name in plan.offload | plan.recompute for s in across)


def test_a_recompile_is_not_counted_beside_the_graph_it_replaces(dynamic):
    used = [g for g in dynamic.graphs if g.calls > 0]
    assert len({g.frame for g in dynamic.graphs}) == 1  # one frame: recompiles, no break
    assert used
    for g in used:
        assert g.carried_bytes == 0 and g.other_grads_bytes == 0
    rec = dynamic.records[-1]
    peak = frontend.with_loss_between(rec.facts).peak_bytes
    assert dynamic.graphs[-1].target_bytes == int(0.9 * 0.5 * peak)


def test_recompiles_are_counted_by_dynamo_compile_id():
    torch._dynamo.reset()
    counter = tc.CallCounter("aot_eager")
    fn = torch.compile(lambda x: (x * 2).sum(), backend=counter, dynamic=False)
    for n in (3, 4, 5):
        fn(torch.ones(n))
    assert counter.graphs == 3 and counter.recompiles == 2
    assert len({frame for frame, _ in counter.compile_ids}) == 1


def test_compiled_reports_say_which_graph_is_a_recompile():
    torch._dynamo.reset()
    torch.manual_seed(0)
    run = tc.compile(torch.nn.Linear(8, 8), budget="50%", backend="aot_eager", dynamic=False)
    for n in (3, 4):
        run.model(torch.randn(n, 8)).sum().backward()
    assert [g.recompile for g in run.graphs] == [False, True]
    assert run.graphs[0].frame == run.graphs[1].frame


def test_cli_train_compile_shows_the_gradients_each_graph_moves(monkeypatch, capsys):
    from tierflow.cli import main
    from tierflow.compiled import plan as plan_mod

    # mlp-tiny's gradients are under the planner's 64 KiB floor: lower it, so that the
    # plan moves some, and keep the run to read what the table should say
    monkeypatch.setattr(frontend, "plan_graph", lambda f, t, **kw: plan_mod.plan_graph(f, t, min_bytes=512, **kw))
    runs = []
    real = tc.compile

    def keep(*a, **kw):
        runs.append(real(*a, **kw))
        return runs[-1]

    monkeypatch.setattr(tc, "compile", keep)
    assert main(["train", "--model", "mlp-tiny", "--compile", "aot_eager", "--budget", "10%", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    (g,) = runs[0].graphs
    assert g.grads_offloaded > 0
    assert "grads moved" in out and "(0 recompiles)" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("│") and "│     0 │" in line)
    cells = [c.strip() for c in row.strip().strip("│").split("│")]
    assert cells[6].startswith(f"{g.grads_offloaded} (")
