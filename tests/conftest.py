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
