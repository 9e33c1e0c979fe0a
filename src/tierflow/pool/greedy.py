"""Greedy by size with best fit: SmartPool's and TFLite's heuristic.

Buffers are taken largest first, cross-iteration blocks (live at both ends of the
horizon) before all others as SmartPool does, and each goes into the smallest gap that
holds it among the buffers already placed and live at the same time; if no gap holds it,
on top of them.
"""

from __future__ import annotations

import time

import numpy as np

from .problem import Problem, Solution, peak_of


def size_order(problem: Problem) -> np.ndarray:
    """SmartPool's order: cross-iteration blocks first, then by size, largest first;
    ties by earlier start, then input order."""
    return np.lexsort((np.arange(len(problem)), problem.lower, -problem.units, ~problem.cross_iteration))


def best_fit(lower: np.ndarray, upper: np.ndarray, units: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Place buffers in ``order``, each into the tightest gap that fits (lowest on ties).

    Works in alignment units; returns offsets in units. The buffers already placed are
    kept in arrays in placement order, so finding the ones live alongside the next
    buffer is one vectorised comparison rather than a walk over pairs.
    """
    n = len(order)
    offsets = np.zeros(len(lower), dtype=np.int64)
    p_lo = np.empty(n, dtype=np.int64)
    p_hi = np.empty(n, dtype=np.int64)
    p_off = np.empty(n, dtype=np.int64)
    p_end = np.empty(n, dtype=np.int64)
    for k, i in enumerate(order.tolist()):
        lo, hi, sz = lower[i], upper[i], units[i]
        live = np.flatnonzero((p_lo[:k] < hi) & (p_hi[:k] > lo))
        off = 0
        if live.size and sz > 0:
            off = lowest_gap(p_off[live], p_end[live], sz, tight=True)
        offsets[i] = off
        p_lo[k], p_hi[k], p_off[k], p_end[k] = lo, hi, off, off + sz
    return offsets


def lowest_gap(offs: np.ndarray, ends: np.ndarray, size: int, tight: bool) -> int:
    """Where a block of ``size`` goes among blocks ``[offs, ends)`` that are live with it:
    the tightest gap that holds it (``tight``) or the lowest one, else on top of them all.
    """
    srt = np.argsort(offs, kind="stable")
    starts = offs[srt]
    tops = np.maximum.accumulate(ends[srt])
    # the gap before each placed block begins at the highest end below it
    gap_lo = np.empty_like(starts)
    gap_lo[0] = 0
    gap_lo[1:] = tops[:-1]
    room = starts - gap_lo
    fits = np.flatnonzero(room >= size)
    if not fits.size:
        return int(tops[-1])
    j = fits[np.argmin(room[fits])] if tight else fits[0]
    return int(gap_lo[j])


def solve_greedy(problem: Problem, order: np.ndarray | None = None) -> Solution:
    """Greedy by size, best fit. ``order`` overrides the placement order."""
    t0 = time.perf_counter()
    if order is None:
        order = size_order(problem)
    units = best_fit(problem.lower, problem.upper, problem.units, order)
    offsets = units * problem.alignment
    return Solution(
        offsets=offsets,
        peak=peak_of(problem, offsets),
        lower_bound=problem.lower_bound,
        solver="greedy",
        seconds=time.perf_counter() - t0,
        optimal=peak_of(problem, offsets) == problem.lower_bound,
    )
