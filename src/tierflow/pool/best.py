"""``best``: an anytime solver that is never worse than greedy.

1. Fast heuristics give an incumbent: greedy by size (best fit) and the canonical
   lowest-floor-first placement under several static preorders.
2. If the incumbent is above the lower bound, the canonical branch and bound of
   :mod:`.search` decides capacities, starting at the bound itself (where section
   inference is sharpest and most hard cases are solved), then bisecting between the
   bound and the incumbent. Each capacity gets a share of the remaining time, spent on
   restarts with small node limits under randomly perturbed preorders: a restart escapes
   the subtree that a bad early choice condemned, which chronological backtracking
   alone cannot within seconds.
3. The best placement found by the time limit is returned; it is exact (``optimal``)
   when it meets the bound.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from . import search
from .greedy import best_fit, size_order
from .problem import Problem, Solution, lower_bound, peak_of

Progress = Callable[[float, int], None]  # (fraction of the time limit used, best peak in bytes)


def solve_best(problem: Problem, time_limit: float = 10.0, progress: Progress | None = None, seed: int = 0) -> Solution:
    """Near-optimal offsets within ``time_limit`` seconds.

    Args:
        problem: the buffers.
        time_limit: wall-clock budget in seconds (the fast heuristics always run, so a
            tiny limit still returns greedy's answer or better).
        progress: called now and then with the fraction of the budget used and the best
            peak so far.
        seed: seed of the restarts' random preorders (the result is deterministic for a
            seed, up to where the time limit cuts the search).
    """
    t0 = time.perf_counter()
    deadline = t0 + max(0.0, time_limit)
    # empty buffers occupy no byte: they sit at offset 0 and stay out of the search
    # (their zero height would defeat its dominance rule)
    keep = np.flatnonzero(problem.units > 0)
    lower, upper, units = problem.lower[keep], problem.upper[keep], problem.units[keep]
    n = len(keep)
    lb_units = lower_bound(problem, units=True)
    meta: dict = {"heuristics": {}, "attempts": []}
    report = progress or (lambda frac, peak: None)

    def cost(off_units: np.ndarray) -> int:
        return int((off_units + units).max()) if n else 0

    # 1. heuristics: greedy first, so best is never worse than it
    greedy_all = best_fit(problem.lower, problem.upper, problem.units, size_order(problem))
    best_off = greedy_all[keep]
    best_cost = cost(best_off)
    best_from = "greedy"
    meta["heuristics"]["greedy"] = best_cost
    sec = search.Sections(lower, upper, units)
    orders = search.preorders(lower, upper, units, sec) if n else {}
    last = time.perf_counter() - t0  # a lowest-first pass costs about what greedy did
    for name in ("A", "TWA", "S", "LS"):
        if best_cost <= lb_units or time.perf_counter() + last > deadline or not n:
            break
        t1 = time.perf_counter()
        off = search.lowest_first(lower, upper, units, orders[name])
        last = time.perf_counter() - t1
        c = cost(off)
        meta["heuristics"][f"lowest-first/{name}"] = c
        if c < best_cost:
            best_off, best_cost, best_from = off, c, f"lowest-first/{name}"
        report(_frac(t0, time_limit), best_cost * problem.alignment)

    # 2. capacity search
    members = sec.members(n) if 0 < n <= search.STRONG_LIMIT else None
    rng = np.random.default_rng(seed)
    keys = (sec.buffer_total, sec.s1 - sec.s0, units * (upper - lower))
    statics = [orders[k] for k in ("TWA", "WAT", "TAW")] if n else []
    nodes = 0
    lo, hi = lb_units, best_cost - 1
    first = True
    while lo <= hi and time.perf_counter() < deadline:
        remaining = deadline - time.perf_counter()
        if first:
            cap, budget = lo, remaining * 0.5
        else:
            # bisect, leaning low: finding a capacity near the bound pays the most
            cap = lo + (hi - lo) // 3
            steps = max(1, math.ceil(math.log2(max(2, (hi - lo) / max(1, lb_units // 500)))))
            budget = remaining / steps
        found, tries, spent = _attempt(
            lower, upper, units, cap, sec, members, statics, keys, rng, time.perf_counter() + budget, deadline
        )
        nodes += spent
        meta["attempts"].append({"capacity": cap * problem.alignment, "found": found is not None, "restarts": tries})
        if found is not None:
            c = cost(found)
            if c < best_cost:
                best_off, best_cost, best_from = found, c, "search"
            hi = min(hi, c - 1)
        else:
            lo = cap + 1  # not proven infeasible, but presumed so for the rest of the budget
        first = False
        report(_frac(t0, time_limit), best_cost * problem.alignment)

    offsets = np.zeros(len(problem), dtype=np.int64)
    offsets[keep] = best_off * problem.alignment
    peak = peak_of(problem, offsets)
    meta.update(nodes=nodes, found_by=best_from)
    return Solution(
        offsets=offsets,
        peak=peak,
        lower_bound=problem.lower_bound,
        solver="best",
        seconds=time.perf_counter() - t0,
        optimal=peak == problem.lower_bound or (best_cost <= lb_units and problem.alignment == 1),
        meta=meta,
    )


def _attempt(lower, upper, units, cap, sec, members, statics, keys, rng, until, deadline):
    """Restarts of the canonical search at one capacity until one finds a placement or
    ``until`` passes. Returns (offsets or None, restarts, nodes)."""
    n = len(lower)
    limit = 4 * n
    tries = nodes = 0
    while time.perf_counter() < min(until, deadline):
        if tries < len(statics):
            order = statics[tries]
        else:
            # perturb each key by up to 30% and shuffle their priority
            noisy = [k * rng.uniform(0.7, 1.3, size=n) for k in keys]
            prio = rng.permutation(len(noisy))
            order = np.lexsort(tuple(-noisy[i] for i in prio[::-1]))
        out = search.feasible(lower, upper, units, cap, order, sec, members, min(until, deadline), limit)
        tries += 1
        nodes += out.nodes
        if out.offsets is not None:
            return out.offsets, tries, nodes
        if out.exhausted:
            break  # the canonical space holds no placement under this capacity
    return None, tries, nodes


def _frac(t0: float, limit: float) -> float:
    return min(1.0, (time.perf_counter() - t0) / limit) if limit > 0 else 1.0
