"""The runtime: execute a plan in real PyTorch training.

``tierflow.offload(model, optimizer, budget=..., policy=..., ssd_dir=...)`` returns a
context manager; the user's loop runs inside it unchanged.

Layout (one job per module; :class:`~.executor.Run` is assembled from mixins and holds
components, each the one writer of its state: docs/runtime.md, "Front-ends and back-ends"):

- :mod:`.executor`: ``Run`` and ``offload``: the dispatch mode, the iteration's
  lifecycle (begin, end, profile or follow, a departure from the trace), and the per-op
  handler.
- :mod:`.storages`: the record of each device storage (``_Entry``) and ``StorageTable``,
  the component that owns the records (by address, by key, the LRU order, deaths,
  foreign storages, the iteration's trace ids); the ``StorageTracking`` mixin: the
  saved-tensor and gradient hooks that label them, collectives in flight.
- :mod:`.moves`: ``Mover``, the back-end that moves a storage's bytes between the
  device, the host pool and the SSD file and retires finished copies and writes; the
  ``Moves`` mixin: room within the budget, inputs made resident.
- :mod:`.follow`: ``Follower``, the component that follows a plan op by op (the moves
  after each op, planned prefetches waiting for room); the ``PlanFollowing`` mixin: a
  plan's move table and pool layout made (returned, for its ``FollowedPlan``), victims
  for the pager, the move probe.
- :mod:`.followed_plan`: ``FollowedPlan``, the plan being followed as one record (its
  trace, plan, machine model, move table, layout, retimer, recomputer, per-op tables):
  made by ``Profiling._make_plan``, kept per signature by :mod:`.signatures`' plan
  cache, made the run's by ``Run._take_plan`` alone (``Run`` keeps aliases of its fields
  for the lean path).
- :mod:`.profiling`: the profiled iteration to a trace, the plan and its prediction,
  the minimum-working-set check. Components it asks: :mod:`.profile_record`
  (``ProfileRecord``: the profiled iteration's ops, their times, what the loop held),
  :mod:`.profile_schedule` (``ProfileSchedule``: whether the next iteration is
  profiled, and why), :mod:`.machine_model` (``MachineModel``: the hardware plans are
  made for, from what is measured here).
- :mod:`.step_clock`: the steps' times (``StepClock``) and whether
  ``optimizer.step()`` is running (``StepNesting``).
- :mod:`.opfacts`: the profiled ops' module scopes (a scope tracker active for the
  profiled iteration only) and ``rng``/``pure`` flags, as capture records them.
- :mod:`.optim_chunks`: the user's optimizer step run in parameter chunks that fit the
  budget (foreach and fused optimizers), leaving out what host steps update.
- :mod:`.recompute`: the plan's recompute chains executed (``Recomputer``, one per
  plan: drops, records, replays).
- :mod:`.host_step`: the plan's host-side optimizer steps (still a mixin: it works
  through the storage records and the mover as ``Run`` methods).
- :mod:`.tiers` (host pool, SSD file), :mod:`.streams` (the copy layer),
  :mod:`.stats` (``RunStats``), :mod:`.distributed` (ranks planning together),
  :mod:`.plans` (the round-trip test plan), :mod:`.training` (``tierflow train`` and the
  demo on a zoo model), :mod:`.cli`.
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
    "RunStats": ".stats",
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
