"""benchmarks/gpu_check.py in its CPU mode, so that the GPU check cannot rot: it runs
end to end and writes every section with sane values; its peers, put on from outside
the zoo model, train exactly as the plain model does."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import load_benchmark
from tierflow.capture import zoo

gpu_check = load_benchmark("gpu_check")


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


# -- gpu_check.py --out: the issue rows (benchmarks/gpu_suite.py), CPU dry run ---------------
gpu_suite = load_benchmark("gpu_suite")


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_suite")
    code = gpu_check.main(["--device", "cpu", "--out", str(out), "--models", "hf-gpt2", "--no-compile",
                           "--steps", "2", "--traces", "1", "--time-limit", "900", "--parts", "ABC"])
    return code, json.loads((out / "gpu_check.json").read_text()), out


@pytest.mark.slow
def test_suite_runs_every_row_of_the_hf_model_and_exits_ok(suite):
    code, res, _ = suite
    assert code == 0 and res["ok"] is True and res["done"] is True
    assert res["skipped"] == [] and res["errors"] == [] and not [r for r in res["rows"] if "error" in r]
    got = {(r["config"], r.get("label") or r.get("budget_arg")) for r in res["rows"]}
    assert got == {("plain", None), ("checkpoint", None), ("save_on_cpu", None),
                   ("tierflow", "none"), ("tierflow", "checkpoint peak"), ("tierflow", "50%"), ("tierflow", "30%"),
                   ("tierflow", "50% as bytes"), ("tierflow", "30% as bytes"),
                   ("tierflow follow=hooks", "none"), ("tierflow follow=hooks", "checkpoint peak"),
                   ("tierflow follow=hooks", "50%"), ("tierflow follow=hooks", "30%"),
                   ("tierflow policy=checkpoint", "checkpoint peak"),
                   ("parity", "50%"), ("parity", "30%"), ("trainer", "50%")}
    # part A (peers, tierflow at the checkpointing peak, 50%, 30%), then B (parity, Trainer), then C
    order = [(r["config"], r.get("label") or r.get("budget_arg")) for r in res["rows"]]
    assert order.index(("tierflow", "30%")) < order.index(("parity", "50%")) < order.index(("trainer", "50%"))
    assert order.index(("trainer", "50%")) < order.index(("tierflow policy=checkpoint", "checkpoint peak"))
    assert order.index(("tierflow", "none")) < order.index(("tierflow", "checkpoint peak"))  # (part A's first)


@pytest.mark.slow
def test_suite_budgets_are_shares_and_bytes_and_kept(suite):
    rows = suite[1]["rows"]
    plain = next(r for r in rows if r["config"] == "plain")
    ckpt = next(r for r in rows if r["config"] == "checkpoint")
    tf = {(r["config"], r["label"]): r for r in rows if r["config"].startswith("tierflow")}
    assert tf[("tierflow", "50% as bytes")]["budget_bytes"] == int(0.5 * plain["peak_bytes"])
    assert tf[("tierflow", "checkpoint peak")]["budget_bytes"] == ckpt["peak_bytes"]
    assert tf[("tierflow", "30%")]["budget_kind"] == "share" and tf[("tierflow", "30% as bytes")]["budget_kind"] == "bytes"
    assert tf[("tierflow", "none")]["within"] is None
    assert tf[("tierflow follow=hooks", "50%")]["follow"] == "hooks"  # (the steady state at ticks: runtime/hook_follow.py)
    for r in tf.values():
        assert r["timed_steps"] == 2 and r["planned_steps_timed"] == 2 and r["step_s"] > 0
        assert r["predicted_step_time_s"] > 0 and r["fetches_per_planned_step"] >= 0
        if r["budget_arg"] is not None:
            assert r["within"] is True and 0 < r["peak_planned_bytes"] <= r["budget_bytes"]


@pytest.mark.slow
def test_suite_parity_and_trainer_rows_are_bitwise(suite):
    rows = suite[1]["rows"]
    par = [r for r in rows if r["config"] == "parity"]
    assert len(par) == 2 and all(r["parity"] is True and r["planned_steps"] >= 1 and r["moved_bytes"] > 0 for r in par)
    tr = next(r for r in rows if r["config"] == "trainer")
    assert tr["parity"] is True and tr["logs_equal"] and tr["params_equal"] and tr["logged"] >= 4
    assert tr["within"] is True and tr["planned_steps"] >= 1


@pytest.mark.slow
def test_suite_profiles_one_step_per_budgeted_row_and_keeps_the_first_trace(suite):
    import gzip
    import tarfile

    _, res, out = suite
    budgeted = [r for r in res["rows"] if r["config"].startswith("tierflow") and r["budget_arg"] is not None]
    assert len(budgeted) == 9 and all(r["timeline"]["window_us"] > 0 for r in budgeted)
    kept = [r["timeline"]["trace"] for r in budgeted if r["timeline"].get("trace")]
    assert len(kept) == 1  # --traces 1
    tar_name, member = kept[0].split(":")
    with tarfile.open(out / tar_name) as t:
        trace = json.loads(gzip.decompress(t.extractfile(member).read()))
    assert any(e.get("name") == gpu_suite.STEP_MARK for e in trace["traceEvents"])


def test_suite_skips_what_the_time_limit_leaves_no_room_for_and_still_writes_its_json(tmp_path):
    code = gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--models", "hf-gpt2", "--no-compile",
                           "--time-limit", "0.5"])
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 1 and res["done"] is True and res["ok"] is False  # (no parity was run)
    # plain and checkpoint (part A), parity and Trainer (B), the four model-state rows
    # (S): nothing else runs without plain
    assert res["rows"] == [] and len(res["skipped"]) == 9
    assert res["environment"]["device"] == "cpu"


@pytest.mark.slow
def test_model_state_rows_train_like_plain_within_a_byte_budget_below_the_state(tmp_path):
    """Part S, dry run: a GPT-2 whose weights and AdamW state are 2.2x the byte budget,
    trained with default options and through the ZeRO policies: no error, every loss
    equal to plain PyTorch's, each step's peak recorded, the budget kept."""
    code = gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--models", "hf-gpt2", "--no-compile",
                           "--parts", "S", "--time-limit", "600"])
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {r["config"]: r for r in res["rows"] if r["kind"] == "state"}
    assert set(rows) == {"plain", "tierflow default", "tierflow zero_offload", "tierflow zero_infinity"}
    assert code == 1 and res["errors"] == []  # (1: no parity row in part S)
    for config, r in rows.items():
        assert "error" not in r and len(r["losses"]) == gpu_suite.STATE_STEPS
        if config != "plain":
            assert r["state_bytes"] >= 2 * r["budget_bytes"]
            assert r["losses_equal"] is True and r["within"] is True and r["within_planned"] is True
            assert any(r["planned"]) and len(r["step_peaks_bytes"]) == gpu_suite.STATE_STEPS
    zero = rows["tierflow zero_offload"]
    assert zero["policy_options"] == {"reduce_bucket_size": gpu_suite.zero_bucket(zero["budget_bytes"])}
    # (on this toy model DeepSpeed's method cannot fit, whatever the bucket: ZeRO-Offload
    # keeps every parameter on the device, and ZeRO-Infinity keeps those under its
    # persistence threshold, all of them here; the rows then say so and run the pager)
    assert "no plan fits" in (zero["plan_error"] or "") or not zero["plan_policy"].startswith("lru")


def test_compile_sweep_reports_the_fastest_setting_that_fits(tmp_path):
    s = gpu_suite.Settings(torch.device("cpu"), steps=1, warmup=1, max_warm=3, parity_steps=3, trainer_steps=2,
                           budgets=(1.0, 0.5), compile_backend="eager", traces=0)
    w = gpu_suite.zoo_model("gpt-tiny", 2, 16, s.device)
    guard = gpu_suite.Guard(300, {})
    res = gpu_suite.Results(tmp_path / "r.json", {}, guard)
    plain = {"step_s": 1.0, "peak_bytes": 10**12}  # (every setting fits)
    gpu_suite.compile_rows(w, {"plain": plain}, s, guard, res)
    rows = [r for r in res.rows if r["config"] == "compile"]
    assert [r["activation_memory_budget"] for r in rows] == [1.0, 0.5] and guard.errors == []
    assert all(r["step_s"] > 0 and r["peak_bytes"] > 0 and r["compile_s"] > 0 for r in rows)
    best = res.rows[-1]["fastest_that_fits"]["50%"]
    assert best["step_s"] == min(r["step_s"] for r in rows)
    assert json.loads((tmp_path / "r.json").read_text())["rows"][-1]["config"] == "compile best"
