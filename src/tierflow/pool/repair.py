"""Local repair of a placement: close the hole under the peak at its tightest instant.

A placement that misses the lower bound leaves, at every instant its peak buffer is
live, some free bytes below the peak. Greedy placements typically leave one hole at the
instant where the live total is largest: the buffers above that hole were stacked on
things that are live *around* the instant, not at it. The repair move:

1. take a buffer at the peak and the instant ``t`` in its lifetime where the most bytes
   are live (the tightest one); ``h`` is the bottom of one of the free ranges of the
   column at ``t`` (the highest :data:`HOLES` of them are tried, highest first: their
   bands are the smallest);
2. lift the band: every buffer whose offset is at least ``h`` (at any time) is removed,
   the rest stay fixed;
3. the removed buffers live at ``t`` go back first, in their old offset order, so the
   column drops into the hole; the others go back after them, either largest first
   with every buffer of the move put into the tightest gap that holds it (greedy's
   rule), or, should that not help, in their old offset order with every buffer put at
   the lowest offset that holds it.

A move is kept when it lowers the number of buffers reaching above ``target`` (then the
peak): dropping a column can leave one displaced buffer sticking out higher, which the
next move works on. The lowest-peak placement seen is returned, so the result is never
worse than the input. Moves repeat until the peak reaches ``target``, no move is kept,
or ``max_moves`` moves ran. Nothing reads the clock except against ``deadline``; with a
deadline that does not bind the result depends only on the input.
"""

from __future__ import annotations

import time

import numpy as np

from .greedy import lowest_gap

# holes of the column a move tries lifting the band above, highest first
HOLES = 4


def place(
    lower: np.ndarray,
    upper: np.ndarray,
    units: np.ndarray,
    offsets: np.ndarray,
    fixed: np.ndarray,
    order: np.ndarray,
    tight: bool,
) -> np.ndarray:
    """Place the buffers ``order`` (in that order) around the ``fixed`` ones.

    Each goes into the tightest gap that holds it among the buffers already placed and
    live alongside it (``tight``; lowest on ties), or into the lowest such gap
    (``tight=False``), else on top of them. Returns new offsets (a copy; fixed buffers
    keep theirs).
    """
    off = offsets.copy()
    fix = np.flatnonzero(fixed)
    n = len(fix) + len(order)
    p_lo = np.empty(n, dtype=np.int64)
    p_hi = np.empty(n, dtype=np.int64)
    p_off = np.empty(n, dtype=np.int64)
    p_end = np.empty(n, dtype=np.int64)
    k = len(fix)
    p_lo[:k], p_hi[:k], p_off[:k], p_end[:k] = lower[fix], upper[fix], off[fix], off[fix] + units[fix]
    for i in order.tolist():
        lo, hi, sz = lower[i], upper[i], units[i]
        o = 0
        live = np.flatnonzero((p_lo[:k] < hi) & (p_hi[:k] > lo) & (p_end[:k] > p_off[:k]))
        if live.size and sz > 0:
            o = lowest_gap(p_off[live], p_end[live], sz, tight)
        off[i] = o
        p_lo[k], p_hi[k], p_off[k], p_end[k] = lo, hi, o, o + sz
        k += 1
    return off


def _tightest_instant(lower: np.ndarray, upper: np.ndarray, units: np.ndarray, b: int) -> int:
    """The instant in buffer ``b``'s lifetime where the most units are live (earliest)."""
    live = np.flatnonzero((lower < upper[b]) & (upper > lower[b]))
    lo, hi = lower[b], upper[b]
    times = np.concatenate([np.maximum(lower[live], lo), np.minimum(upper[live], hi)])
    delta = np.concatenate([units[live], -units[live]])
    order = np.lexsort((delta, times))  # ends before starts at one instant (half-open)
    total = np.cumsum(delta[order])
    return int(times[order][int(np.argmax(total))])


