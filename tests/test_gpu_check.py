"""benchmarks/gpu_check.py in its CPU mode: every section present and sane, so the one
command meant for a lent GPU cannot rot between GPU sessions."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_mode_writes_every_section(gpu_check, tmp_path, capsys):
    path = tmp_path / "check.json"
    out = gpu_check.main(["--device", "cpu", "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(out))
    assert out["machine"]["torch"] and out["all_parity"] and out["all_within_budget"]
    assert [r["model"] for r in out["results"]] == ["gpt-tiny", "bert-tiny", "vit-tiny"]
    for r in out["results"]:
        assert 0.9 < r["memory"]["ratio"] < 1.1  # capture's peak is the runtime's, no budget
        assert r["parity"]["parity"] is True and r["parity"]["within_budget"]
        names = [row["name"] for row in r["rows"]]
        assert names == ["plain", "tierflow, no budget", "tierflow 50%", "tierflow 30%",
                         "checkpoint (every block)", "save_on_cpu"]
        for row in r["rows"]:
            assert row["step_s"] > 0 and row["x_plain"] > 0
        for row in r["rows"][1:4]:
            assert row["predicted_step_s"] > 0 and row["measured_step_s"] > 0
        budgeted = {row["name"]: row for row in r["rows"][2:4]}
        for name, row in budgeted.items():
            assert row["peak_bytes"] <= row["budget_bytes"], name
    text = capsys.readouterr().out
    assert "parity everywhere: True" in text and "x plain" in text


def test_time_limit_skips_rows_and_says_so(gpu_check, tmp_path):
    out = gpu_check.main(["--device", "cpu", "--models", "mlp-tiny", "--time-limit", "0", "--json",
                          str(tmp_path / "c.json")])
    assert out["results"] == [{"model": "mlp-tiny", "skipped": "time limit"}]
