"""What a simulation reports: headline numbers and the per-op timeline plots use."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np


class TransferRecord(NamedTuple):
    """One transfer of the reported iteration; times in seconds from its start."""

    tensor: int
    nbytes: int
    src: str
    dst: str
    kind: str  # evict | prefetch | fault | host_grad | host_param (a host step's copies)
    issue_s: float
    start_s: float
    end_s: float
    links: tuple[str, ...]


class RecomputeRecord(NamedTuple):
    """One recompute chain run in the reported iteration (compute stream)."""

    index: int  # in Plan.recomputes
    before_op: int
    ops: int  # ops re-run
    start_s: float
    end_s: float  # includes any wait for room or inputs between its ops


class HostStepRecord(NamedTuple):
    """One host-side optimizer update of the reported iteration (the host-compute
    stream): queued when its gradient arrived (``issue_s``), run from ``start_s`` to
    ``end_s`` (``nan`` when it ends after the simulation does)."""

    param: int
    nbytes: int  # bytes it processes: parameter, gradient and optimizer state
    issue_s: float
    start_s: float
    end_s: float


@dataclass
class PoolAccount:
    """The device tier laid out as one arena by the pool planner
    (:func:`tierflow.simulate.pooled.simulate_pooled`; semantics in that module).

    Attributes:
        solver: the pool solver (``greedy`` or ``best``).
        live_peak_bytes: the most device bytes held at once in the last round (the
            simulator's device peak: what a perfect allocator needs).
        lower_bound_bytes: the pool problem's lower bound: the live peak plus what
            laying out tensors held across the cut of the repeating iteration as one
            block each adds (``tierflow.simulate.pooled``).
        arena_peak_bytes: the arena the layout needs.
        budget_bytes: what the arena must fit (the plan's budget).
        effective_budget_bytes: the budget the last round was simulated with.
        rounds: simulations run (1 = the arena fitted at once).
        buffers: blocks laid out in the last round.
        spanning: tensors held across that cut, laid out over the whole iteration.
        fits: the last round's arena fits the budget.
        shrink: how a lower budget was simulated: ``same plan`` or ``replan``.
        optimal: the solver proved its last layout minimal.
        solve_s: seconds the solver took, all rounds.
        history: per round, the budget, live peak, lower bound, arena peak, step time
            and error (``None`` when the round ran).
    """

    solver: str
    live_peak_bytes: int
    lower_bound_bytes: int
    arena_peak_bytes: int
    budget_bytes: float
    effective_budget_bytes: float
    rounds: int
    buffers: int
    spanning: int
    fits: bool
    shrink: str
    optimal: bool = False
    solve_s: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def fragmentation_bytes(self) -> int:
        """Arena bytes beyond the live peak: what the static layout costs over byte counting."""
        return self.arena_peak_bytes - self.live_peak_bytes

    @property
    def fragmentation_ratio(self) -> float:
        """Fragmentation over the live peak (0.0 = the arena is the live peak)."""
        return self.fragmentation_bytes / self.live_peak_bytes if self.live_peak_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        def num(v: float) -> int | None:
            return int(v) if math.isfinite(v) else None

        return {
            "solver": self.solver,
            "live_peak_bytes": self.live_peak_bytes,
            "lower_bound_bytes": self.lower_bound_bytes,
            "arena_peak_bytes": self.arena_peak_bytes,
            "fragmentation_bytes": self.fragmentation_bytes,
            "fragmentation_ratio": self.fragmentation_ratio,
            "budget_bytes": num(self.budget_bytes),
            "effective_budget_bytes": num(self.effective_budget_bytes),
            "rounds": self.rounds,
            "buffers": self.buffers,
            "spanning": self.spanning,
            "fits": self.fits,
            "shrink": self.shrink,
            "optimal": self.optimal,
            "solve_s": self.solve_s,
            "history": [
                {k: (num(v) if k == "budget_bytes" else v) for k, v in h.items()} for h in self.history
            ],
        }


@dataclass
class SimResult:
    """The steady-state (second) iteration of a simulated plan.

    Attributes:
        time_s: iteration time; ``inf`` when the plan cannot run (see ``error``).
        ideal_s: sum of op durations (unlimited device memory, no transfers).
        ratio: ``ideal_s / time_s`` (1.0 is perfect; 0 when it cannot run).
        stall_s: time the compute stream waited for tensors.
        traffic_bytes: bytes moved over each link during the iteration.
        peak_bytes: highest bytes held (resident or reserved) per tier.
        fits: the plan ran within the device's capacity.
        op_start_s, op_end_s, op_stall_s: per op, seconds from the iteration start.
        issuing_s: compute-stream seconds spent issuing transfers (the hardware's
            ``move_issue_s`` per transfer, and with ``host_copies`` its bytes at the
            route's rate; part of ``time_s``). With ``async_launch``
            that cost is on the host timeline instead (in ``host_wait_s``).
        host_wait_s: compute-stream seconds the runtime's host costs took
            (``op_issue_s``, ``recompute_issue_s``, ``host_step_issue_s``; with
            ``async_launch`` also ``move_issue_s``): all of them in CPU mode, only the
            time the device waited for a host that fell behind with ``async_launch``;
            part of ``time_s``.
        transfers: every transfer issued in the iteration.
        memory: per tier, a step curve ``(times_s, bytes)``.
        pool: with a planned pool (``simulate_pooled``), how the device arena fared;
            ``None`` for plain byte counting.
        recompute_s: compute-stream seconds of recompute chains (their ops' durations).
        recompute_ops: ops re-run.
        recomputes: every chain run, for the timeline.
        host_step_s: host-compute seconds of the host steps' updates.
        host_op_s: compute-stream seconds the host-stepped optimizer ops no longer take
            (``time_s = ideal_s + stall_s + issuing_s + host_wait_s + recompute_s
            - host_op_s``).
        host_step_bytes: bytes the host steps copied (gradients down, parameters up).
        host_steps: every host update, for the timeline.
    """

    policy: str
    trace: str
    hardware: str
    time_s: float
    ideal_s: float
    stall_s: float
    traffic_bytes: dict[str, int]
    peak_bytes: dict[str, int]
    fits: bool
    budget_bytes: float
    error: str | None = None
    faults: int = 0
    fault_bytes: int = 0
    skipped_moves: int = 0
    issuing_s: float = 0.0
    host_wait_s: float = 0.0
    op_start_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    op_end_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    op_stall_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    transfers: list[TransferRecord] = field(default_factory=list)
    memory: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    pool: PoolAccount | None = None
    recompute_s: float = 0.0
    recompute_ops: int = 0
    recomputes: list[RecomputeRecord] = field(default_factory=list)
    host_step_s: float = 0.0
    host_op_s: float = 0.0
    host_step_bytes: int = 0
    host_steps: list[HostStepRecord] = field(default_factory=list)

    @classmethod
    def unplanned(cls, policy: str, trace: Any, hardware: Any, reason: str) -> SimResult:
        """The result of a policy that could make no plan (it cannot fit)."""
        return cls(
            policy=policy,
            trace=trace.name,
            hardware=hardware.name,
            time_s=math.inf,
            ideal_s=trace.ideal_s,
            stall_s=math.inf,
            traffic_bytes={link.name: 0 for link in hardware.links},
            peak_bytes={t.name: 0 for t in hardware.tiers},
            fits=False,
            budget_bytes=hardware.device_capacity,
            error=reason,
        )

    @property
    def ratio(self) -> float:
        if not math.isfinite(self.time_s) or self.time_s <= 0:
            return 0.0 if not math.isfinite(self.time_s) else 1.0
        return self.ideal_s / self.time_s

    def to_dict(self) -> dict[str, Any]:
        """The JSON form the CLI prints (``--json``); ``pool`` only with a planned pool."""
        out = {
            "policy": self.policy,
            "time_s": self.time_s,
            "ideal_s": self.ideal_s,
            "ratio": self.ratio,
            "stall_s": self.stall_s,
            "traffic_bytes": dict(self.traffic_bytes),
            "peak_bytes": dict(self.peak_bytes),
            "fits": self.fits,
            "budget_bytes": None if self.budget_bytes == math.inf else int(self.budget_bytes),
            "faults": self.faults,
            "error": self.error,
        }
        if self.host_wait_s:
            out["host_wait_s"] = self.host_wait_s
        if self.pool is not None:
            out["pool"] = self.pool.to_dict()
        if self.recompute_ops or self.host_steps or self.host_step_s:
            out.update(recompute_s=self.recompute_s, recompute_ops=self.recompute_ops,
                       host_step_s=self.host_step_s, host_op_s=self.host_op_s,
                       host_step_bytes=self.host_step_bytes)
        return out
