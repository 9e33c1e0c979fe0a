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
    kind: str  # evict | prefetch | fault
    issue_s: float
    start_s: float
    end_s: float
    links: tuple[str, ...]


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
        transfers: every transfer issued in the iteration.
        memory: per tier, a step curve ``(times_s, bytes)``.
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
    op_start_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    op_end_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    op_stall_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    transfers: list[TransferRecord] = field(default_factory=list)
    memory: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

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
        """The JSON form the CLI prints (``--json``)."""
        return {
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
