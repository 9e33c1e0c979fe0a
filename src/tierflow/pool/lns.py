"""Large-neighbourhood search with a CP solver: re-place a time window under the peak.

When a placement misses the lower bound by a few buffers sticking out above the rest,
the fix is usually local in time but not in height: a buffer live for a few instants
finds no gap below the peak because the free space at those instants lies in pieces
at different heights, and closing it means shuffling the buffers around those
instants from the bottom of the arena up. A greedy rule or a band lift cannot do that;
an exact solver on the window can.

One step: take a buffer that reaches the peak and a window of time around it (its
lifetime when short, else its tightest instant), and *free* the buffers that start or
end inside the window; all others stay where they are and become obstacles (those
live across the whole window are mostly long-lived ones that cannot move anyway). The
freed buffers keep their lifetimes; their offsets are variables whose domains already
exclude the byte ranges fixed buffers occupy at overlapping times, and they may not
overlap each other (one ``NoOverlap2D`` over (time, bytes) rectangles). OR-Tools
CP-SAT minimises their highest top below the current peak, starting from the current
offsets as a hint. Integer offsets and sizes are exact in CP-SAT: no big-M, no
tolerance. On pangu_2.6B such a window of a dozen buffers swaps two pairs of large
buffers and settles in milliseconds what band lifting could not.

A step that proves the window cannot go lower widens it (:data:`MARGINS` sections on
each side) until it would free more than :data:`MAX_FREE` buffers; a step that runs
out of budget undecided ends the widening. Then the same windows free every buffer
live in them (up to :data:`MAX_FREE_ALL`), then the next buffer at the peak is tried.
The search stops at the target, at the deadline, at its step or deterministic-time
budget, or when no window around any of the first :data:`TRIES` buffers at the peak
lowers it. CP-SAT runs on one worker with a fixed seed under deterministic time
limits, so with a wall deadline that does not bind the result depends only on the
input and the seed.

CP-SAT (``ortools``) is an optional dependency, imported only here; :func:`available`
says whether it can be used.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

# sections added on each side of the window, tried in turn after a failure
MARGINS = (0, 3, 8, 16, 32, 64)
# a window freeing more buffers than this is not tried (CP-SAT slows down sharply):
# for windows of the buffers that start or end in them, and for windows of all
MAX_FREE = 1500
MAX_FREE_ALL = 300
# a buffer spanning more sections than this gets a window around its tightest instant
# rather than around its whole lifetime
SPAN = 64
# CP-SAT's deterministic time budget per step and for a whole improve() call, in its
# own work unit: one unit took from 3 to 20 CPU seconds on these models, while every
# window that settled pangu_2.6B took under 0.01. A window it cannot settle in this
# is left, and no wider one around the same buffer is tried (it would be harder)
STEP_DET_TIME = 0.05
DET_BUDGET = 0.5
# buffers at the peak tried per peak level before giving up
TRIES = 4


def available() -> bool:
    """Whether OR-Tools CP-SAT can be imported (the ``solver`` extra)."""
    try:
        from ortools.sat.python import cp_model  # noqa: F401
    except ImportError:
        return False
    return True


def allowed_offsets(
    size: int, cap: int, obst_off: np.ndarray, obst_end: np.ndarray
) -> list[list[int]]:
    """The offsets in ``[0, cap - size]`` at which a block of ``size`` overlaps none of
    the byte ranges ``[obst_off, obst_end)``, as inclusive ``[a, b]`` intervals, lowest
    first (empty when none).

    A block at ``o`` collides with ``[x, y)`` when ``o < y`` and ``o + size > x``, i.e.
    for ``o`` in ``[x - size + 1, y - 1]``; the allowed set is the complement of the
    union of those ranges, found with one sort and a running maximum.
    """
    hi = cap - size
    if hi < 0:
        return []
    keep = obst_end > obst_off
    a = obst_off[keep] - size + 1
    b = obst_end[keep] - 1
    if not len(a):
        return [[0, hi]]
    srt = np.argsort(a, kind="stable")
    a, b = a[srt], b[srt]
    reach = np.maximum.accumulate(b)
    # free runs: before the first range, between a running end and the next start,
    # and after the last end
    starts = np.concatenate([[0], reach + 1])
    ends = np.concatenate([a - 1, [hi]])
    starts = np.maximum(starts, 0)
    ends = np.minimum(ends, hi)
    ok = ends >= starts
    return [[int(s), int(e)] for s, e in zip(starts[ok], ends[ok])]


def solve_window(
    lower: np.ndarray,
    upper: np.ndarray,
    units: np.ndarray,
    offsets: np.ndarray,
    free: np.ndarray,
    cap: int,
    det_time: float,
    deadline: float,
    seed: int = 0,
    floor: int = 0,
    stats: dict[str, float] | None = None,
) -> tuple[np.ndarray | None, str]:
    """Re-place the buffers ``free`` with every top at most ``cap``, the others fixed.

    Minimises the highest top of the freed buffers, known to be at least ``floor``.
    Returns (new offsets or None, the CP-SAT status name); None when no placement was
    found within the budget (or none exists: status ``INFEASIBLE``). ``OPTIMAL``
    means no placement of the freed buffers has a lower highest top. ``stats``, when
    given, receives CP-SAT's ``wall_time`` and ``deterministic_time``.
    """
    from ortools.sat.python import cp_model

    if not len(free):  # nothing to move: the placement stands or falls as it is
        fits = not len(units) or int((offsets + units).max()) <= cap
        return (offsets.copy(), "OPTIMAL") if fits else (None, "INFEASIBLE")
    is_free = np.zeros(len(units), dtype=bool)
    is_free[free] = True
    span_lo, span_hi = int(lower[free].min()), int(upper[free].max())
    # obstacles: fixed, non-empty, live somewhere in the freed buffers' span
    obs = np.flatnonzero(~is_free & (units > 0) & (lower < span_hi) & (upper > span_lo))
    o_lo, o_hi, o_off = lower[obs], upper[obs], offsets[obs]
    o_end = o_off + units[obs]
    m = cp_model.CpModel()
    xs, ys, vs = [], [], []
    for i in free.tolist():
        near = (o_lo < upper[i]) & (o_hi > lower[i])
        dom = allowed_offsets(int(units[i]), cap, o_off[near], o_end[near])
        if not dom:
            return None, "EMPTY_DOMAIN"
        v = m.new_int_var_from_domain(cp_model.Domain.from_intervals(dom), f"o{i}")
        if any(a <= offsets[i] <= b for a, b in dom):
            m.add_hint(v, int(offsets[i]))
        xs.append(m.new_fixed_size_interval_var(int(lower[i]), int(upper[i] - lower[i]), f"t{i}"))
        ys.append(m.new_fixed_size_interval_var(v, int(units[i]), f"b{i}"))
        vs.append(v)
        floor = max(floor, int(units[i]) + dom[0][0])
    top = m.new_int_var(min(floor, cap), cap, "top")
    for v, i in zip(vs, free.tolist()):
        m.add(top >= v + int(units[i]))
    m.add_no_overlap_2d(xs, ys)
    m.minimize(top)
    solver = cp_model.CpSolver()
    p = solver.parameters
    p.num_workers = 1
    p.random_seed = int(seed)
    p.max_deterministic_time = float(det_time)
    p.max_time_in_seconds = max(0.01, deadline - time.perf_counter())
    status = solver.solve(m)
    name = solver.status_name(status)
    if stats is not None:
        stats["wall_time"] = solver.wall_time
        stats["deterministic_time"] = solver.deterministic_time
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, name
    new = offsets.copy()
    new[free] = [solver.value(v) for v in vs]
    return new, name


def improve(
    lower: np.ndarray,
    upper: np.ndarray,
    units: np.ndarray,
    offsets: np.ndarray,
    target: int,
    deadline: float = float("inf"),
    seed: int = 0,
    max_steps: int = 64,
    det_time: float | None = None,
    det_budget: float | None = None,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Lower the peak of a valid placement by CP-SAT window steps (module docstring).

    Args:
        lower, upper, units: the buffers (units: sizes in alignment units; empty
            buffers are never freed and block nothing).
        offsets: a valid placement (units).
        target: stop once the peak is at most this (the lower bound, or a goal).
        deadline: ``time.perf_counter()`` value after which no step starts (and the
            running one stops).
        seed: CP-SAT's seed.
        max_steps: CP-SAT calls at most.
        det_time: CP-SAT's deterministic time limit per call (default
            :data:`STEP_DET_TIME`).
        det_budget: no call starts once the calls so far used this much deterministic
            time (default :data:`DET_BUDGET`; with ``max_steps``, the budget that does
            not depend on the clock).

    Returns:
        (offsets, facts): a valid placement whose peak is at most the input's, and a dict
        with the steps run, each as (kind, margin, buffers freed, CP-SAT status, peak
        after), the deterministic time used and the final peak.
    """
    det_time = STEP_DET_TIME if det_time is None else det_time
    det_budget = DET_BUDGET if det_budget is None else det_budget
    off = np.asarray(offsets, dtype=np.int64).copy()
    facts: dict[str, Any] = {"steps": []}
    n = len(units)
    if not n or not available():
        facts["skipped"] = "no buffers" if not n else "ortools not installed"
        return off, facts
    pts = np.unique(np.concatenate([lower, upper]))
    s0 = np.searchsorted(pts, lower)
    s1 = np.searchsorted(pts, upper)
    live = units > 0
    peak = int((off + units).max())
    used = 0.0  # CP-SAT deterministic time so far

    def spent() -> bool:
        return len(facts["steps"]) >= max_steps or used >= det_budget or time.perf_counter() >= deadline

    while peak > target and not spent():
        crit = np.flatnonzero(off + units >= peak)
        # shortest-lived first: its window is the smallest; ties by index
        crit = crit[np.lexsort((crit, s1[crit] - s0[crit]))]
        improved = False
        hard: tuple[int, str] | None = None  # the last (buffer, kind) CP-SAT could not settle
        for b, kind, margin in _neighbourhoods(crit):
            if spent():
                break
            if hard == (b, kind):
                continue
            a, z = _window(lower, upper, units, int(b), pts, s0, s1, margin)
            inside = live & (s0 < z) & (s1 > a)
            if kind == "ends":  # buffers live across the whole window stay put
                inside &= (s0 >= a) | (s1 <= z)
            free = np.union1d(np.flatnonzero(inside), crit)
            if len(free) > (MAX_FREE if kind == "ends" else MAX_FREE_ALL):
                continue
            st: dict[str, float] = {}
            new, status = solve_window(lower, upper, units, off, free, peak - 1, det_time, deadline, seed, stats=st)
            used += st.get("deterministic_time", 0.0)
            new_peak = peak if new is None else int((new + units).max())
            facts["steps"].append((kind, margin, len(free), status, new_peak))
            if new is not None and new_peak < peak:
                off, peak, improved = new, new_peak, True
                break
            if status == "UNKNOWN":
                hard = (b, kind)
        if not improved:
            break
    facts["peak"] = peak
    facts["det_time"] = round(used, 3)
    return off, facts


def _neighbourhoods(crit: np.ndarray):
    """The (buffer, kind, margin) neighbourhoods to try at one peak level, in order:
    for each of the first :data:`TRIES` buffers at the peak, the buffers that start or
    end in the window at growing margins, then every buffer live in it."""
    for b in crit[:TRIES].tolist():
        for kind in ("ends", "all"):
            for margin in MARGINS:
                yield b, kind, margin


def _window(
    lower: np.ndarray,
    upper: np.ndarray,
    units: np.ndarray,
    b: int,
    pts: np.ndarray,
    s0: np.ndarray,
    s1: np.ndarray,
    margin: int,
) -> tuple[int, int]:
    """The window of sections ``[a, z)`` around buffer ``b``: its lifetime widened by
    ``margin`` on both sides when it spans at most :data:`SPAN` sections, else the
    section of its tightest instant widened so."""
    if s1[b] - s0[b] <= SPAN:
        return int(s0[b]) - margin, int(s1[b]) + margin
    from .repair import _tightest_instant

    t = _tightest_instant(lower, upper, units, b)
    s = int(np.searchsorted(pts, t, side="right")) - 1
    return s - margin, s + 1 + margin
