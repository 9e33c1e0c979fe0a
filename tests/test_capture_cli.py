"""``tierflow capture`` and ``tierflow inspect`` end to end."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tierflow.cli import main
from tierflow.trace import load_trace


@pytest.fixture
def run(capsys):
    def go(*args: str) -> SimpleNamespace:
        rc = main(list(args))
        out = capsys.readouterr()
        return SimpleNamespace(returncode=rc, stdout=out.out, stderr=out.err)

    return go


def test_capture_writes_a_trace_that_inspect_summarises(tmp_path, run):
    out = tmp_path / "g.json.gz"
    r = run("capture", "--model", "gpt-tiny", "--batch", "2", "--seq", "16", "-o", str(out))
    assert r.returncode == 0, r.stderr
    tr = load_trace(out)
    assert tr.meta["model"] == "gpt-tiny" and tr.meta["batch"] == 2 and tr.meta["seq"] == 16
    r = run("inspect", str(out), "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    for key in ("ops", "tensors", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_peak_bytes",
                "peak_live_bytes", "ideal_s"):
        assert key in s
    assert s["ops"] == tr.n_ops and s["peak_live_bytes"] == tr.peak_live_bytes
    assert s["param_bytes"] == 4 * tr.meta["param_count"]
    # a zoo name in place of the file, and the human table
    r = run("inspect", "gpt-tiny", "--batch", "2", "--seq", "16")
    assert r.returncode == 0 and "peak live" in r.stdout


@pytest.mark.parametrize(
    "args,msg",
    [
        (("capture", "--model", "gpt5", "-o", "x.json"), "unknown zoo model"),
        (("capture", "--model", "gpt-tiny", "-o", "x.txt"), ".json"),
        (("capture", "--model", "mlp-tiny", "--seq", "8", "--json"), "not a sequence model"),
        (("inspect", "nope.json"), "nope.json"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, msg, run):
    r = run(*args)
    assert r.returncode == 2
    assert msg in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_capture_list_names_the_zoo(run):
    r = run("capture", "--list", "--json")
    rows = json.loads(r.stdout)
    names = {x["name"] for x in rows}
    assert {"gpt2-medium", "llama-7b", "resnet50", "vit-tiny"} <= names
    assert next(x for x in rows if x["name"] == "gpt2-medium")["params"] == 354_823_168
