"""A shorter soak than ``benchmarks/runtime_soak.py`` (1,000 steps): 200 steps with every
movable tensor through host and SSD each step; RSS, open files and tier slots stay flat."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "runtime_soak.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("runtime_soak", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.soak


def test_soak_200_steps_flat(soak, tmp_path):
    r = soak("mlp-tiny", steps=200, every=50, ssd_dir=str(tmp_path))
    g = r["growth"]
    assert r["moved_bytes"]["host"] > 0 and r["moved_bytes"]["ssd"] > 0
    assert g["fds"] == 0
    assert g["host"] == 0 and g["ssd"] == 0  # the same slots at every step boundary
    assert all(s["bounce"] <= 64 << 10 for s in r["samples"])  # at most a write in flight
    assert g["rss"] < 4 << 20, g  # 200 steps move ~50 MiB: none of it may stay
    assert list(tmp_path.iterdir()) == []
