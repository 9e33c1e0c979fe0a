"""The decision ladder: the lower bound first, then bisection towards the best found.

Minimising the peak directly is hard for CP-SAT (it proves little and improves slowly);
deciding "is there a placement under capacity ``c``?" is much easier, and a ladder of
such decisions gives both placements and proofs (MiniMalloc's scheme):

1. Ask the lower bound. A placement there is optimal.
2. Otherwise bisect between the bound and the best peak found: a placement under ``c``
   lowers the best; a proof that none exists at ``c`` raises the floor to ``c + 1``,
   and once the floor meets the best peak that peak is proven optimal.
3. An attempt gets a share of the budget; the next round doubles the shares and starts
   again from the floor (an attempt left undecided may settle with more time).

Each rung runs a *portfolio* of members in *lanes* (one lane a core): first CP-SAT's
fixed bottom-up search under a new variable order each try (:func:`.decide.bottom_up_order`;
bounded by deterministic time, so load does not cut it short), then the skyline
search of :mod:`.skyline` (fast on sets that are full at every instant, blind with free
space, so it gets a short slice) and CP-SAT decisions of :mod:`.decide` with and
without symmetry breaking and hints, with per-round seeds. The first member that
decides a rung ends the others' attempts at it. Which mix pays on two cores was
measured (``benchmarks/pool_ladder.py``, BENCHMARKS.md).

Everything runs on the :class:`~.reduce.Reduced` problem; the best placement is always
a valid one (the initial incumbent or a decided rung's answer).

Deterministic mode (``det_budget``): one lane, members in a fixed order, CP-SAT bounded
by its deterministic time and the skyline by nodes, so the answer depends only on the
input and the seed; a wall-clock deadline still caps it (not binding in tests).

Example::

    red = reduce(problem)
    res = ladder(red, start_offsets, time_limit=10)
    offsets = red.expand(res.offsets)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from . import skyline as sky
from .decide import FEASIBLE, INFEASIBLE, UNKNOWN, Attempt, Stop, Variant, decide_cpsat
from .reduce import Reduced

# share of the whole budget the lower-bound rung gets in the first round, and each
# bisection rung (later rounds double both)
LB_SHARE = 0.5
RUNG_SHARE = 0.1
# share of a rung's slice the skyline search may use before its lane moves on
SKYLINE_SHARE = 0.25
# wall seconds of a CP-SAT attempt in a lane's first pass (doubling every pass)
RESTART_SLICE = 0.5
# skyline nodes per restart (restarts: SKYLINE_RESTARTS, rotating orders)
SKYLINE_NODES = 2000
SKYLINE_RESTARTS = 6
# the bottom-up member: orders tried per pass, and CP-SAT deterministic time per order
# in the first pass (its successes on the generated sets took 0.011-0.07 of it, 0.3-1.6
# wall seconds on a loaded 2-core machine)
BOTTOM_UP_TRIES = 3
BOTTOM_UP_DET = 0.05


@dataclass
class LadderResult:
    """What the ladder found (reduced units).

    Attributes:
        offsets: the best placement.
        peak: its highest top.
        floor: proven: no placement peaks below it.
        attempts: every rung's attempts, in order.
    """

    offsets: np.ndarray
    peak: int
    floor: int
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def optimal(self) -> bool:
        return self.peak <= self.floor


@dataclass(frozen=True)
class Member:
    """One way to decide a rung: a CP-SAT variant or the skyline search."""

    name: str
    variant: Variant | None = None  # None: the skyline search
    weight: float = 1.0  # its restarts last this many slices
    # a bottom-up member (variant.order >= 0) tries a new order each pass, ``stride``
    # past its last (copies of it in a lane start at consecutive orders): its search
    # is deterministic for an order, so a new seed would repeat it while a new order
    # is a new try
    stride: int = 1
    # wall mode: each try is bounded by this much CP-SAT deterministic time (doubling
    # every pass) instead of a wall slice, so a loaded machine slows it but does not cut
    # it short (0: a wall slice of weight x RESTART_SLICE)
    det_slice: float = 0.0


def lanes_for(workers: int, seed: int, bisecting: bool = False, round_: int = 0) -> list[list[Member]]:
    """The portfolio, split in ``workers`` lanes run in parallel. A lane cycles through
    its members until the rung's slice ends, each CP-SAT attempt a short restart
    (:data:`RESTART_SLICE`, doubling every pass) with a new seed each pass: their run
    times are heavy-tailed and vary with the seed, so many short tries beat one long.

    Measured on the generated sets (BENCHMARKS.md): symmetry breaking without a hint
    solves most; a hint from greedy slowed CP-SAT down by 10-100x at the bound; the
    plain model and energetic reasoning solve others; CP-SAT's fixed bottom-up search
    and the skyline solve sets that are full at every instant. One worker runs them
    all in one lane. Above the floor (``bisecting``) the hinted member comes right
    after the first bottom-up try: a placement just above the capacity is a good start
    there, and without it CP-SAT found nothing even at 1.15 x the bound on MiniMalloc's
    D in 0.03 deterministic time.

    The bottom-up member (CP-SAT's fixed search under the orders of
    :func:`.decide.bottom_up_order`) leads every lane: on the 450- and 600-buffer
    generated sets, with and without free space, it was the only member that placed
    them at or near the bound within 10 s, each success within 1.6 s of one order, so
    it tries :data:`BOTTOM_UP_TRIES` new orders a pass, interleaved with the other
    members. Round ``round_`` starts again from the first orders with twice the
    previous round's deterministic time: on a loaded machine the rung's wall share
    can end a try before its budget (the search by start placed the generated
    strips-600-free at the bound in 0.049 deterministic time, 1.2-3.2 s of wall time
    at loads 2-3), and the same order searched further is what that try needed."""
    sym = Member("cpsat-sym", Variant("cpsat-sym", symmetry=True, hint=False, seed=seed))
    energy = Member("cpsat-energy", Variant("cpsat-energy", symmetry=True, hint=False, seed=seed,
                                            params=(("use_energetic_reasoning_in_no_overlap_2d", True),)))
    plain = Member("cpsat-plain", Variant("cpsat-plain", symmetry=False, hint=False, seed=seed))
    # the fixed search gains little from restarts (its order is fixed): longer slices
    fixed = Member("cpsat-fixed", Variant("cpsat-fixed", symmetry=True, hint=False, seed=seed, fixed=True), 4.0)
    hinted = Member("cpsat-hint", Variant("cpsat-hint", symmetry=True, hint=True, seed=seed))
    skyline_m = Member("skyline")
    # copies of the bottom-up member interleaved with the others: each new order is a
    # fresh chance, but so is each other member's first restart (symmetry breaking
    # settled strips-250-free in 0.3 s where the bottom-up orders did not)
    bu = [Member("cpsat-bottom-up", Variant("cpsat-bottom-up", symmetry=True, hint=False, seed=seed, fixed=True,
                                            order=j),
                 stride=BOTTOM_UP_TRIES, det_slice=BOTTOM_UP_DET * 2 ** round_) for j in range(BOTTOM_UP_TRIES)]
    if workers <= 1:
        if bisecting:
            return [[bu[0], hinted, bu[1], skyline_m, bu[2], sym, fixed, energy, plain]]
        return [[bu[0], sym, bu[1], skyline_m, bu[2], energy, fixed, plain, hinted]]
    if bisecting:
        return [[bu[0], hinted, bu[1], sym, bu[2], energy], [skyline_m, fixed, plain]]
    return [[bu[0], sym, bu[1], energy, bu[2], hinted], [skyline_m, fixed, plain]]


def ladder(
    red: Reduced,
    start: np.ndarray,
    time_limit: float = 10.0,
    floor: int | None = None,
    seed: int = 0,
    workers: int = 2,
    det_budget: float | None = None,
    stop: threading.Event | None = None,
    progress: Callable[[int], None] | None = None,
    known: Callable[[], int] | None = None,
    known_hint: Callable[[], np.ndarray | None] | None = None,
    placed: Callable[[np.ndarray], None] | None = None,
) -> LadderResult:
    """Lower the peak of ``start`` by a ladder of decisions (module docstring).

    Args:
        red: the reduced problem.
        start: a valid placement of it (reduced units): the initial best and hint.
        time_limit: wall seconds in all.
        floor: a capacity already proven a lower bound (default ``red.lower_bound``).
        seed: seeds of CP-SAT and of the skyline's random orders.
        workers: lanes run in parallel (threads; CP-SAT releases the GIL).
        det_budget: deterministic mode: CP-SAT deterministic time for the whole ladder
            (shares as for the wall budget); one lane whatever ``workers`` says.
        stop: set by a caller to end the ladder early (e.g. another solver met the bound).
        progress: called with the best peak whenever it improves.
        known: the best peak another solver running beside has found (reduced units):
            bisection then aims below it rather than below the ladder's own best.
        known_hint: that solver's placement (reduced units) or None: the hint of
            bisection rungs when it peaks lower than the ladder's own best.
        placed: called with each placement that lowers the best (reduced units), so a
            solver beside it can go on from it.
    """
    t0 = time.perf_counter()
    deadline = t0 + max(0.0, time_limit)
    best = np.asarray(start, dtype=np.int64).copy()
    peak = red.peak(best)
    low = max(red.lower_bound, int(red.size.max(initial=0)), floor or 0)
    result = LadderResult(best, peak, low)
    deterministic = det_budget is not None
    total = det_budget if deterministic else max(0.0, time_limit)
    used_det = 0.0
    round_ = 0

    def spent() -> float:
        return used_det if deterministic else time.perf_counter() - t0

    def halted() -> bool:
        return time.perf_counter() >= deadline or (stop is not None and stop.is_set()) or spent() >= total

    def rung(cap: int, share: float) -> Attempt:
        nonlocal used_det
        share = min(share, total - spent())
        bisecting = cap > result.floor
        lanes = lanes_for(1 if deterministic else workers, seed + 1000 * round_, bisecting, round_)
        hint = result.offsets
        other = known_hint() if known_hint is not None and bisecting else None
        if other is not None and red.peak(other) < result.peak:
            hint = other
        att = _run_rung(red, cap, lanes, share, deterministic, deadline, hint, seed + round_, stop)
        result.attempts.extend(att)
        used_det += sum(a.det_time for a in att) if deterministic else 0.0
        for a in att:
            if a.status == FEASIBLE:
                return a
        for a in att:
            if a.status == INFEASIBLE:
                return a
        return Attempt(cap, "portfolio", UNKNOWN)

    def accept(a: Attempt) -> None:
        if a.offsets is not None and red.peak(a.offsets) < result.peak:
            result.offsets, result.peak = a.offsets, red.peak(a.offsets)
            if progress is not None:
                progress(result.peak)
            if placed is not None:
                placed(result.offsets)

    while result.peak > result.floor and not halted():
        scale = 2.0 ** round_
        a = rung(result.floor, LB_SHARE * total * scale)
        if a.status == FEASIBLE:
            accept(a)
            break
        if a.status == INFEASIBLE:
            result.floor = a.cap + 1
            continue
        lo, hi = result.floor + 1, _below(result.peak, known)
        while lo <= hi and not halted():
            cap = (lo + hi) // 2
            a = rung(cap, RUNG_SHARE * total * scale)
            if a.status == FEASIBLE:
                accept(a)
                hi = _below(result.peak, known)
            else:
                if a.status == INFEASIBLE:
                    result.floor = max(result.floor, cap + 1)
                lo = cap + 1
        round_ += 1
    return result


def _below(peak: int, known: Callable[[], int] | None) -> int:
    """The highest capacity worth asking: one below the best peak anyone has found."""
    return min(peak, known() if known is not None else peak) - 1


def _run_rung(red: Reduced, cap: int, lanes: list[list[Member]], share: float, deterministic: bool,
              deadline: float, hint: np.ndarray, seed: int, outer: threading.Event | None) -> list[Attempt]:
    """Run the lanes at ``cap`` within ``share`` (wall seconds, or deterministic time:
    then one pass, the share split evenly among the CP-SAT members)."""
    stop = Stop()
    start = time.perf_counter()
    rung_end = deadline if deterministic else min(deadline, start + share)
    attempts: list[list[Attempt]] = [[] for _ in lanes]

    def halted() -> bool:
        return bool(stop) or (outer is not None and outer.is_set()) or time.perf_counter() >= rung_end

    def lane(k: int) -> None:
        members = lanes[k]
        n_cp = sum(1 for m in members if m.variant is not None)
        for pass_ in range(1 if deterministic else 1 << 30):
            for m in members:
                if halted():
                    return
                if m.variant is None:
                    if pass_:
                        continue  # the skyline's restarts all ran in the first pass
                    end = time.perf_counter() + SKYLINE_SHARE * max(0.0, rung_end - time.perf_counter())
                    a = _skyline(red, cap, seed, stop, deterministic, end)
                else:
                    v = replace(m.variant, seed=m.variant.seed + pass_)
                    if v.order >= 0:  # a new order each pass (docstring of lanes_for)
                        v = replace(v, order=v.order + pass_ * m.stride)
                    if deterministic:
                        det, end = share / max(1, n_cp), rung_end
                    elif m.det_slice > 0:
                        det, end = m.det_slice * 2 ** pass_, rung_end
                    else:
                        det, end = 1e9, min(rung_end, time.perf_counter() + m.weight * RESTART_SLICE * 2 ** pass_)
                    a = decide_cpsat(red, cap, v, det, end, hint=hint, stop=stop)
                attempts[k].append(a)
                if a.status != UNKNOWN:
                    stop.set()
                    return

    if len(lanes) == 1:
        lane(0)
    else:
        threads = [threading.Thread(target=lane, args=(k,), daemon=True) for k in range(len(lanes))]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            # a caller's stop ends the rung's CP-SAT solves at once
            if outer is not None and outer.is_set():
                stop.set()
            threads[0].join(0.05)
        for t in threads:
            t.join()
    return [a for lst in attempts for a in lst]


def _skyline(red: Reduced, cap: int, seed: int, stop: Stop, deterministic: bool, end: float) -> Attempt:
    """Restarts of the skyline search under rotating orders, node limits doubling."""
    t0 = time.perf_counter()
    orders = sky.orders(red.lower, red.upper, red.size, SKYLINE_RESTARTS, seed=seed)
    nodes = 0

    class _Until:
        def __bool__(self) -> bool:
            return bool(stop) or time.perf_counter() >= end

    until = None if deterministic else _Until()
    for k, order in enumerate(orders):
        limit = SKYLINE_NODES if deterministic else SKYLINE_NODES * 2 ** (k // 3)
        off, used = sky.skyline(red.lower, red.upper, red.size, cap, order, limit, stop=until)
        nodes += used
        if off is not None:
            return Attempt(cap, "skyline", FEASIBLE, off, time.perf_counter() - t0, facts={"nodes": nodes})
        if until is not None and until:
            break
    return Attempt(cap, "skyline", UNKNOWN, None, time.perf_counter() - t0, facts={"nodes": nodes})

