"""Thin large series to what a figure can show without losing what matters.

A figure is a few thousand pixels wide, a trace can produce millions of memory events
or transfers. Two reductions keep every visible feature:

* :func:`minmax_indices` / :func:`downsample_steps` split the time axis into one bucket
  per pixel and keep, per bucket, the first, last, lowest and highest sample (the M4
  scheme): the drawn line is the same at that width and no peak is lost.
* :func:`merge_intervals` joins busy intervals whose gap is under a pixel and widens
  ones narrower than a pixel, so a Gantt row stays faithful (and short stalls stay
  visible) with a bounded number of bars.

numpy only; nothing here imports matplotlib.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def minmax_indices(t: np.ndarray, y: np.ndarray, buckets: int, t0: float | None = None,
                   t1: float | None = None) -> np.ndarray:
    """Indices of the samples to keep: per time bucket its first, last, min and max.

    Args:
        t: sample times, non-decreasing.
        y: sample values, same length as ``t``.
        buckets: number of equal-width time buckets (about the figure's width in pixels).
        t0, t1: the bucketed range (default: the first and last time); samples outside
            fall in the first or last bucket.

    Returns:
        Sorted unique indices into ``t``; all of them when there are at most
        ``4 * buckets`` samples.

    Raises:
        ValueError: ``t`` and ``y`` differ in length, or ``buckets < 1``.

    Example:
        >>> t = np.arange(10_000.0); y = np.zeros(10_000); y[1234] = 5
        >>> idx = minmax_indices(t, y, 100)
        >>> bool(y[idx].max() == 5) and len(idx) <= 400
        True
    """
    t = np.asarray(t, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if t.shape != y.shape or t.ndim != 1:
        raise ValueError(f"t and y must be 1-d and the same length, got {t.shape} and {y.shape}")
    if buckets < 1:
        raise ValueError(f"buckets must be at least 1, got {buckets}")
    n = len(t)
    if n <= 4 * buckets:
        return np.arange(n)
    lo = float(t[0]) if t0 is None else float(t0)
    hi = float(t[-1]) if t1 is None else float(t1)
    width = (hi - lo) / buckets if hi > lo else 1.0
    b = np.clip(((t - lo) / width).astype(np.int64), 0, buckets - 1)
    # t is sorted, so each bucket is a contiguous run of samples
    starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
    ends = np.r_[starts[1:], n] - 1
    argmin = _segment_arg(y, starts, np.minimum)
    argmax = _segment_arg(y, starts, np.maximum)
    keep = np.concatenate([starts, ends, argmin, argmax])
    return np.unique(keep)


def _segment_arg(y: np.ndarray, starts: np.ndarray, op: np.ufunc) -> np.ndarray:
    """Per contiguous segment (given by its start), the index of its first extreme."""
    ext = op.reduceat(y, starts)
    seg = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(y)]))
    hit = np.flatnonzero(y == ext[seg])
    # the first hit of each segment
    first = np.unique(seg[hit], return_index=True)[1]
    return hit[first]


def step_values(t: np.ndarray, y: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Values of the step curve ``(t, y)`` (each value holds until the next time) at
    times ``at``; 0 before the first sample.

    Example:
        >>> step_values(np.array([0.0, 1.0]), np.array([2.0, 3.0]), np.array([-1, 0.5, 1, 9]))
        array([0., 2., 3., 3.])
    """
    t = np.asarray(t, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if len(t) == 0:
        return np.zeros(len(at))
    i = np.searchsorted(t, at, side="right") - 1
    return np.where(i >= 0, y[np.clip(i, 0, None)], 0.0)


def downsample_steps(curves: Sequence[tuple[np.ndarray, np.ndarray]], buckets: int,
                     t0: float, t1: float) -> tuple[np.ndarray, list[np.ndarray]]:
    """Put several step curves on one time grid and thin it, keeping every curve's
    per-bucket extremes (so a stacked plot of them keeps its peaks).

    The curves are first stacked (cumulative sums on the union of their times), then
    per bucket the first, last, min and max sample of every stacked level is kept.

    Args:
        curves: ``(times, values)`` step curves, each sorted by time.
        buckets: pixel buckets across ``[t0, t1]``.
        t0, t1: the time range shown; samples outside it are dropped, and each curve's
            value at ``t0`` starts the grid.

    Returns:
        ``(times, values)``: one shared time grid and, per curve, its (unstacked) values
        on it.

    Raises:
        ValueError: ``buckets < 1`` or ``t1 < t0``.

    Example:
        >>> t, (a,) = downsample_steps([(np.array([0.0, 2.0]), np.array([1.0, 0.0]))], 10, 0, 4)
        >>> t.tolist(), a.tolist()
        ([0.0, 2.0], [1.0, 0.0])
    """
    if buckets < 1:
        raise ValueError(f"buckets must be at least 1, got {buckets}")
    if t1 < t0:
        raise ValueError(f"empty range: t1 {t1} < t0 {t0}")
    parts = [np.asarray(c[0], dtype=np.float64) for c in curves]
    grid = np.unique(np.concatenate([[t0], *parts])) if parts else np.array([t0])
    grid = grid[(grid >= t0) & (grid <= t1)]
    vals = [step_values(c[0], c[1], grid) for c in curves]
    if len(grid) <= 4 * buckets:
        return grid, vals
    levels = np.cumsum(np.vstack(vals), axis=0) if vals else np.zeros((0, len(grid)))
    keep = [minmax_indices(grid, lev, buckets, t0, t1) for lev in levels]
    idx = np.unique(np.concatenate(keep)) if keep else np.arange(len(grid))
    return grid[idx], [v[idx] for v in vals]


def merge_intervals(starts: np.ndarray, ends: np.ndarray, min_width: float = 0.0,
                    min_gap: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals, for drawing as bars at a given resolution.

    Args:
        starts, ends: interval bounds (any order; ``end >= start``).
        min_width: intervals narrower than this are widened to it (centred), so a
            sub-pixel stall still shows as one pixel.
        min_gap: intervals closer than this are joined.

    Returns:
        ``(starts, ends)`` of disjoint intervals, sorted.

    Raises:
        ValueError: the arrays differ in length.

    Example:
        >>> merge_intervals(np.array([0.0, 1.0, 5.0]), np.array([2.0, 3.0, 5.0]), min_width=0.5)
        (array([0.  , 4.75]), array([3.  , 5.25]))
    """
    s = np.asarray(starts, dtype=np.float64)
    e = np.asarray(ends, dtype=np.float64)
    if s.shape != e.shape:
        raise ValueError(f"starts and ends differ in length: {s.shape} vs {e.shape}")
    if len(s) == 0:
        return s.copy(), e.copy()
    narrow = (e - s) < min_width
    mid = (s + e) / 2
    s = np.where(narrow, mid - min_width / 2, s)
    e = np.where(narrow, mid + min_width / 2, e)
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    # a new interval begins where it starts beyond (reach of all before it) + min_gap
    new = np.r_[True, s[1:] > reach[:-1] + min_gap]
    first = np.flatnonzero(new)
    last = np.r_[first[1:], len(s)] - 1
    return s[first], reach[last]


def busy_time(starts: np.ndarray, ends: np.ndarray, t0: float, t1: float) -> float:
    """Seconds within ``[t0, t1]`` covered by at least one interval.

    Example:
        >>> busy_time(np.array([0.0, 1.0]), np.array([2.0, 3.0]), 0.5, 10)
        2.5
    """
    s, e = merge_intervals(np.clip(starts, t0, t1), np.clip(ends, t0, t1))
    return float(np.sum(e - s))


def overlap_time(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """Seconds covered by both interval sets (each given as ``(starts, ends)``).

    Example:
        >>> overlap_time((np.array([0.0]), np.array([4.0])), (np.array([1.0, 3.0]), np.array([2.0, 9.0])))
        2.0
    """
    sa, ea = merge_intervals(*a)
    sb, eb = merge_intervals(*b)
    if len(sa) == 0 or len(sb) == 0:
        return 0.0
    # for each interval of a, the covered length of b inside it, via cumulative coverage
    cum = np.r_[0.0, np.cumsum(eb - sb)]

    def covered_until(x: np.ndarray) -> np.ndarray:
        i = np.searchsorted(sb, x, side="right")  # intervals of b starting at or before x
        full = cum[np.maximum(i - 1, 0)]
        part = np.where(i > 0, np.clip(x - sb[np.maximum(i - 1, 0)], 0, eb[np.maximum(i - 1, 0)]
                                      - sb[np.maximum(i - 1, 0)]), 0.0)
        return np.where(i > 0, full + part, 0.0)

    return float(np.sum(covered_until(ea) - covered_until(sa)))
