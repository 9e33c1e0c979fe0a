"""The runtime: execute a plan in real PyTorch training.

``tierflow.offload(model, optimizer, budget=..., policy=..., ssd_dir=...)`` returns a
context manager; the user's loop runs inside it unchanged. See
:mod:`tierflow.runtime.executor` for how, :mod:`.tiers` for the host pool and SSD file,
:mod:`.streams` for the copies, :mod:`.plans` for the round-trip test plan, and
:func:`demo_run` / ``tierflow train`` for a whole pipeline on a zoo model.
"""

from .errors import BudgetError, OffloadError, SSDError
from .executor import Run, RunStats, offload
from .plans import roundtrip_plan
from .train import TrainResult, demo_run, train

__all__ = [
    "BudgetError",
    "OffloadError",
    "Run",
    "RunStats",
    "SSDError",
    "TrainResult",
    "demo_run",
    "offload",
    "roundtrip_plan",
    "train",
]
