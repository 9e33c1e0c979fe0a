"""A budget below a compiled graph's floor is said once, before the graph's backward
first runs, with the floor and the budget (tierflow.compiled.frontend, issue 30).

The model is ``benchmarks/compiled.py``'s gated MLP with a graph break, ``--quick``
size, whose 30% row measured floors above the budget (one block's backward working set
and the later graph's gradients) and whose 50% row was within."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import tierflow.compiled as tc


class BrokenGatedMLP(nn.Module):
    """Four pre-norm gated MLP blocks (width 128, hidden 512), a graph break after two."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"ln": nn.LayerNorm(128), "g": nn.Linear(128, 512), "u": nn.Linear(128, 512),
                           "o": nn.Linear(512, 128)})
            for _ in range(4)
        )
        self.head = nn.Linear(128, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.run_blocks(x, self.blocks[:2])
        torch._dynamo.graph_break()
        return self.head(self.run_blocks(x, self.blocks[2:])).pow(2).mean()

    @staticmethod
    def run_blocks(x: torch.Tensor, blocks) -> torch.Tensor:
        for b in blocks:
            y = b["ln"](x)
            x = x + b["o"](nn.functional.silu(b["g"](y)) * b["u"](y))
        return x


def _train(budget: str, steps: int = 2):
    """The run and the BudgetWarnings of ``steps`` steps."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = BrokenGatedMLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tc.compile(model, budget=budget, backend="aot_eager") as run:
            for _ in range(steps):
                run.model(torch.randn(4, 128, 128, generator=gen)).backward()
                opt.step()
                opt.zero_grad()
    return run, [w for w in caught if issubclass(w.category, tc.BudgetWarning)]


@pytest.fixture(scope="module")
def at_30():
    return _train("30%")


def test_a_floor_above_the_budget_is_said_once_per_graph_naming_floor_and_budget(at_30):
    run, said = at_30
    graphs = run.stats.compiled_graphs
    assert len(graphs) == 2 and all(g["floor_above_budget"] for g in graphs)
    assert len(said) == 2  # two steps, one warning per graph
    for g, w in zip(graphs, said, strict=True):
        text = str(w.message)
        assert f"graph {g['index']}'s floor" in text
        assert f"({g['floor_bytes']} bytes)" in text and f"({g['budget_bytes']} bytes)" in text
        assert g["floor_bytes"] > g["budget_bytes"]


def test_the_budget_judged_is_the_share_of_the_models_peak_across_the_break(at_30):
    g0, g1 = at_30[0].stats.compiled_graphs
    # graph 0 ends at the break: judged with the rest of the model, against one budget
    assert g0["budget_bytes"] == g1["budget_bytes"] == int(0.3 * max(g0["model_peak_bytes"], g1["model_peak_bytes"]))
    # graph 0's floor: its backward's working set with graph 1's gradients under it
    assert "backward" in g0["floor_op"] and g0["other_grads_bytes"] == g1["param_grad_bytes"] > 0
    assert re.search(r"gradients under its backward", str(at_30[1][0].message))


def test_a_budget_above_the_floors_says_nothing():
    run, said = _train("50%", steps=1)
    assert said == []
    graphs = run.stats.compiled_graphs
    assert all(not g["floor_above_budget"] and g["floor_bytes"] <= g["budget_bytes"] for g in graphs)


def test_no_budget_judges_nothing():
    run, said = _train(None, steps=1)
    assert said == [] and all(g["budget_bytes"] is None for g in run.stats.compiled_graphs)


def test_cli_train_compile_shows_a_floor_above_the_budget(capsys):
    from tierflow.cli import main

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tc.BudgetWarning)
        assert main(["train", "--model", "gpt-tiny", "--compile", "aot_eager", "--budget", "10%", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"graph 0: floor [\d.]+ \w?i?B .* is above the budget", out)
