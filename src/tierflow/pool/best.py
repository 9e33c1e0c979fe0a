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
   Once the search and the ladder (below) have had half the limit in CPU time and
   neither has lowered the peak for 30% of it, the main thread leaves the search to
   the min-conflicts descent of :mod:`.descent`, which lowers the best placement either
   has found a unit at a time (wall-clock mode only).
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
import threading
import time
from collections.abc import Callable

import numpy as np

from . import descent, lns, repair, search
from .greedy import best_fit, size_order
from .ladder import LadderResult, ladder
from .problem import Problem, Solution, lower_bound, peak_of
from .reduce import Reduced, reduce

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
# the decision ladder (module ladder, CP-SAT) runs beside the search on problems of at
# most this many buffers (its model grows with the overlapping pairs)
LADDER_MAX_BUFFERS = 2000
# lanes of the ladder beside the search (each a thread; CP-SAT and the compiled search
# release the GIL)
LADDER_WORKERS = 1
# NOTE: the ladder starts beside the search at once. It once waited for 40% of the
# limit (on busy cores its thread slowed the search), but since its bottom-up member
# places MiniMalloc's A, B, F and the generated full sets at the bound within about a
# second, starting at once was never worse, case by case (A-K and the generated sets at
# 10 s, load 4.5: geomean 1.0080 against 1.0118, the generated strips-600-free 1.0000
# against 1.0723).
# deterministic mode (a node limit): CP-SAT deterministic time the ladder gets after
# the search unless asked otherwise, in CP-SAT's work unit (one unit took 10-100 CPU
# seconds on the challenging set): none, so a node limit alone keeps its old meaning
LADDER_DET_BUDGET = 0.0
# wall-clock mode: the main thread leaves the canonical search to the min-conflicts
# descent (module descent) from the best placement found by it or the ladder once the
# solver's threads have had DESCENT_AT of the time limit each in CPU time (not wall
# time: on a loaded machine the search needs its CPU seconds before it stalls) and
# neither has lowered the best peak for DESCENT_STALL of the limit (DESCENT_AT = 1.0:
# never). Measured (BENCHMARKS.md): the descent lowers placements the search and the
# ladder have stalled at (MiniMalloc's J, the generated guillotine-450-free); started
# by the wall clock at load 4-8 it cut the search short (D, J worse)
DESCENT_AT = 0.5
DESCENT_STALL = 0.3
# "takeover": the descent replaces the search in the main thread; "thread": it runs in
# a thread of its own beside the search and the ladder. A third busy thread on two
# cores slowed the other two: at load 4-6, D 1.0758 against 1.0540 and the generated
# guillotine-450-free 1.0635 against 1.0430 without the descent
DESCENT_MODE = "takeover"
# the descent's moves cost O(capacity in units): it runs only up to this capacity
DESCENT_MAX_CAP = 1 << 16
# ... and on problems of at most this many buffers (its moves scan every buffer)
DESCENT_MAX_BUFFERS = 2000


