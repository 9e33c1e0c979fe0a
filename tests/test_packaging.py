"""What a plain ``pip install tierflow`` gets: the default paths' dependencies are core,
the optional ones only make things faster (and a command says so in one line), the
import stays light, and progress never mixes into --json output."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tomllib

from helpers import chain_trace
from tierflow.cli import main

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("scipy", "matplotlib", "numba", "ortools", "rich")


def _modules_after(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, timeout=120).stdout.split()
    return [m for m in HEAVY if m in out]


def test_import_tierflow_is_light():
    assert _modules_after("import tierflow") == []


def test_the_cli_parser_loads_no_solver_or_plotting():
    assert [m for m in _modules_after("from tierflow.cli import build_parser; build_parser()") if m != "rich"] == []


def test_default_paths_dependencies_are_core():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {d.split(">")[0].split("=")[0] for d in meta["dependencies"]}
    assert {"numpy", "torch", "rich", "scipy", "matplotlib"} <= core
    fast = {d.split(">")[0] for d in meta["optional-dependencies"]["fast"]}
    assert fast == {"numba", "ortools"} and not fast & core


def test_pool_says_in_one_line_what_it_runs_without(monkeypatch):
    from tierflow import pool
    from tierflow.pool import _kernels, lns

    monkeypatch.setattr(_kernels, "HAVE_NUMBA", False)
    monkeypatch.setattr(lns, "available", lambda: False)
    note = pool.speed_note("best")
    assert "numba" in note and "OR-Tools" in note and "tierflow[fast]" in note and "\n" not in note
    assert pool.speed_note("greedy") is None


def test_pool_cli_puts_the_note_on_stderr_and_keeps_json_pure(monkeypatch, tmp_path, capsys):
    from tierflow.pool import _kernels

    monkeypatch.setattr(_kernels, "HAVE_NUMBA", False)
    csv = tmp_path / "p.csv"
    csv.write_text("id,lower,upper,size\n0,0,4,8\n1,2,6,4\n2,5,9,8\n")
    assert main(["pool", str(csv), "--solver", "best", "--time-limit", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    res = json.loads(out)
    assert res["valid"] and "numba" in res["note"]
    assert err.count("\n") == 1 and "numba" in err


def test_exact_without_ortools_solves_with_scipys_highs(monkeypatch):
    from tierflow import pool
    from tierflow.pool import Buffer, Problem, lns
    from tierflow.pool.greedy import solve_greedy

    monkeypatch.setattr(lns, "available", lambda: False)
    p = Problem(tuple(Buffer(str(i), *b) for i, b in enumerate([(10, 16, 6), (8, 11, 2), (5, 8, 6), (6, 11, 5),
                                                                  (0, 6, 6)])))
    s = pool.solve(p, "exact", time_limit=20)
    assert s.meta["backend"] == "highs" and pool.validate(p, s.offsets, s.peak).valid
    assert s.optimal and s.peak < solve_greedy(p).peak  # the MILP beats greedy here, and proves it


@pytest.fixture
def terminal(monkeypatch):
    """stderr taken for a terminal by rich (progress is drawn only there)."""
    monkeypatch.setenv("TTY_COMPATIBLE", "1")


def _compare(tmp_path, *extra):
    path = str(chain_trace().save(tmp_path / "chain.json.gz"))
    return main(["compare", path, "--hardware", "rtx4090-24g", "--policies", "lru,deepum", *extra])


def test_progress_is_drawn_on_a_terminal(tmp_path, capsys, terminal):
    assert _compare(tmp_path) == 0
    err = capsys.readouterr().err
    assert "planning lru" in err or "simulating" in err  # the bar's last frame, before it is erased


def test_json_output_stays_pure_on_a_terminal(tmp_path, capsys, terminal):
    assert _compare(tmp_path, "--json") == 0
    out, err = capsys.readouterr()
    assert [r["policy"] for r in json.loads(out)] == ["lru", "deepum"] and err == ""


def test_train_reports_each_step():
    from tierflow.runtime import train

    seen = []
    res = train("mlp-tiny", budget="60%", steps=3, policy="lru",
                progress=lambda what, done, steps, dt, moved: seen.append((what, done, steps, dt > 0, moved)))
    assert [s[:4] for s in seen] == [("tierflow", k, 3, True) for k in (1, 2, 3)]
    moved = [s[4] for s in seen]  # so far: copies still in flight at the last step finish on exit
    assert all(isinstance(m, int) for m in moved) and np.all(np.diff(moved) >= 0)
    assert 0 < moved[-1] <= sum(res.stats.moved_bytes.values())
