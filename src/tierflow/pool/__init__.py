"""Static memory pool: one arena with planned offsets for buffers of known lifetime.

When every tensor's lifetime is known ahead (a training iteration repeats), a single
arena with precomputed offsets replaces a caching allocator and its fragmentation
(SINGA's SmartPool). Finding offsets that minimise the arena's peak is dynamic storage
allocation, NP-complete; this package keeps the problem, the solvers and an independent
validator apart:

* :class:`Problem` / :class:`Buffer`, :func:`read_csv` / :func:`write_csv` (MiniMalloc
  CSV), :func:`from_trace` (a tier's stays under a plan), :func:`lower_bound`;
* :func:`solve` with ``solver="greedy"`` (greedy by size, best fit), ``"best"``
  (anytime search beside a ladder of CP-SAT decisions, never worse than greedy) or
  ``"exact"`` (CP-SAT, or a MILP through
  HiGHS without OR-Tools, for small problems);
* :func:`validate` / :func:`check`.

Example::

    from tierflow import pool
    problem = pool.read_csv("A.csv")
    sol = pool.solve(problem, solver="best", time_limit=10)
    assert pool.validate(problem, sol.offsets, sol.peak).valid
    print(sol.peak, sol.lower_bound, sol.ratio)
"""

from __future__ import annotations

from collections.abc import Callable

from .problem import Buffer, PoolError, Problem, Solution, from_trace, lower_bound, read_csv, write_csv
from .validate import Report, check, validate

SOLVERS = ("greedy", "best", "exact")


def solve(
    problem: Problem,
    solver: str = "best",
    time_limit: float = 10.0,
    progress: Callable[[float, int], None] | None = None,
    seed: int = 0,
    node_limit: int | None = None,
    ladder_det_budget: float | None = None,
) -> Solution:
    """Offsets for every buffer of ``problem``.

    Args:
        problem: the buffers.
        solver: ``"greedy"``, ``"best"`` or ``"exact"``.
        time_limit: seconds ``best`` and ``exact`` may use (greedy ignores it).
        progress: for ``best``, called with (fraction of the time used, best peak so far).
        seed: for ``best``, the seed of its randomised restarts.
        node_limit: for ``best``, placements its search may try in all; with it and a
            time limit that does not bind, the result is deterministic.
        ladder_det_budget: for ``best`` with a node limit, CP-SAT deterministic time
            for its decision ladder (default none).

    Raises:
        PoolError: an unknown solver, or ``exact`` on a problem too large for it.
    """
    if solver == "greedy":
        from .greedy import solve_greedy

        return solve_greedy(problem)
    if solver == "best":
        from .best import solve_best

        return solve_best(problem, time_limit=time_limit, progress=progress, seed=seed, node_limit=node_limit,
                          ladder_det_budget=ladder_det_budget)
    if solver == "exact":
        from .exact import solve_exact

        return solve_exact(problem, time_limit=time_limit)
    raise PoolError(f"unknown solver {solver!r}; expected one of {', '.join(SOLVERS)}")


def speed_note(solver: str) -> str | None:
    """One line saying which optional speed-ups ``solver`` runs without here (numba for
    ``best``'s search, OR-Tools for its CP-SAT step and ``exact``), or None when it has
    them all. The answer is valid either way; without them it is found more slowly and,
    within the same time limit, may be further from the bound."""
    if solver == "greedy":
        return None
    from . import lns

    missing = []
    if solver == "best":
        from ._kernels import HAVE_NUMBA

        if not HAVE_NUMBA:
            missing.append("numba (the search runs interpreted, about 200x slower)")
    if not lns.available():
        missing.append("OR-Tools (" + ("no CP-SAT step" if solver == "best" else "HiGHS's MILP instead of CP-SAT") + ")")
    if not missing:
        return None
    return (f"note: pool solver {solver!r} runs without " + " and ".join(missing)
            + "; the answer is valid. pip install 'tierflow[fast]' for both.")


__all__ = [
    "SOLVERS",
    "speed_note",
    "Buffer",
    "PoolError",
    "Problem",
    "Report",
    "Solution",
    "check",
    "from_trace",
    "lower_bound",
    "read_csv",
    "solve",
    "validate",
    "write_csv",
]
