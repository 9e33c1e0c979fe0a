"""benchmarks/gpu_check.py in its CPU mode, so that the GPU check cannot rot: it runs
end to end and writes every section with sane values; its peers, put on from outside
the zoo model, train exactly as the plain model does."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from conftest import REPO
from tierflow.capture import zoo


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod
    spec.loader.exec_module(mod)
    return mod


gpu_check = _load()


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu_check") / "out.json"
    code = gpu_check.main(["--device", "cpu", "--quick", "--json", str(path)])
    return code, json.loads(path.read_text())


@pytest.mark.slow
def test_cpu_mode_exits_ok_with_nothing_skipped(result):
    code, out = result
    assert code == 0 and out["ok"] is True
    assert out["skipped"] == [] and out["errors"] == []
    assert out["environment"]["device"] == "cpu" and out["environment"]["torch"] == torch.__version__


@pytest.mark.slow
def test_memory_truth_ratio_is_near_one(result):
    rows = result[1]["memory_truth"]
    assert [r["model"] for r in rows] == ["gpt-tiny"]
    assert all(r["measured_peak_bytes"] > 0 and 0.8 <= r["ratio"] <= 1.25 for r in rows)


@pytest.mark.slow
def test_parity_holds_and_something_moved(result):
    rows = result[1]["parity"]
    assert rows and all(r["parity"] is True and r["moved_bytes"] > 0 and r["planned_steps"] >= 1 for r in rows)


@pytest.mark.slow
def test_budgeted_runs_stay_within_budget(result):
    rows = result[1]["budget"]
    assert sorted(r["budget_share"] for r in rows) == [0.3, 0.5]
    assert all(r["within"] and 0 < r["peak_bytes"] <= r["budget_bytes"] for r in rows)


@pytest.mark.slow
def test_throughput_has_every_run_with_positive_step_times(result):
    rows = result[1]["throughput"]
    runs = {(r["config"], r["budget_share"]) for r in rows}
    assert runs == {("plain", None), ("checkpoint", None), ("save_on_cpu", None),
                    ("tierflow", None), ("tierflow", 0.5), ("tierflow", 0.3)}
    assert all("error" not in r and r["step_s"] > 0 and r["peak_bytes"] > 0 for r in rows)
    ckpt = next(r for r in rows if r["config"] == "checkpoint")
    plain = next(r for r in rows if r["config"] == "plain")
    assert ckpt["peak_bytes"] < plain["peak_bytes"]  # recompute saved activation memory


@pytest.mark.slow
def test_prediction_rows_are_positive(result):
    rows = result[1]["prediction"]
    assert len(rows) == 3
    assert all(r["predicted_step_time_s"] > 0 and r["measured_step_time_s"] > 0 and r["ratio"] > 0 for r in rows)


def _grads_after_step(wrap) -> list[torch.Tensor]:
    m, opt = gpu_check.build("gpt-tiny", torch.device("cpu"))
    m = wrap(m)
    x, y = m.make_batch(2, 16)
    m.loss_fn(m.model(x), y).backward()
    return [p.grad.clone() for p in m.model.parameters()]


@pytest.mark.parametrize("peer", ["checkpoint", "save_on_cpu"])
def test_peer_wrappers_leave_gradients_unchanged(peer):
    wrap = gpu_check.with_checkpoint if peer == "checkpoint" else (
        lambda m: gpu_check.with_save_on_cpu(m, torch.device("cpu")))
    plain, wrapped = _grads_after_step(lambda m: m), _grads_after_step(wrap)
    assert all(torch.equal(a, b) for a, b in zip(plain, wrapped))


def test_blocks_are_transformer_blocks_or_residual_stages():
    assert len(gpu_check.blocks_of(zoo.build("gpt-tiny").model)) == 2
    assert len(gpu_check.blocks_of(zoo.build("resnet-tiny").model)) == 4


def test_models_option_parses_name_batch_seq():
    assert gpu_check.parse_models("gpt-tiny:2:16, vit-tiny") == [("gpt-tiny", 2, 16), ("vit-tiny", 4, None)]


def test_deterministic_context_sets_and_restores_the_flags():
    warned: list[str] = []
    before = torch.are_deterministic_algorithms_enabled()
    with gpu_check.deterministic(torch.device("cuda"), warned):  # the CUDA branch; no kernel runs
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.are_deterministic_algorithms_enabled() == before and warned == []
