"""``exact``: minimal-peak offsets for small problems, by CP-SAT or a HiGHS MILP.

With OR-Tools installed the model goes to CP-SAT: an offset variable per buffer, one
``NoOverlap2D`` over the (lifetime, bytes) rectangles, minimise the highest top, which
is bounded below by the lower bound and above by greedy's peak (greedy's offsets are
the hint). Everything is an integer: a proof of optimality is exact.

Without it, HiGHS (as scipy ships it, ``scipy.optimize.milp``) solves a mixed-integer model: for every pair of buffers live at the
same time, one binary chooses which lies below the other (big-M disjunction, with
greedy's peak as M and the lower bound on the peak, so HiGHS can stop as soon as it
meets it). The number of binaries grows with the pairs; at byte-sized coefficients its
tolerances can blur a byte, which the CP model cannot.

Either way this is for problems of a few dozen buffers (:data:`MAX_PAIRS`).
"""

from __future__ import annotations

import time

import numpy as np

from . import lns
from ._graph import overlap_pairs
from .greedy import solve_greedy
from .problem import PoolError, Problem, Solution, lower_bound, peak_of

MAX_PAIRS = 5000
BACKENDS = ("auto", "cpsat", "highs")


def solve_exact(problem: Problem, time_limit: float = 10.0, backend: str = "auto") -> Solution:
    """Minimal-peak offsets (proven when the solver finishes within the time limit).

    Args:
        problem: the buffers.
        time_limit: seconds the solver may use.
        backend: ``"cpsat"``, ``"highs"`` or ``"auto"`` (CP-SAT when OR-Tools is
            installed, else HiGHS).

    Raises:
        PoolError: the problem has more than :data:`MAX_PAIRS` overlapping pairs, an
            unknown backend, or ``cpsat`` asked for without OR-Tools installed.
    """
    t0 = time.perf_counter()
    if backend not in BACKENDS:
        raise PoolError(f"exact: unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    greedy = solve_greedy(problem)
    a, b = overlap_pairs(problem.lower, problem.upper)
    if len(a) > MAX_PAIRS:
        raise PoolError(f"solver 'exact': {len(a)} overlapping pairs, more than the {MAX_PAIRS} it handles")
    use_cpsat = backend == "cpsat" or (backend == "auto" and lns.available())
    if use_cpsat and not lns.available():
        raise PoolError("exact backend 'cpsat' needs ortools (pip install 'tierflow[fast]'); "
                        "backend 'highs' needs nothing more")
    name = "cpsat" if use_cpsat else "highs"
    lb = lower_bound(problem, units=True)
    g_units = greedy.offsets // problem.alignment
    cap = int((g_units + problem.units).max()) if len(problem) else 0
    if cap <= lb:  # greedy already meets the bound (or there is nothing to place)
        greedy.solver, greedy.seconds, greedy.optimal = "exact", time.perf_counter() - t0, True
        greedy.meta = {"status": "OPTIMAL", "backend": name}
        return greedy
    solve = _solve_cpsat if use_cpsat else _solve_highs
    off_units, proven, status = solve(problem, time_limit, g_units, cap, lb, (a, b), t0)
    offsets = g_units * problem.alignment if off_units is None else off_units * problem.alignment
    peak = peak_of(problem, offsets)
    if peak > greedy.peak:  # a solver stopped early with a worse incumbent: never worse than greedy
        offsets, peak = greedy.offsets, greedy.peak
    return Solution(
        offsets=offsets,
        peak=peak,
        lower_bound=problem.lower_bound,
        solver="exact",
        seconds=time.perf_counter() - t0,
        optimal=proven or peak == problem.lower_bound,
        meta={"status": status, "pairs": len(a), "backend": name},
    )


def _solve_highs(problem: Problem, time_limit: float, g_units: np.ndarray, big: int, lb: int,
                 pairs: tuple[np.ndarray, np.ndarray], t0: float) -> tuple[np.ndarray | None, bool, str]:
    """The big-M MILP (M = greedy's peak ``big``), solved by scipy's HiGHS: (offsets in
    alignment units or None when HiGHS has no solution, proven optimal, its status)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    n, units = len(problem), problem.units.astype(np.float64)
    a, b = pairs
    p = len(a)
    # columns: offsets 0..n-1, peak n, binaries n+1..n+p; every one an integer
    lo = np.concatenate([np.zeros(n), [float(lb)], np.zeros(p)])
    hi = np.concatenate([float(big) - units, [float(big)], np.ones(p)])
    cost = np.zeros(n + 1 + p)
    cost[n] = 1.0
    rows, cols, vals, upper = [], [], [], []
    for i in range(n):  # offset_i - peak <= -size_i
        rows += [i, i]
        cols += [i, n]
        vals += [1.0, -1.0]
        upper.append(-units[i])
    r0 = n
    for k, (i, j) in enumerate(zip(a.tolist(), b.tolist())):
        z = n + 1 + k
        # z = 1: i below j (o_i + s_i <= o_j); z = 0: j below i
        rows += [r0, r0, r0, r0 + 1, r0 + 1, r0 + 1]
        cols += [i, j, z, j, i, z]
        vals += [1.0, -1.0, float(big), 1.0, -1.0, -float(big)]
        upper += [float(big) - units[i], -units[j]]
        r0 += 2
    A = coo_matrix((vals, (rows, cols)), shape=(r0, n + 1 + p)).tocsr()
    res = milp(cost, constraints=LinearConstraint(A, -np.inf, np.asarray(upper)),
               integrality=np.ones(n + 1 + p), bounds=Bounds(lo, hi),
               options={"time_limit": float(max(time_limit, 0.1)), "mip_rel_gap": 0.0, "disp": False})
    status = {0: "Optimal", 1: "Time limit reached", 2: "Infeasible", 3: "Unbounded"}.get(res.status, str(res.message))
    if res.x is None:
        return None, False, status
    off_units = np.rint(np.asarray(res.x[:n])).astype(np.int64)
    return off_units, res.status == 0, status


def _solve_cpsat(problem: Problem, time_limit: float, g_units: np.ndarray, cap: int, lb: int,
                 pairs: tuple[np.ndarray, np.ndarray], t0: float) -> tuple[np.ndarray | None, bool, str]:
    """The CP-SAT model: every non-empty buffer free, capped at greedy's peak ``cap``,
    greedy's offsets as the hint: (offsets in alignment units or None, proven optimal,
    CP-SAT's status)."""
    keep = np.flatnonzero(problem.units > 0)
    new, status = lns.solve_window(
        problem.lower, problem.upper, problem.units, g_units, keep, cap, det_time=1e9,
        deadline=t0 + max(time_limit, 0.1), floor=lb,
    )
    return new, status == "OPTIMAL", status
