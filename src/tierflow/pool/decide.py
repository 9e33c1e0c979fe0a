"""One rung of the ladder: "is there a placement with every top at most ``cap``?".

Posed to OR-Tools CP-SAT on a :class:`~.reduce.Reduced` problem: an offset variable in
``[0, cap - size]`` per buffer, lifetimes as fixed intervals, one ``NoOverlap2D`` over
the (time, bytes) rectangles, and no objective: a decision is far easier for CP-SAT
than minimising the peak (its propagators prune against a fixed height). Optionally,
each group of equal buffers is stacked in a fixed order (symmetry breaking), and the
best placement known is given as a hint.

:class:`Variant` names a formulation and search setting; the ladder runs several as a
portfolio. CP-SAT is imported only here and in :mod:`.lns`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .reduce import Reduced

FEASIBLE, INFEASIBLE, UNKNOWN = "feasible", "infeasible", "unknown"


@dataclass(frozen=True)
class Variant:
    """A CP-SAT formulation and search setting for one decision.

    Attributes:
        name: label for reports.
        symmetry: stack equal buffers in a fixed order.
        hint: hint the best placement known (clipped below the capacity).
        seed: CP-SAT's random seed.
        fixed: search bottom-up: branch on the offset with the lowest possible value
            first and try that value (a constructive search like MiniMalloc's), with
            CP-SAT's restarts and propagation around it.
        order: with ``fixed``, which variable order the bottom-up search follows on
            ties of the lowest possible offset: -1 the problem's order, ``k >= 0`` the
            ``k``-th of :func:`bottom_up_order`.
        params: extra CP-SAT parameters (name, value).
    """

    name: str
    symmetry: bool = True
    hint: bool = True
    seed: int = 0
    fixed: bool = False
    order: int = -1
    params: tuple[tuple[str, object], ...] = ()


def bottom_up_order(red: Reduced, k: int) -> np.ndarray:
    """The ``k``-th variable order of the bottom-up search.

    Among the buffers that could go lowest, a bottom-up search places the first in
    this order, so the order decides which placements it meets first. The first four
    are static: by start, largest first on ties (a sweep over time, like filling the
    skyline from the left), longest-lived first then by area (buffers that live
    longest meet the most others and are the hardest to fit late), largest area
    first, longest-lived then largest. From ``k = 4`` on, one key of the start,
    area or lifetime order (in turn) is scaled by seeded noise, a new order per
    ``k``: the search is deterministic for an order, so a restart needs a new order,
    not a new seed. Measured on the generated 450- and 600-buffer sets, with and
    without free space: the fixed search by start placed three of four at the bound
    in 0.3-1.2 s (the fourth at 1.02 x the bound) where CP-SAT's own search found
    nothing in 10 s; other orders place others.

    Example::

        order = bottom_up_order(red, 3)   # a permutation of range(len(red))
    """
    n = len(red.size)
    idx = np.arange(n)
    life = red.upper - red.lower
    area = life * red.size
    if k == 0:
        return np.lexsort((idx, -red.size, red.lower))
    if k == 1:
        return np.lexsort((idx, -red.size, -area, -life))
    if k == 2:
        return np.lexsort((idx, -life, -red.size, -area))
    if k == 3:
        return np.lexsort((idx, -red.size, -life))
    rng = np.random.default_rng(k)
    if k % 3 == 1:
        return np.lexsort((idx, -(red.size * rng.uniform(0.5, 1.5, n)), red.lower))
    if k % 3 == 2:
        return np.lexsort((idx, -(area * rng.uniform(0.7, 1.3, n))))
    return np.lexsort((idx, -(red.size * rng.uniform(0.7, 1.3, n)), -(life * rng.uniform(0.8, 1.2, n))))


@dataclass
class Attempt:
    """What one decision found.

    Attributes:
        cap: the capacity asked (reduced units).
        variant: who answered.
        status: :data:`FEASIBLE`, :data:`INFEASIBLE` (proven) or :data:`UNKNOWN`.
        offsets: a placement under ``cap`` when feasible (reduced units), else None.
        seconds: wall time.
        det_time: CP-SAT's deterministic time (0 for searches that have none).
    """

    cap: int
    variant: str
    status: str
    offsets: np.ndarray | None = None
    seconds: float = 0.0
    det_time: float = 0.0
    facts: dict = field(default_factory=dict)


class Stop:
    """A flag a portfolio raises to end its other members' attempts at one rung; a
    CP-SAT solve registered with it is stopped at once."""

    def __init__(self) -> None:
        self._set = threading.Event()
        self._lock = threading.Lock()
        self._solvers: list = []

    def __bool__(self) -> bool:
        return self._set.is_set()

    def set(self) -> None:
        with self._lock:
            self._set.set()
            for s in self._solvers:
                s.stop_search()

    def register(self, solver) -> None:
        with self._lock:
            self._solvers.append(solver)
            if self._set.is_set():
                solver.stop_search()


def decide_cpsat(red: Reduced, cap: int, variant: Variant, det_time: float, deadline: float,
                 hint: np.ndarray | None = None, stop: Stop | None = None) -> Attempt:
    """Decide ``cap`` with CP-SAT on one worker.

    Args:
        red: the reduced problem.
        cap: the capacity (reduced units).
        variant: formulation and setting.
        det_time: CP-SAT's deterministic time limit (the clock-free budget).
        deadline: ``time.perf_counter()`` after which it stops regardless.
        hint: a placement to hint (reduced units), used when ``variant.hint``.
        stop: raised by another member of a portfolio to end this attempt.
    """
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    name = variant.name
    if int(red.size.max(initial=0)) > cap or red.lower_bound > cap:
        return Attempt(cap, name, INFEASIBLE, seconds=time.perf_counter() - t0)
    m = cp_model.CpModel()
    xs, ys, vs = [], [], []
    for i, (lo, hi, s) in enumerate(zip(red.lower.tolist(), red.upper.tolist(), red.size.tolist())):
        v = m.new_int_var(0, cap - s, f"o{i}")
        xs.append(m.new_fixed_size_interval_var(lo, hi - lo, f"t{i}"))
        ys.append(m.new_fixed_size_interval_var(v, s, f"b{i}"))
        vs.append(v)
        if variant.hint and hint is not None:
            m.add_hint(v, int(min(hint[i], cap - s)))
    m.add_no_overlap_2d(xs, ys)
    if variant.symmetry:
        for chain in red.chains:
            for a, b in zip(chain[:-1], chain[1:]):
                m.add(vs[a] + int(red.size[a]) <= vs[b])
    if variant.fixed:
        ordered = vs if variant.order < 0 else [vs[i] for i in bottom_up_order(red, variant.order).tolist()]
        m.add_decision_strategy(ordered, cp_model.CHOOSE_LOWEST_MIN, cp_model.SELECT_MIN_VALUE)
    solver = cp_model.CpSolver()
    p = solver.parameters
    if variant.fixed:
        p.search_branching = cp_model.FIXED_SEARCH
    p.num_workers = 1
    p.random_seed = int(variant.seed)
    p.max_deterministic_time = float(det_time)
    p.max_time_in_seconds = max(0.01, deadline - time.perf_counter())
    for key, value in variant.params:
        setattr(p, key, value)
    if stop is not None:
        stop.register(solver)
    code = solver.solve(m)
    if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        off = np.array([solver.value(v) for v in vs], dtype=np.int64)
        status = FEASIBLE
    else:
        off = None
        status = INFEASIBLE if code == cp_model.INFEASIBLE else UNKNOWN
    return Attempt(cap, name, status, off, time.perf_counter() - t0, solver.deterministic_time)