def solve_best(
    problem: Problem,
    time_limit: float = 10.0,
    progress: Progress | None = None,
    seed: int = 0,
    node_limit: int | None = None,
    ladder_det_budget: float | None = None,
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
            that does not bind) the result is deterministic: the ladder then runs after
            the search, only when ``ladder_det_budget`` is given.
        ladder_det_budget: with a node limit, CP-SAT deterministic time for the ladder
            (default :data:`LADDER_DET_BUDGET`, none: 0.01 is about a second here).
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

    # 2a. the decision ladder: beside the search in a thread (wall-clock mode), or
    # after it within a deterministic budget (node-limit mode)
    # the search's best peak in alignment units and its placement (kept buffers, units),
    # read by the ladder: it bisects below that peak and hints that placement
    shared = [best_cost * gcd, best_off * gcd]
    lad = _LadderRun.start(problem, keep, best_off * gcd, deadline, seed, threaded=node_limit is None,
                           active=best_cost > lb and 0 < n <= LADDER_MAX_BUFFERS, known=shared)

    # 2. capacity search in rounds of doubling node budgets, in wall-clock mode until
    # the descent takes over the main thread (step 2b)
    descending = node_limit is None and 0 < n <= DESCENT_MAX_BUFFERS and best_cost <= DESCENT_MAX_CAP
    # the last time the best peak (search or ladder) went down, and that peak
    gain = [t0, best_cost]
    desc = _DescentRun()
    c0 = time.process_time()
    threads = 1 + (lad.thread is not None)

    def publish(off: np.ndarray) -> None:
        """Share a placement (kept buffers, units) with the ladder when it is the lowest."""
        if cost(off) * gcd < shared[0]:
            shared[:] = [cost(off) * gcd, off * gcd]

    def lowest() -> np.ndarray:
        """The lowest placement the search or the ladder has found (units)."""
        other = lad.placement(keep, gcd, problem.alignment)
        return other if other is not None and cost(other) < cost(best_off) else best_off

    def searching() -> bool:
        """The search goes on: before the deadline, and (in takeover mode) before the
        descent's turn; in thread mode the descent's thread is started here."""
        now = time.perf_counter()
        if now >= deadline:
            return False
        if not descending or desc.started:
            return True
        low = min(best_cost, lad.cost(gcd))
        if low < gain[1]:
            gain[:] = [now, low]
        if (time.process_time() - c0 < DESCENT_AT * time_limit * threads
                or now - gain[0] < DESCENT_STALL * time_limit):
            return True
        if DESCENT_MODE != "thread":
            return False
        desc.start(lambda: descent.descend(
            lower, upper, units, lowest(), floor_cap, deadline, seed=seed, stop=lambda: lad.settled() or desc.halt,
            better=lowest, found=publish))
        return True
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
                   and searching()):
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
            if nodes >= budget or not searching() or gave_up:
                break
        return None, False

    floor_cap = lb  # proven: nothing below it is feasible
    # the ladder's best so far bounds the search's bisection too: a capacity at or above
    # a peak either has found is not worth a probe
    while (min(best_cost, lad.cost(gcd)) > floor_cap and nodes < budget and searching()
           and not gave_up and not lad.settled()):
        off, proven = probe(floor_cap, LB_WEIGHT * limit)
        if off is not None:
            best_off, best_cost, best_from = off, cost(off), "search"
            publish(best_off)
            break
        if proven:
            floor_cap += 1
            continue
        lo, hi = floor_cap + 1, min(best_cost, lad.cost(gcd)) - 1
        while lo <= hi and nodes < budget and searching() and not gave_up and not lad.settled():
            hi = min(hi, lad.cost(gcd) - 1)
            if lo > hi:
                break
            cap = (lo + hi) // 2
            off, proven = probe(cap, limit)
            if off is not None:
                best_off, best_cost, best_from = off, cost(off), "search"
                publish(best_off)
                hi = best_cost - 1
            else:
                if proven:
                    floor_cap = max(floor_cap, cap + 1)
                lo = cap + 1
            report(_frac(t0, time_limit), best_cost * gcd * problem.alignment)
        limit *= 2
        rounds += 1

    # 2b. the descent from the best placement either has found, the ladder's later
    # placements taken up as they come; its own go to the ladder (shared)
    if desc.started:  # thread mode: it ends at the deadline, or now when the search met its floor
        desc.halt = best_cost <= floor_cap
        off, facts = desc.join()
    elif (descending and DESCENT_MODE != "thread" and best_cost > floor_cap and time.perf_counter() < deadline
          and not lad.settled()):
        off, facts = descent.descend(lower, upper, units, lowest(), floor_cap, deadline, seed=seed,
                                     stop=lad.settled, better=lambda: lad.placement(keep, gcd, problem.alignment),
                                     found=publish)
    else:
        off = facts = None
    if facts is not None:
        meta["descent"] = {k: facts[k] for k in ("steps", "tries", "moves")}
        if cost(off) < best_cost:
            best_off, best_cost, best_from = off, cost(off), "descent"

    # the ladder's answer: waited for (or run now, in deterministic mode), then kept
    # when it is lower; its proof raises the floor
    if lad.active:
        res = lad.finish(stop=best_cost <= floor_cap, det_budget=LADDER_DET_BUDGET if ladder_det_budget is None
                         else ladder_det_budget)
        meta["ladder"] = lad.facts(problem)
        if res is not None:
            full = lad.red.expand(res.offsets)[keep] // (gcd * problem.alignment)
            # the ladder's grid (the gcd of fewer sizes) is a multiple of the search's
            if lad.red.scale % (gcd * problem.alignment) == 0 and cost(full) < best_cost:
                best_off, best_cost, best_from = full, cost(full), "ladder"
            # proven: no placement peaks below res.floor * scale bytes (in units when
            # the alignment is 1), so no cost below its ceiling in the search's units
            floor_cap = max(floor_cap, -(-res.floor * lad.red.scale // (gcd * problem.alignment)))

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


class _DescentRun:
    """The descent of :mod:`.descent` in a thread of its own (``DESCENT_MODE = "thread"``)."""

    def __init__(self) -> None:
        self.started = False
        self.halt = False  # set to end it early
        self.thread: threading.Thread | None = None
        self.result: tuple[np.ndarray, dict] | None = None

    def start(self, run: Callable[[], tuple[np.ndarray, dict]]) -> None:
        def body() -> None:
            self.result = run()
        self.started = True
        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()

    def join(self) -> tuple[np.ndarray | None, dict | None]:
        self.thread.join()
        return self.result if self.result is not None else (None, None)


class _LadderRun:
    """The ladder of :mod:`.ladder` on the reduced problem, in a thread beside the
    search or run later, and its answer in the search's terms."""

    def __init__(self, red: Reduced | None, start: np.ndarray | None, deadline: float, seed: int,
                 threaded: bool, known: list[int] | None = None) -> None:
        self.red, self.start, self.deadline, self.seed = red, start, deadline, seed
        self.known = known
        # the ladder's best peak so far in alignment units, with the set-aside buffers
        self.best_units: float = math.inf
        # the ladder's best placement so far (reduced units), None before its first
        self.best_offsets: np.ndarray | None = None
        self.aside = 0
        self.active = red is not None
        self.stop = threading.Event()
        self.result: LadderResult | None = None
        self.thread: threading.Thread | None = None
        if self.active and threaded:
            self.thread = threading.Thread(target=self._run, kwargs={"det_budget": None, "beside": True}, daemon=True)
            self.thread.start()

    @classmethod
    def start(cls, problem: Problem, keep: np.ndarray, start_units: np.ndarray, deadline: float, seed: int,
              threaded: bool, active: bool, known: list[int] | None = None) -> _LadderRun:
        """``start_units``: the incumbent of the kept buffers in alignment units;
        ``known[0]``: the search's best peak in alignment units as it improves."""
        if not active or not lns.available():
            return cls(None, None, deadline, seed, threaded)
        red = reduce(problem)
        full = np.zeros(len(problem), dtype=np.int64)
        full[keep] = start_units * problem.alignment
        start = red.restrict(full)
        if start is None:  # not on the reduced grid: start from greedy there instead
            start = best_fit(red.lower, red.upper, red.size, np.lexsort((np.arange(len(red)), red.lower, -red.size)))
        run = cls(red, start, deadline, seed, threaded, known)
        run.keep = keep
        aside = np.setdiff1d(np.arange(len(problem)), red.keep)
        run.aside = int(problem.units[aside].max(initial=0))
        return run

    def _run(self, det_budget: float | None, beside: bool = False) -> None:
        if beside and self.stop.is_set():
            return  # the search met its floor first
        known = known_hint = None
        if self.known is not None and det_budget is None:  # beside the search only: it changes under us
            # a placement peaking at P units pushes down onto the reduced grid at P // gcd
            known = lambda: self.known[0] // self.red.gcd  # noqa: E731
            known_hint = self._known_hint
        def found(peak: int) -> None:
            self.best_units = max(peak * self.red.gcd, self.aside)

        self.result = ladder(self.red, self.start, time_limit=max(0.0, self.deadline - time.perf_counter()),
                             seed=self.seed, workers=LADDER_WORKERS, det_budget=det_budget, stop=self.stop,
                             known=known, known_hint=known_hint, progress=found, placed=self._placed)

    def _placed(self, offsets: np.ndarray) -> None:
        self.best_offsets = offsets

    def placement(self, keep: np.ndarray, gcd: int, alignment: int) -> np.ndarray | None:
        """The ladder's best placement so far in the search's terms (the kept buffers,
        units of ``gcd`` alignment units), or None when there is none or its grid is not
        the search's."""
        off = self.best_offsets
        if off is None or self.red is None or self.red.scale % (gcd * alignment):
            return None
        return self.red.expand(off)[keep] // (gcd * alignment)

    def _known_hint(self) -> np.ndarray | None:
        """The search's placement on the reduced grid, or None when it is off it."""
        units = self.known[1]
        full = np.zeros(self.red.n, dtype=np.int64)
        full[self.keep] = units * self.red.alignment
        return self.red.restrict(full)

    def cost(self, gcd: int) -> float:
        """The ladder's best peak so far in the search's units (rounded up), or inf."""
        return math.inf if math.isinf(self.best_units) else -(-int(self.best_units) // gcd)

    def settled(self) -> bool:
        """The ladder (in its thread) has finished with a proven optimum."""
        return self.result is not None and self.result.optimal

    def finish(self, stop: bool, det_budget: float) -> LadderResult | None:
        """Its result: stopped first when ``stop`` (the search met its floor), joined
        in threaded mode, run now with ``det_budget`` otherwise."""
        if self.thread is not None:
            if stop:
                self.stop.set()
            self.thread.join()
        elif not stop and det_budget > 0:
            self._run(det_budget)
        return self.result

    def facts(self, problem: Problem) -> dict:
        r = self.result
        if r is None:
            return {"ran": False}
        scale = self.red.scale
        return {"ran": True, "peak": r.peak * scale, "floor": r.floor * scale, "optimal": r.optimal,
                "attempts": [{"capacity": a.cap * scale, "by": a.variant, "status": a.status,
                              "seconds": round(a.seconds, 3)} for a in r.attempts]}


def _noisy_order(keys: dict[str, np.ndarray], h: str, rng: np.random.Generator, n: int) -> np.ndarray:
    """The preorder ``h`` with each key perturbed by up to 30%: a restart under it
    explores other early choices than the static orders."""
    cols = [-(keys[c] * rng.uniform(0.7, 1.3, size=n)) for c in h]
    return np.lexsort((np.arange(n), *cols[::-1]))


def _frac(t0: float, limit: float) -> float:
    return min(1.0, (time.perf_counter() - t0) / limit) if limit > 0 else 1.0
