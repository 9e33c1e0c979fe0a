import json

import pytest

from helpers import chain_trace
from tierflow.cli import main

KEYS = {"policy", "time_s", "ideal_s", "ratio", "stall_s", "traffic_bytes", "peak_bytes", "fits"}


@pytest.fixture
def trace_file(tmp_path):
    return str(chain_trace().save(tmp_path / "chain.json.gz"))


def test_simulate_json(trace_file, capsys):
    assert main(["simulate", trace_file, "--hardware", "rtx4090-24g", "--policy", "lru", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert KEYS <= set(out) and out["policy"] == "lru" and out["fits"] is True


def test_compare_json_lists_every_policy(trace_file, capsys):
    assert main(["compare", trace_file, "--hardware", "rtx4090-24g", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in out][:3] == ["ideal", "lru", "deepum"]
    assert all(KEYS <= set(r) for r in out)


def test_compare_table(trace_file, capsys):
    assert main(["compare", trace_file, "--hardware", "g10-a100", "--policies", "ideal,lru", "--budget", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "of ideal" in out and "lru" in out and "fits" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["simulate", "nope.json"], "nope.json: no such file"),
        (["simulate", "{trace}", "--policy", "magic"], "unknown policy 'magic'"),
        (["simulate", "{trace}", "--hardware", "warp-drive"], "neither a hardware preset"),
        (["simulate", "{trace}", "--budget", "12 parsecs"], "not a size"),
        (["simulate", "{trace}", "--budget", "1KiB"], "no plan can fit"),
        (["simulate", "{trace}", "--budget", "1TiB"], "exceeds"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(trace_file, capsys, argv, message):
    argv = [a.replace("{trace}", trace_file) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_hardware_list_and_show(capsys):
    assert main(["hardware", "list"]) == 0
    assert "g10-a100" in capsys.readouterr().out
    assert main(["hardware", "show", "g10-a100"]) == 0
    assert 'name = "g10-a100"' in capsys.readouterr().out


def test_hardware_show_and_list_json_carry_host_compute(capsys, tmp_path):
    import json

    assert main(["hardware", "show", "rtx4090-24g"]) == 0
    shown = capsys.readouterr().out
    assert "[host_compute]\noptimizer_gbps = 22.6\n" in shown
    # what show prints reads back, host_compute included
    (tmp_path / "box.toml").write_text(shown.replace("optimizer_gbps = 22.6", "optimizer_gbps = 7.5"))
    assert main(["hardware", "show", str(tmp_path / "box.toml")]) == 0
    assert "optimizer_gbps = 7.5" in capsys.readouterr().out
    assert main(["hardware", "list", "--json"]) == 0
    listed = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert listed["g10-a100"]["host_compute"]["optimizer_bytes_per_s"] == 22.6e9
    assert "PR #735" in listed["g10-a100"]["host_compute"]["source"]


def test_demo_runs_and_explains(capsys):
    # the synthetic trace and two policies keep this quick; make demo runs the full set
    assert main(["demo", "--synthetic", "--policies", "ideal,deepum", "--no-train"]) == 0
    out = capsys.readouterr().out
    assert "does not fit" in out and "Best here" in out


def test_demo_json_covers_capture_plan_and_training(capsys):
    argv = ["demo", "--model", "mlp-tiny", "--batch", "64", "--hardware", "g10-a100",
            "--policies", "ideal,lru", "--train-model", "gpt-tiny", "--steps", "3", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in out["results"]] == ["ideal", "lru"]
    assert out["trace"]["ops"] > 0
    assert out["train"]["parity"] is True
    assert out["train"]["moved_bytes"]["host"] > 0 and out["train"]["moved_bytes"]["ssd"] > 0


@pytest.fixture
def offload_trace_file(tmp_path):
    """A 3-layer training trace that needs offloading at a budget of 272 MB."""
    from tierflow.synthetic import training_trace

    trace = training_trace(3, [25, 60, 12, 57, 6, 38, 35, 54, 18, 55, 41, 54, 12, 46], [5] * 11)
    return str(trace.save(tmp_path / "train.json.gz"))


def _plan(trace, out, policy, capsys, *extra):
    argv = ["plan", trace, "--hardware", "rtx4090-24g", "--budget", "272000000", "--policy", policy,
            "-o", str(out), "--json", *extra]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_writes_a_plan_that_simulate_replays(offload_trace_file, tmp_path, capsys):
    out = _plan(offload_trace_file, tmp_path / "singa.json", "singa", capsys)
    assert out["policy"] == "singa" and out["moves"] > 0 and out["incumbent"] is None
    assert main(["simulate", offload_trace_file, "--hardware", "rtx4090-24g",
                 "--plan-file", out["plan_file"], "--json"]) == 0
    replay = json.loads(capsys.readouterr().out)
    assert replay["time_s"] == pytest.approx(out["predicted_step_s"], rel=1e-12)


def test_plan_keeps_an_incumbent_that_is_faster_here(offload_trace_file, tmp_path, capsys):
    old = _plan(offload_trace_file, tmp_path / "singa.json", "singa", capsys)
    new = _plan(offload_trace_file, tmp_path / "lru.json", "lru", capsys, "--incumbent", old["plan_file"])
    # lru's pager stalls more than singa's planned swaps here, so singa's plan stays
    assert new["incumbent"]["kept"] and new["policy"] == "singa"
    assert new["predicted_step_s"] == old["predicted_step_s"] < new["incumbent"]["new_step_s"]
    from tierflow.plan import Plan

    assert Plan.load(new["plan_file"]).moves == Plan.load(old["plan_file"]).moves


def test_plan_replaces_an_incumbent_that_is_slower_here(offload_trace_file, tmp_path, capsys):
    old = _plan(offload_trace_file, tmp_path / "lru.json", "lru", capsys)
    new = _plan(offload_trace_file, tmp_path / "singa.json", "singa", capsys, "--incumbent", old["plan_file"])
    assert not new["incumbent"]["kept"] and new["policy"] == "singa"
    assert new["predicted_step_s"] < new["incumbent"]["incumbent_step_s"] == old["predicted_step_s"]


def test_plan_does_not_compare_an_incumbent_over_the_budget(offload_trace_file, tmp_path, capsys):
    old = _plan(offload_trace_file, tmp_path / "singa.json", "singa", capsys)
    argv = ["plan", offload_trace_file, "--hardware", "rtx4090-24g", "--budget", "250000000",
            "--policy", "lru", "-o", str(tmp_path / "lru.json"), "--incumbent", old["plan_file"]]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "lru plan" in text and "not compared: its budget (259.40 MiB) is above this one" in text


def test_plan_to_a_missing_directory_fails_before_planning(offload_trace_file, tmp_path, capsys):
    argv = ["plan", offload_trace_file, "-o", str(tmp_path / "nope" / "p.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no such directory" in err and err.count("\n") == 1


def test_plan_does_not_compare_an_incumbent_made_for_another_trace(offload_trace_file, trace_file, tmp_path, capsys):
    old = _plan(offload_trace_file, tmp_path / "singa.json", "singa", capsys)
    argv = ["plan", trace_file, "--hardware", "rtx4090-24g", "--policy", "lru",
            "-o", str(tmp_path / "lru.json"), "--incumbent", old["plan_file"], "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "lru" and "made for another trace" in out["incumbent"]["rejected"]
