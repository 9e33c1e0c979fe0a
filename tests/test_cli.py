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
