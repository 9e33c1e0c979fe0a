"""Shared fixtures. Tests run on the CPU and must stay fast and deterministic."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
G10_DIR = SHARED / "benchmarks" / "g10"
POOL_DIR = SHARED / "benchmarks" / "pool"


@pytest.fixture
def g10_dir() -> Path:
    if not G10_DIR.exists():
        pytest.skip(f"G10 workloads not found at {G10_DIR}")
    return G10_DIR


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a test module (tiny models: more threads only add contention
    and make timing noisy on a shared box); the setting is restored after."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _fixed_durations(trace):
    """``trace`` with every op's time from a fixed cost model (2 us plus the bytes it
    reads and writes at 4 GB/s) instead of the profiled one."""
    from dataclasses import replace

    sizes = trace.sizes
    ops = tuple(replace(o, duration_s=2e-6 + float(sizes[list(o.tensors)].sum()) / 4e9) for o in trace.ops)
    return type(trace)(ops, trace.tensors, name=trace.name, meta=dict(trace.meta, timing="fixed (tests)"))


@pytest.fixture
def fixed_op_times(monkeypatch):
    """The runtime's profiled iteration gets fixed op times, so that the plan it makes
    (and every verdict on it) does not depend on how loaded the machine was. Pair it with
    a given ``hardware=`` (a preset: the CPU default measures the copy bandwidth)."""
    from tierflow.runtime.profiling import Profiling

    real = Profiling._build_trace
    monkeypatch.setattr(Profiling, "_build_trace", lambda self: _fixed_durations(real(self)))
