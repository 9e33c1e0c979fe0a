"""Device memory through a planned pool: the simulator with a static arena's fragmentation.

:func:`~tierflow.simulate.simulate` counts device bytes: a tensor fits whenever the
bytes in use plus its own stay within the budget, as if the allocator could always find
a contiguous block (a perfect allocator). :func:`simulate_pooled` asks what a real
static pool costs instead. Its semantics:

1. **Record.** The plan is simulated as usual, and every allocation of device memory in
   the reported (steady-state) iteration is recorded with the tensor it holds: a birth,
   a fetch (bytes are reserved when it is issued), and its end: an eviction (bytes are
   held until it completes) or a free at the tensor's death. Tensors on the device when
   the iteration starts get a buffer from its first instant.
2. **Time.** The time axis counts allocations: the ``k``-th allocation of the iteration
   is instant ``k``, and a block freed between allocations ``k`` and ``k + 1`` is live on
   ``[lower, k + 1)``. Two blocks therefore overlap exactly when both were held at once
   somewhere in the simulation, so the problem's lower bound is the simulator's own
   device peak (checked on every run).
3. **Across iterations.** A static layout repeats every iteration: time is a circle,
   and a tensor held on the device when the iteration ends and when it starts is one
   allocation across the boundary (one arc). The pool planner lays out intervals, so the
   circle is cut at one instant: arcs that hold the cut become blocks over the whole
   iteration (they keep one offset throughout, conservative for the time they are
   away), every other arc is an interval of the rotated axis. The cut is the instant
   (every one, or evenly spaced ones on long iterations) that gives the lowest live
   peak after this conversion: the problem's lower bound, reported.
4. **Lay out.** The pool planner gives every block an offset (``greedy`` or ``best``),
   and the independent validator checks them. The arena's peak is what the device must
   hold; ``arena - live peak`` is the fragmentation.
5. **Fit.** If the arena exceeds the plan's budget, that layout cannot run: the plan
   effectively has ``overflow`` bytes fewer. The iteration is simulated again at a
   budget lowered by the overflow (the same plan, or a new plan for that budget when
   ``replan`` is given) and its residency laid out again; while the arena still does
   not fit, the step down doubles (never below the largest working set of one op).
   Once a budget fits, the search bisects between it and the lowest higher budget that
   did not, to within :data:`TOLERANCE` of the budget or ``max_rounds`` simulations.
   The result is that of the highest budget found whose arena fits the original
   budget, so its step time pays for fragmentation; if none fits, the result says the
   plan does not fit.

A reactive plan's residency is decided at run time; its pool is the layout an offline
planner would give the residency the simulation produced (a bound for that pager, not
what an online allocator would achieve). ``pool="none"`` is plain :func:`simulate`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import SimulationError, TierflowError
from ..hardware import Hardware
from ..plan import Plan, validate
from ..trace import Trace
from .result import PoolAccount, SimResult
from .simulator import INCOMING, OUTGOING, RESIDENT, ProgressFn, _Simulator, simulate

if TYPE_CHECKING:  # the pool package is imported when a pool is asked for
    from ..pool import Problem

POOL_CHOICES = ("none", "greedy", "best")
MAX_ROUNDS = 8
# the search for a fitting budget stops when the gap between one that fits and one
# that does not is below this share of the plan's budget
TOLERANCE = 0.005
# elements of work the choice of a cut may take: every cut is tried when that is cheap
CUT_WORK = 20_000_000

_ON_DEVICE = (RESIDENT, INCOMING, OUTGOING)


class PoolAccountingError(TierflowError):
    """The recorder lost track of a device allocation: a bug, not bad input."""


class _Recorder(_Simulator):
    """The simulator, recording each device allocation of the last iteration with its
    tensor. It overrides the memory bookkeeping methods only to watch them: every call
    goes on to the simulator's own code, so the simulation is the plain one."""

    def __init__(self, trace: Trace, hw: Hardware, plan: Plan, start_tier: dict[int, str]):
        super().__init__(trace, hw, plan, start_tier)
        self._rec = False
        self._clock = 0  # allocations so far in the recorded iteration
        self._open: dict[int, int] = {}  # tensor -> index in _bufs of its open block
        self._bufs: list[list[int]] = []  # [tensor, lower, upper]; upper -1 while open
        self._alloc_t: int | None = None  # the tensor a _fetch is allocating
        self._free_t: int | None = None  # the tensor an eviction or death frees

    def _start(self, t: int, lower: int) -> None:
        if t in self._open:
            raise PoolAccountingError(f"pool accounting: tensor {t} allocated on the device twice")
        self._open[t] = len(self._bufs)
        self._bufs.append([t, lower, -1])

    def _open_window(self) -> None:
        super()._open_window()
        self._rec = True
        for t, s in enumerate(self.state):
            if s in _ON_DEVICE:
                self._start(t, 0)

    def _alloc(self, tier: str, nbytes: float) -> None:
        if self._rec and tier == self.dev:
            t, self._alloc_t = self._alloc_t, None
            if t is None:
                t = self._born_now()
            if nbytes != self.size[t]:
                raise PoolAccountingError(f"pool accounting: {nbytes} bytes allocated for tensor {t} "
                                          f"of {self.size[t]} bytes")
            self._clock += 1
            self._start(t, self._clock)
        super()._alloc(tier, nbytes)

    def _born_now(self) -> int:
        """The tensor a direct allocation is for: the simulator allocates a birth (or a
        dropped, overwritten tensor) right after marking one of the op's tensors
        resident, so exactly one of them is resident without an open block."""
        cands = [t for t in self.pinned if self.state[t] == RESIDENT and t not in self._open]
        if len(cands) != 1:
            raise PoolAccountingError(
                f"pool accounting: cannot tell which tensor an allocation at op {self.current_op} "
                f"is for (candidates {sorted(cands)})"
            )
        return cands[0]

    def _free(self, tier: str, nbytes: float) -> None:
        if self._rec and tier == self.dev:
            t, self._free_t = self._free_t, None
            if t is None or t not in self._open:
                raise PoolAccountingError(f"pool accounting: a device free at op {self.current_op} "
                                          f"matches no open block (tensor {t})")
            self._bufs[self._open.pop(t)][2] = self._clock + 1
        super()._free(tier, nbytes)  # may start prefetches: after the free is recorded

    def _fetch(self, t: int, kind: str) -> None:
        prev, self._alloc_t = self._alloc_t, t
        try:
            super()._fetch(t, kind)
        finally:
            self._alloc_t = prev

    def _evicted(self, f) -> None:  # noqa: ANN001 - engine.Flow
        self._free_t = f.tensor
        super()._evicted(f)

    def _die(self, t: int) -> None:
        if self.state[t] == RESIDENT:
            self._free_t = t
        super()._die(t)

    def blocks(self) -> tuple[list[tuple[int, int, int]], int]:
        """The recorded ``(tensor, lower, upper)`` blocks in allocation order, and the
        length of the axis (blocks still held at the end end with it)."""
        end = self._clock + 1
        return [(t, lo, end if hi < 0 else hi) for t, lo, hi in self._bufs], end

    def problem(self, alignment: int = 1) -> tuple[Problem, int]:
        """The recorded iteration as a pool problem, and how many tensors are laid out
        over the whole iteration because they are held across the cut (module
        docstring, point 3).

        Raises:
            PoolAccountingError: the blocks' live peak is not the simulator's device peak.
        """
        from ..pool import Buffer, Problem, lower_bound

        blocks, end = self.blocks()
        raw = Problem(tuple(Buffer(str(k), lo, hi, self.size[t]) for k, (t, lo, hi) in enumerate(blocks)))
        live = lower_bound(raw)
        if live != int(self.peak[self.dev]):
            raise PoolAccountingError(
                f"pool accounting: recorded blocks peak at {live} bytes, the simulator at "
                f"{int(self.peak[self.dev])}"
            )
        return periodic_problem(blocks, self.size, end, alignment, self.trace.name)