def _holes(lower: np.ndarray, upper: np.ndarray, units: np.ndarray, off: np.ndarray, t: int) -> list[int]:
    """The bottoms of the free ranges of the column at instant ``t``, lowest first."""
    col = np.flatnonzero((lower <= t) & (upper > t) & (units > 0))
    col = col[np.argsort(off[col], kind="stable")]
    reach, out = 0, []
    for o, e in zip(off[col].tolist(), (off[col] + units[col]).tolist()):
        if o > reach:
            out.append(reach)
        reach = max(reach, e)
    return out


def repair(
    lower: np.ndarray,
    upper: np.ndarray,
    units: np.ndarray,
    offsets: np.ndarray,
    target: int,
    max_moves: int = 8,
    deadline: float = float("inf"),
) -> tuple[np.ndarray, dict]:
    """Lower the peak of ``offsets`` by band-lifting moves (see the module docstring).

    Args:
        lower, upper, units: the buffers (units: sizes in alignment units).
        offsets: a valid placement (units).
        target: stop once the peak is at most this.
        max_moves: moves to try at most (the deterministic budget).
        deadline: ``time.perf_counter()`` value after which no new move starts.

    Returns:
        (offsets, facts): a valid placement whose peak is at most the input's, and a dict
        with the moves tried, the peaks reached and, under ``"fewest_over"``, the
        placement with the fewest buffers above ``target`` (it may peak higher than
        the input, with one displaced buffer sticking out: a start for
        :mod:`.lns`, which frees the buffers around that one).
    """
    off = np.asarray(offsets, dtype=np.int64).copy()
    n = len(units)
    facts: dict = {"moves": 0, "peaks": [], "fewest_over": off}
    if not n:
        return off, facts
    peak = int((off + units).max())
    best, best_peak = off, peak
    score = _score(off, units, target)
    last = 0.0  # seconds the last placement took
    for _ in range(max_moves):
        if best_peak <= target or time.perf_counter() >= deadline:
            break
        facts["moves"] += 1
        b = int(np.argmax(off + units))  # first buffer reaching the current peak
        t = _tightest_instant(lower, upper, units, b)
        improved = False
        for fixed, order, tight in _moves(lower, upper, units, off, t):
            # one placement takes seconds on 30k buffers: start one only when the last
            # one would still have fitted before the deadline
            if time.perf_counter() + last > deadline:
                break
            t0 = time.perf_counter()
            new = place(lower, upper, units, off, fixed, order, tight)
            last = time.perf_counter() - t0
            new_score = _score(new, units, target)
            if new_score < score:
                off, score, improved = new, new_score, True
                break
        peak = int((off + units).max())
        facts["peaks"].append(peak)
        if peak < best_peak:
            best, best_peak = off, peak
        if not improved:
            break
    facts["fewest_over"] = off
    return best, facts


def _moves(lower: np.ndarray, upper: np.ndarray, units: np.ndarray, off: np.ndarray, t: int):
    """The moves to try for the peak buffer at its tightest instant ``t``, smallest
    first, as (fixed mask, buffers to re-place in order, tightest-gap rule): lift
    everything above one of the holes of the column at ``t``."""
    # the highest holes first: their bands are the smallest
    for h in _holes(lower, upper, units, off, t)[::-1][:HOLES]:
        band = np.flatnonzero(off >= h)
        at_t = (lower[band] <= t) & (upper[band] > t)
        col, rest = band[at_t], band[~at_t]
        col = col[np.argsort(off[col], kind="stable")]
        yield off < h, np.concatenate([col, rest[np.lexsort((lower[rest], -units[rest]))]]), True
        yield off < h, np.concatenate([col, rest[np.argsort(off[rest], kind="stable")]]), False


def _score(off: np.ndarray, units: np.ndarray, target: int) -> tuple[int, int]:
    """What a move must lower: the buffers reaching above ``target``, then the peak.

    Counting the buffers over the target, rather than the peak alone, lets a move
    that drops a whole column below the target count as progress even when one short
    buffer it displaced now sticks out higher: the next move works on that one."""
    tops = off + units
    return int((tops > target).sum()), int(tops.max())
