"""Numbers the report derives from a simulation: where the step's time goes, how busy
each link is. numpy only (no matplotlib), so it is cheap to test and reuse."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .downsample import busy_time, merge_intervals, overlap_time


@dataclass(frozen=True)
class Breakdown:
    """Where one simulated step's time goes.

    Attributes:
        step_s: the step time (compute plus stalls).
        compute_s: time the compute stream ran ops (the ideal step).
        overlapped_s: compute time during which at least one transfer was in flight
            (transfers hidden behind compute).
        alone_s: compute time with no transfer in flight.
        stall_s: time the compute stream waited for tensors.
        stalled_ops: ops that waited at all.
        transfer_busy_s: time at least one transfer was in flight, on any link.
        link_busy_s: per link, time at least one transfer crossed it.
    """

    step_s: float
    compute_s: float
    overlapped_s: float
    alone_s: float
    stall_s: float
    stalled_ops: int
    transfer_busy_s: float
    link_busy_s: dict[str, float] = field(default_factory=dict)

    @property
    def hidden_share(self) -> float:
        """Share of transfer time hidden behind compute (1.0 when nothing moved)."""
        if self.transfer_busy_s <= 0:
            return 1.0
        return min(1.0, self.overlapped_s / self.transfer_busy_s)


def breakdown(result: Any) -> Breakdown | None:
    """The time breakdown of a :class:`~tierflow.simulate.result.SimResult`.

    Args:
        result: a simulated step; one that could not run (``time_s`` infinite) has none.

    Returns:
        A :class:`Breakdown`, or ``None`` when the plan could not run.

    Example:
        >>> from tierflow import load_hardware
        >>> from tierflow.policies import make_plan
        >>> from tierflow.simulate import simulate
        >>> from tierflow.synthetic import gpt_trace
        >>> hw = load_hardware("rtx4090-24g")
        >>> tr = gpt_trace(hw, layers=2, d_model=256, batch=2, seq=128)
        >>> b = breakdown(simulate(tr, hw, make_plan("ideal", tr, hw)))
        >>> b.stall_s, b.transfer_busy_s
        (0.0, 0.0)
    """
    if not math.isfinite(result.time_s):
        return None
    start = np.asarray(result.op_start_s, dtype=np.float64)
    end = np.asarray(result.op_end_s, dtype=np.float64)
    stall = np.asarray(result.op_stall_s, dtype=np.float64)
    step = float(end[-1]) if len(end) else float(result.time_s)
    compute = float(np.sum(end - start))
    ts, te = transfer_intervals(result, 0.0, step)
    busy = busy_time(ts, te, 0.0, step)
    overlapped = overlap_time((start, end), (ts, te)) if len(ts) else 0.0
    link_busy = {}
    for link in sorted({name for r in result.transfers for name in r.links}):
        s, e = transfer_intervals(result, 0.0, step, link=link)
        link_busy[link] = busy_time(s, e, 0.0, step)
    return Breakdown(
        step_s=step,
        compute_s=compute,
        overlapped_s=overlapped,
        alone_s=compute - overlapped,
        stall_s=float(math.fsum(stall.tolist())),
        stalled_ops=int(np.count_nonzero(stall > 0)),
        transfer_busy_s=busy,
        link_busy_s=link_busy,
    )


def transfer_intervals(result: Any, t0: float, t1: float, link: str | None = None,
                       kind: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, ends)`` of the result's transfers clipped to ``[t0, t1]``, optionally
    only those crossing ``link`` or of ``kind`` (evict, prefetch, fault). Transfers
    wholly outside the range are dropped.

    Example:
        >>> from tierflow.simulate.result import SimResult
        >>> transfer_intervals(SimResult("p", "t", "h", 1, 1, 0, {}, {}, True, 1), 0, 1)
        (array([], dtype=float64), array([], dtype=float64))
    """
    recs = [r for r in result.transfers
            if (link is None or link in r.links) and (kind is None or r.kind == kind)]
    s = np.array([r.start_s for r in recs], dtype=np.float64)
    e = np.array([r.end_s for r in recs], dtype=np.float64)
    inside = (e > t0) & (s < t1)
    return np.clip(s[inside], t0, t1), np.clip(e[inside], t0, t1)


def stall_intervals(result: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, ends)`` of the compute stream's waits: op ``i`` waited
    ``op_stall_s[i]`` seconds right before it started. (Where recompute chains ran
    before the op, part of that wait may have come before or between the chains' ops:
    it is drawn just before the op all the same.)"""
    start = np.asarray(result.op_start_s, dtype=np.float64)
    stall = np.asarray(result.op_stall_s, dtype=np.float64)
    hit = stall > 0
    return start[hit] - stall[hit], start[hit]


def phase_intervals(trace: Any, result: Any, phase: str, min_gap: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Merged ``(starts, ends)`` of the ops of one phase (forward, backward, optimizer)."""
    mask = np.array([op.phase == phase for op in trace.ops], dtype=bool)
    start = np.asarray(result.op_start_s, dtype=np.float64)[mask]
    end = np.asarray(result.op_end_s, dtype=np.float64)[mask]
    return merge_intervals(start, end, min_gap=min_gap)
