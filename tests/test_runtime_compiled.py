"""torch.compile'd code under ``tierflow.offload`` runs eagerly (Dynamo compiles nothing
while the runtime's dispatch mode is active): the runtime says so, with a stats count
and one warning per run, rather than letting the user believe it runs compiled."""

from __future__ import annotations

import warnings

import torch

import tierflow


def _counting_backend(calls: dict[str, int]):
    def backend(gm, example_inputs):
        calls["graphs"] += 1

        def run(*args):
            calls["runs"] += 1
            return gm.forward(*args)
        return run
    return backend


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters())


def _steps(fn, opt, x, n):
    for _ in range(n):
        fn(x).sum().backward()
        opt.step()
        opt.zero_grad()


def test_compiled_model_runs_eager_under_offload_and_is_counted_and_warned_once():
    calls = {"graphs": 0, "runs": 0}
    model, opt = _model_and_opt()
    compiled = torch.compile(model, backend=_counting_backend(calls))
    x = torch.randn(8, 16)
    _steps(compiled, opt, x, 2)
    assert calls == {"graphs": 1, "runs": 2}  # (the backend counts what runs compiled)
    calls.update(graphs=0, runs=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tierflow.offload(model, opt) as run:
            _steps(compiled, opt, x, 6)
    assert calls == {"graphs": 0, "runs": 0}  # the compiled graph never ran: eager
    forward_ops = run.stats.compiled_ops_run_eager
    assert forward_ops >= 6 * 3  # (every step's forward: three modules' ops at least)
    said = [w for w in caught if "torch.compile" in str(w.message)]
    assert len(said) == 1 and issubclass(said[0].category, RuntimeWarning)
    assert "compiled_ops_run_eager" in str(said[0].message)


def test_compiled_function_inside_the_loop_is_counted():
    model, opt = _model_and_opt()
    f = torch.compile(lambda t: (t * 2).sin(), backend="eager")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with tierflow.offload(model, opt) as run:
            for _ in range(3):
                f(model(torch.randn(8, 16))).sum().backward()
                opt.step()
                opt.zero_grad()
    assert run.stats.compiled_ops_run_eager >= 3 * 2  # mul and sin, each step


def test_uncompiled_code_counts_nothing_and_warns_nothing():
    model, opt = _model_and_opt()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tierflow.offload(model, opt, budget="60%") as run:
            _steps(model, opt, torch.randn(8, 16), 4)
    assert run.stats.compiled_ops_run_eager == 0
    assert not [w for w in caught if "torch.compile" in str(w.message)]