def periodic_problem(
    blocks: list[tuple[int, int, int]],
    sizes: list[int],
    end: int,
    alignment: int = 1,
    name: str = "",
) -> tuple[Problem, int]:
    """The pool problem of a repeating iteration's device blocks, cut where it costs least.

    Args:
        blocks: ``(tensor, lower, upper)`` on the axis ``[0, end)``, each tensor's in
            time order; a tensor's block that starts at 0 and its block that ends at
            ``end`` are one allocation across the boundary.
        sizes: bytes per tensor.
        end: the length of the axis.
        alignment: offset alignment of the problem.
        name: the problem's name.

    Returns:
        The problem on the axis rotated to start at the chosen cut (ids ``"<tensor>"``
        or ``"<tensor>.<k>"``), and how many tensors span it whole.
    """
    from ..pool import Buffer, Problem

    per: dict[int, list[tuple[int, int]]] = {}
    for t, lo, hi in blocks:
        per.setdefault(t, []).append((lo, hi))
    arcs: list[tuple[int, int, int]] = []  # (tensor, start, length) on the circle
    for t in sorted(per):
        spans = per[t]
        if len(spans) > 1 and spans[0][0] == 0 and spans[-1][1] == end:
            (_, e), (s, _) = spans[0], spans[-1]
            spans = spans[1:-1]
            arcs.append((t, s, end - s + e))
        arcs += [(t, lo, hi - lo) for lo, hi in spans]
    start = np.array([a[1] for a in arcs], dtype=np.int64)
    length = np.array([a[2] for a in arcs], dtype=np.int64)
    size = np.array([sizes[a[0]] for a in arcs], dtype=np.float64)  # sums stay exact below 2**53

    def holds(c: int) -> tuple[np.ndarray, np.ndarray]:
        """Which arcs hold cut ``c`` (they become whole blocks), and every arc's start
        on the axis rotated to begin at ``c``."""
        rel = (start - c) % end
        return (length >= end) | ((rel > 0) & (rel + length > end)), rel

    def bound(c: int) -> float:
        whole, rel = holds(c)
        part = ~whole
        curve = (np.bincount(rel[part], size[part], minlength=end + 1)
                 - np.bincount(rel[part] + length[part], size[part], minlength=end + 1))
        return float(np.cumsum(curve).max(initial=0.0) + size[whole].sum())

    # every cut when that is cheap, else evenly spaced ones; the boundary always
    stride = max(1, -(-end * (len(arcs) + end) // CUT_WORK))
    bounds = {c: bound(c) for c in range(0, end, stride)}
    cut = min(bounds, key=lambda c: (bounds[c], c))
    whole, rel = holds(cut)
    lo = np.where(whole, 0, rel).tolist()
    hi = np.where(whole, end, rel + length).tolist()
    counts: dict[int, int] = {}
    for t, _, _ in arcs:
        counts[t] = counts.get(t, 0) + 1
    seen: dict[int, int] = {}
    buffers = []
    for (t, _, _), b_lo, b_hi in zip(arcs, lo, hi):
        k = seen.get(t, 0)
        seen[t] = k + 1
        buffers.append(Buffer(str(t) if counts[t] == 1 else f"{t}.{k}", b_lo, b_hi, int(sizes[t])))
    problem = Problem(tuple(buffers), alignment=alignment, name=name)
    return problem, len({arcs[i][0] for i in np.flatnonzero(whole).tolist()})


@dataclass
class _Round:
    """One simulation at one budget and the layout of what it held."""

    budget: float
    result: SimResult
    live: int = 0
    arena: int = 0
    bound: int = 0
    buffers: int = 0
    spanning: int = 0
    optimal: bool = False
    error: str | None = None


def simulate_pooled(
    trace: Trace,
    hardware: Hardware,
    plan: Plan,
    pool: str = "best",
    *,
    time_limit: float = 10.0,
    node_limit: int | None = None,
    seed: int = 0,
    alignment: int = 1,
    max_rounds: int = MAX_ROUNDS,
    replan: Callable[[float], Plan] | None = None,
    iterations: int = 2,
    progress: ProgressFn | None = None,
    check_plan: bool = True,
) -> SimResult:
    """Simulate ``plan`` with the device tier as one arena laid out by the pool planner.

    The semantics are in this module's docstring: record the steady-state iteration's
    device blocks, lay them out, and if the arena exceeds the budget ``B`` simulate again
    at lower budgets. The search steps down from ``B`` by the overflow (doubling the
    step while the arena still does not fit), then bisects between the highest budget
    whose arena fits and the lowest above it whose arena does not, to within
    :data:`TOLERANCE` of ``B``. The arena is not monotone in the budget (a lower budget
    changes what is held when), so this finds a good fitting budget, not always the
    highest.

    Args:
        trace: the training iteration.
        hardware: the machine.
        plan: the plan; its ``budget_bytes`` is what the arena must fit (an infinite
            budget is never lowered; the arena is then only measured).
        pool: ``"greedy"``, ``"best"``, or ``"none"`` (plain :func:`simulate`, with the
            same result bit for bit).
        time_limit: seconds ``best`` may spend on each layout.
        node_limit: for ``best``, a node budget per layout (deterministic with it).
        seed: for ``best``, the seed of its randomised restarts.
        alignment: offsets are multiples of it (bytes).
        max_rounds: simulations at most, the first included.
        replan: makes a plan for a lower budget (bytes); without it the same plan is
            simulated with its budget lowered.
        iterations: iterations simulated; the last is reported.
        progress: passed to the first round's simulation.
        check_plan: validate the plan first.

    Returns:
        The :class:`SimResult` of the highest budget found whose arena fits, with
        ``pool`` set (:class:`PoolAccount`). If none fits within ``max_rounds`` (or a
        lower budget cannot be planned or run), the last round's result with ``fits``
        false, ``time_s`` infinite and ``error`` saying why.

    Raises:
        PoolError: an unknown ``pool`` or a bad ``max_rounds``.
        SimulationError: the plan recomputes or host-steps (not modelled in a pool yet).
        PlanError: the plan is inconsistent with the trace (``check_plan``).
        PoolAccountingError: the recorder lost track of an allocation (a bug).
    """
    from ..pool import PoolError, check, solve

    if pool == "none":
        return simulate(trace, hardware, plan, iterations=iterations, progress=progress, check_plan=check_plan)
    if plan.recomputes or plan.host_steps:
        # the recorder attributes each device allocation to one tensor; a chain's
        # temporaries and a host step's copies are not tensor allocations it knows
        raise SimulationError(
            f"plan {plan.policy}: a planned pool ({pool}) does not model recompute or host steps yet; "
            f"simulate it with pool 'none'"
        )
    if pool not in POOL_CHOICES:
        raise PoolError(f"unknown pool {pool!r}; expected one of {', '.join(POOL_CHOICES)}")
    if max_rounds < 1:
        raise PoolError(f"max_rounds must be at least 1, got {max_rounds}")
    capacity = plan.budget_bytes
    limit = capacity if math.isfinite(capacity) else hardware.device_capacity
    solve_s = 0.0
    # where persistent tensors start; the same plan at a lower budget keeps the plan's
    # (its residency was checked against its own budget: validating it again would fail)
    start0 = validate(plan, trace, hardware).start_tier if check_plan else {}

    def run(budget: float, first: bool) -> _Round:
        nonlocal solve_s
        cur, start = plan, start0
        if not first:
            try:
                if replan is None:
                    cur = dataclasses.replace(plan, budget_bytes=budget)
                else:
                    cur = replan(budget)
                    start = validate(cur, trace, hardware).start_tier if check_plan else {}
            except TierflowError as e:  # no plan for the lower budget (below the working set)
                failed = SimResult.unplanned(plan.policy, trace, hardware, str(e))
                return _Round(budget, failed, error=f"no plan for the budget lowered to {budget:.0f} bytes: {e}")
        sim = _Recorder(trace, hardware, cur, start)
        try:
            sim.run(iterations, progress if first else None)
        except SimulationError as e:
            return _Round(budget, sim.failed(str(e)), error=f"with the budget lowered to {budget:.0f} bytes: {e}")
        res = sim.result()
        problem, spanning = sim.problem(alignment)
        sol = solve(problem, pool, time_limit=time_limit, seed=seed, node_limit=node_limit)
        check(problem, sol.offsets, sol.peak)  # the independent validator, on every layout
        solve_s += sol.seconds
        return _Round(budget, res, res.peak_bytes[hardware.device], sol.peak, sol.lower_bound, len(problem),
                      spanning, sol.optimal)

    rounds = [run(capacity, True)]
    if rounds[0].error is not None:  # the plan cannot run even with byte counting
        return _finish(rounds[0], rounds, pool, plan, limit, replan, solve_s, rounds[0].error)
    fit: _Round | None = rounds[0] if rounds[0].arena <= limit else None
    if not math.isfinite(capacity):  # an unlimited budget is not lowered: the arena is only measured
        return _finish(rounds[0], rounds, pool, plan, limit, replan, solve_s, None)
    high = rounds[0]  # the lowest budget so far whose arena does not fit, above any that fits
    # no budget below the largest set of tensors one op needs can run; a budget that
    # could not be planned or run raises this floor
    working_set = int(trace.working_set_bytes.max()) if trace.n_ops else 0
    floor = working_set
    gap = TOLERANCE * capacity
    step = 0.0
    while len(rounds) < max_rounds:
        last = rounds[-1]
        if fit is not None:  # bisect between the highest fit and the lowest miss above it
            if fit is rounds[0] or high.budget - fit.budget <= gap:
                break
            budget = math.floor((fit.budget + high.budget) / 2)
        elif last.error is not None:  # that budget cannot run: search between it and the miss
            floor = max(floor, math.floor(last.budget) + 1)
            if high.budget - floor <= gap:
                break
            budget = math.floor((floor + high.budget) / 2)
        else:  # step down by the overflow, doubling while the arena still does not fit
            if last.budget <= floor:
                break  # already at the floor: nothing lower can run
            step = max(float(last.arena - limit), 2 * step)
            budget = max(floor, math.floor(last.budget - step))
        r = run(budget, False)
        rounds.append(r)
        if r.error is None and r.arena <= limit:
            fit = r if fit is None or r.budget > fit.budget else fit
        elif r.error is None or fit is not None:
            high = r  # a miss, or a failure above the fit (the arena is not monotone)
    if fit is None:
        tried = [r for r in rounds if r.error is None]
        low = min(tried, key=lambda r: r.budget)
        lowest = f"{low.budget:.0f} bytes" + (" (the minimum working set)" if low.budget <= working_set else "")
        error = (f"the {pool} arena needs {low.arena} bytes, over the budget of {limit:.0f}, at every budget "
                 f"tried ({len(rounds)} rounds, down to {lowest})")
        failed = [r for r in rounds if r.error is not None]
        if failed:
            error += f"; {failed[-1].error}"
        return _finish(low, rounds, pool, plan, limit, replan, solve_s, error)
    return _finish(fit, rounds, pool, plan, limit, replan, solve_s, None)


def _finish(chosen: _Round, rounds: list[_Round], pool: str, plan: Plan, limit: float,
            replan: Callable[[float], Plan] | None, solve_s: float, error: str | None) -> SimResult:
    """The chosen round's result with the pool's account attached."""
    res = chosen.result
    res.pool = PoolAccount(
        solver=pool, live_peak_bytes=chosen.live, lower_bound_bytes=chosen.bound, arena_peak_bytes=chosen.arena,
        budget_bytes=plan.budget_bytes, effective_budget_bytes=chosen.budget, rounds=len(rounds),
        buffers=chosen.buffers, spanning=chosen.spanning, fits=error is None and chosen.arena <= limit,
        shrink="replan" if replan else "same plan", optimal=chosen.optimal, solve_s=solve_s,
        history=[{"budget_bytes": r.budget, "live_peak_bytes": r.live, "lower_bound_bytes": r.bound,
                  "arena_peak_bytes": r.arena, "time_s": r.result.time_s, "error": r.error} for r in rounds],
    )
    res.budget_bytes = plan.budget_bytes
    if error is not None:
        res.error, res.time_s, res.fits = error, math.inf, False
    else:
        res.fits = res.fits and chosen.arena <= limit
    return res


__all__ = ["MAX_ROUNDS", "POOL_CHOICES", "TOLERANCE", "PoolAccountingError", "periodic_problem", "simulate_pooled"]
