"""``best``: an anytime solver that is never worse than greedy.

1. Fast heuristics give an incumbent: greedy by size (best fit) and the canonical
   lowest-floor-first placement under several static preorders.
2. If the incumbent is above the lower bound, the canonical branch and bound of
   :mod:`.search` decides capacities, in rounds whose node budget doubles (MiniMalloc's
   round robin): each round tries the lower bound (at twice the round's budget), then
   bisects between the bound and the incumbent. Every capacity is tried under the three
   static preorders and then six randomised ones (seeded), each with the round's
   budget. A capacity the search cannot settle in one round is tried again with twice
   the budget in the next, so a problem whose optimum lies above the bound spends most
   of its time improving the incumbent, not at the bound, and one that meets the bound
   still meets it early. A capacity the search exhausts is proven infeasible and never
   tried again.
3. Time left over (the search stopped early or gave up, as it does on tens of
   thousands of buffers) goes to :func:`.repair.repair`, band-lifting moves on the
   incumbent that are kept only when they lower its peak.
4. Time still left, on problems of :data:`LNS_MIN_BUFFERS` buffers or more or where
   the search gave up, goes to :func:`.lns.improve` (when OR-Tools is installed): CP-SAT
   re-places the buffers that start or end in a time window around a buffer at the
   peak, everything else fixed. It starts from the incumbent and from the repair's
   placement with the fewest buffers above the bound (which may peak higher: one
   buffer the band lift displaced sticks out, and a window around it settles it).
5. The best placement found is returned; it is exact (``optimal``) when it meets the
   bound or the search proved every capacity below it infeasible.

On tens of thousands of buffers the search's stack outgrows :data:`.search.MAX_POOL`
within a few thousand placements; it then gives up (``meta["search_gave_up"]``) and the
heuristics' answer stands.

Capacities and sizes are divided by the greatest common divisor of the sizes (in
alignment units): every canonical offset is a sum of sizes, so nothing finer matters.

Everything the search decides depends on node counts, never on the clock: with a
``node_limit`` and no binding ``time_limit`` the result is the same on every run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from . import lns, repair, search
from .greedy import best_fit, size_order
from .problem import Problem, Solution, lower_bound, peak_of

Progress = Callable[[float, int], None]  # (fraction of the time limit used, best peak in bytes)

# preorders of the search (MiniMalloc's defaults): keys most significant first
HEURISTICS = ("WAT", "TAW", "TWA")
# randomised preorders a probe tries after the static ones: placements below the bound
# mostly come from the first few hundred nodes under some preorder, so diversity pays
RANDOM_ORDERS = 6
# a probe at the lower bound gets this many times the budget of a bisection probe
LB_WEIGHT = 2
# band-lifting moves the final repair may try (its deterministic budget)
REPAIR_MOVES = 8
# the CP-SAT windows run on problems of at least this many buffers, or where the search
# gave up (on the hard small set they found nothing the search had not)
LNS_MIN_BUFFERS = 1000
# placements between two looks at the clock
STEP = 1 << 13


def solve_best(
    problem: Problem,
    time_limit: float = 10.0,
    progress: Progress | None = None,
    seed: int = 0,
    node_limit: int | None = None,
) -> Solution:
    """Near-optimal offsets within ``time_limit`` seconds or ``node_limit`` nodes.

    Args:
        problem: the buffers.
        time_limit: wall-clock budget in seconds (the fast heuristics always run, so a
            tiny limit still returns greedy's answer or better).
        progress: called now and then with the fraction of the budget used and the best
            peak so far.
        seed: seed of the randomised preorders tried after the static ones.
        node_limit: placements the search may try in all; with it (and a time limit
            that does not bind) the result is deterministic.
    """
    t0 = time.perf_counter()
    deadline = t0 + max(0.0, time_limit)
    budget = math.inf if node_limit is None else max(0, int(node_limit))
    # empty buffers occupy no byte: they sit at offset 0 and stay out of the search
    # (their zero height would defeat its dominance rule)
    keep = np.flatnonzero(problem.units > 0)
    lower, upper, units_a = problem.lower[keep], problem.upper[keep], problem.units[keep]
    n = len(keep)
    # 1. heuristics: greedy first, so best is never worse than it
    greedy_all = best_fit(problem.lower, problem.upper, problem.units, size_order(problem))
    # greedy's offsets are sums of sizes as well; should one not be, work in units
    gcd = int(np.gcd.reduce(np.concatenate([units_a, greedy_all[keep]]))) if n else 1
    units = units_a // gcd
    lb = lower_bound(problem, units=True) // gcd
    meta: dict = {"heuristics": {}, "attempts": [], "gcd": gcd}
    report = progress or (lambda frac, peak: None)

    def cost(off: np.ndarray) -> int:
        return int((off + units).max()) if n else 0

    best_off = greedy_all[keep] // gcd
    best_cost = cost(best_off)
    best_from = "greedy"
    meta["heuristics"]["greedy"] = best_cost
    sec = search.Sections(lower, upper, units)
    orders = search.preorders(lower, upper, units, sec) if n else {}
    area = units * (upper - lower)
    last = 0.0
    for name in ("A", "TWA", "S", "WAT"):
        if best_cost <= lb or not n or time.perf_counter() + last > deadline:
            break
        t1 = time.perf_counter()
        off = search.lowest_first(units, orders[name], sec)
        last = time.perf_counter() - t1
        c = cost(off)
        meta["heuristics"][f"lowest-first/{name}"] = c
        if c < best_cost:
            best_off, best_cost, best_from = off, c, f"lowest-first/{name}"
        report(_frac(t0, time_limit), best_cost * gcd * problem.alignment)

    # 2. capacity search in rounds of doubling node budgets
    rng = np.random.default_rng(seed)
    keys = {"T": sec.buffer_total, "W": upper - lower, "A": area}
    nodes = 0
    limit = max(64, 2 * n)
    rounds = 0
    # a node costs O(n): on large problems look at the clock more often
    step = max(64, STEP * 512 // max(n, 512))
    gave_up = False

    def probe(cap: int, allowed: int) -> tuple[np.ndarray | None, bool]:
        """Try ``cap`` under each static preorder, then under randomised ones, with
        ``allowed`` nodes each. Returns (offsets or None, proven infeasible)."""
        nonlocal nodes, gave_up
        for k, h in enumerate((*HEURISTICS, *["random"] * RANDOM_ORDERS)):
            if h == "random":
                h = HEURISTICS[(rounds + k) % len(HEURISTICS)]
                order = _noisy_order(keys, h, rng, n)
            else:
                order = orders[h]
            s = search.Search(units, cap, order, sec, area, h, width=upper - lower)
            while (s.result is None and not s.gave_up and s.nodes < allowed and nodes < budget
                   and time.perf_counter() < deadline):
                before = s.nodes
                s.advance(int(min(step, allowed - s.nodes, budget - nodes)))
                nodes += s.nodes - before
            gave_up |= s.gave_up
            meta["attempts"].append({"capacity": cap * gcd * problem.alignment, "order": h if k < 3 else "random",
                                     "nodes": s.nodes, "result": s.result})
            if s.result:
                return s.offsets.copy(), False
            if s.result is False:
                return None, True
            if nodes >= budget or time.perf_counter() >= deadline or gave_up:
                break
        return None, False

    floor_cap = lb  # proven: nothing below it is feasible
    while best_cost > floor_cap and nodes < budget and time.perf_counter() < deadline and not gave_up:
        off, proven = probe(floor_cap, LB_WEIGHT * limit)
        if off is not None:
            best_off, best_cost, best_from = off, cost(off), "search"
            break
        if proven:
            floor_cap += 1
            continue
        lo, hi = floor_cap + 1, best_cost - 1
        while lo <= hi and nodes < budget and time.perf_counter() < deadline and not gave_up:
            cap = (lo + hi) // 2
            off, proven = probe(cap, limit)
            if off is not None:
                best_off, best_cost, best_from = off, cost(off), "search"
                hi = best_cost - 1
            else:
                if proven:
                    floor_cap = max(floor_cap, cap + 1)
                lo = cap + 1
            report(_frac(t0, time_limit), best_cost * gcd * problem.alignment)
        limit *= 2
        rounds += 1

    # 3. local repair of the incumbent (module repair): on large problems the search
    # gives up early and this is what time is left for; it never raises the peak
    if best_cost > lb and n and time.perf_counter() < deadline:
        off, facts = repair.repair(lower, upper, units, best_off, lb, max_moves=REPAIR_MOVES, deadline=deadline)
        meta["repair"] = {"moves": facts["moves"], "peaks": [x * gcd * problem.alignment for x in facts["peaks"]]}
        if cost(off) < best_cost:
            best_off, best_cost, best_from = off, cost(off), "repair"
        fewest = facts["fewest_over"]
    else:
        fewest = None

    # 4. CP-SAT windows (module lns) from the incumbent and from the repair's start, on
    # problems the search cannot finish: small ones it settles better by itself
    if (best_cost > lb and (gave_up or n >= LNS_MIN_BUFFERS) and time.perf_counter() < deadline
            and lns.available()):
        starts = [("lns", best_off)]
        if fewest is not None and not np.array_equal(fewest, best_off):
            starts.append(("repair+lns", fewest))
        meta["lns"] = []
        for label, start in starts:
            if best_cost <= lb or time.perf_counter() >= deadline:
                break
            off, facts = lns.improve(lower, upper, units, start, lb, deadline=deadline, seed=seed)
            meta["lns"].append({"start": label, "steps": len(facts["steps"]), "det_time": facts["det_time"], "peak": cost(off) * gcd * problem.alignment})
            if cost(off) < best_cost:
                best_off, best_cost, best_from = off, cost(off), label
        report(_frac(t0, time_limit), best_cost * gcd * problem.alignment)

    offsets = np.zeros(len(problem), dtype=np.int64)
    offsets[keep] = best_off * gcd * problem.alignment
    peak = peak_of(problem, offsets)
    meta.update(nodes=nodes, rounds=rounds, found_by=best_from, proven_floor=floor_cap * gcd * problem.alignment,
                search_gave_up=gave_up)
    return Solution(
        offsets=offsets,
        peak=peak,
        lower_bound=problem.lower_bound,
        solver="best",
        seconds=time.perf_counter() - t0,
        optimal=peak == problem.lower_bound or (best_cost <= floor_cap and problem.alignment == 1),
        meta=meta,
    )


def _noisy_order(keys: dict[str, np.ndarray], h: str, rng: np.random.Generator, n: int) -> np.ndarray:
    """The preorder ``h`` with each key perturbed by up to 30%: a restart under it
    explores other early choices than the static orders."""
    cols = [-(keys[c] * rng.uniform(0.7, 1.3, size=n)) for c in h]
    return np.lexsort((np.arange(n), *cols[::-1]))


def _frac(t0: float, limit: float) -> float:
    return min(1.0, (time.perf_counter() - t0) / limit) if limit > 0 else 1.0
