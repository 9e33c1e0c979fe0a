"""The runtime: execute a plan in real PyTorch training.

``tierflow.offload(model, optimizer, budget=..., policy=..., ssd_dir=...)`` returns a
context manager; the user's loop runs inside it unchanged. See
:mod:`tierflow.runtime.executor` for how, :mod:`.tiers` for the host pool and SSD file,
:mod:`.streams` for the copies, :mod:`.plans` for the round-trip test plan, and
:func:`demo_run` / ``tierflow train`` for a whole pipeline on a zoo model.
"""

from __future__ import annotations

import importlib
from typing import Any

# The executor imports torch; load it on first use so that the CLI (which registers the
# ``train`` command on every start) and ``import tierflow`` stay fast.
_LAZY = {
    "BudgetError": ".errors",
    "OffloadError": ".errors",
    "SSDError": ".errors",
    "RankMismatchError": ".distributed",
    "Run": ".executor",
    "RunStats": ".executor",
    "offload": ".executor",
    "roundtrip_plan": ".plans",
    "TrainResult": ".training",
    "demo_run": ".training",
    "train": ".training",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
