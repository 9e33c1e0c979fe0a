"""``deeptm``: DeepTM (Zhou, Rang, Chen, Zhou, Cheng; IEEE TPDS 35(11), 2024), tensor
management for a fast-small + slow-large memory hierarchy (DRAM + persistent memory in
the paper; GPU memory + host/SSD here, DRAM + PMem on ``cpu-dram-pmem``).

Its parts, as built here:

1. **Page-level aggregation.** Tensors smaller than a page (``page_bytes``, 2 MiB by
   default) whose idle gaps open and close at the same ops are packed into pages
   (first fit, largest first); a page moves as one unit, and so does a large tensor
   (contiguous migration: all its bytes in one transfer). Small tensors alone would pay
   a latency per transfer and, on PM, read-modify-write of partial pages.
2. **Tensor heat** from four characteristics of a unit's gap, each scaled to [0, 1]
   over the candidates: size (small is hot), access frequency (uses per iteration;
   frequent is hot), gap length (short is hot) and recency (time since the access
   before the gap opened; recent is hot). ``heat = w . features`` with weights ``w``
   on the simplex.
3. **Placement as an integer linear program**: one binary per (unit, slow tier); each
   unit goes to at most one tier; at every op the units off the device must cover the
   bytes above the budget, and no slow tier may overflow; the cost of a unit is its
   round-trip transfer time (the route's latency and bandwidth), weighted up by its
   heat, plus the part of it its gap cannot hide. It is solved by HiGHS
   (``scipy.optimize.milp``), with the over-budget ops added as rows in rounds
   (cutting planes) until the whole memory curve holds. For speed the MIP runs over
   the binaries its LP relaxation leaves fractional; the answer is then improved by a
   bounded local search (drop a fractional or expensive unit, cover again greedily,
   drop what became redundant) and ties between equally costly tiers go to the
   fastest tier with room, so that a machine with more room or faster links does not
   get a dearer placement by accident of the LP's rounding. Then each prefetch is
   issued as early as the budget allows; moves issued at one op go smallest eviction
   first and prefetches in the order they are needed.
4. **Weights learned by reinforcement learning against the simulator**: a seeded
   Gaussian policy over the weights' logits (REINFORCE with a running baseline); an
   episode = build the plan with sampled weights, simulate it, reward = ideal / step
   time. Episode 0 uses equal weights, and the best plan seen is returned, so learning
   never makes the plan worse than the untuned one.

Options:
    page_bytes (int): aggregation page (default 2 MiB). Larger pages mean fewer,
        bigger transfers but move bytes that did not need to move.
    tiers (str): comma-separated slow tiers (default: every offload tier).
    episodes (int): RL episodes (default 4; 1 = no learning). Each costs one ILP and
        one simulation.
    time_budget_s (float): do not start an episode that would end after this many
        seconds of planning, judged by the mean episode so far (default 4 s). It only
        cuts episodes short; when it does, ``meta["rl_cut"]`` says so, and the
        plan may then depend on the machine's speed.
    node_limit (int): branch-and-bound nodes per ILP solve (default 500; a node limit
        rather than a time limit keeps plans a function of the inputs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import PlanError
from ..hardware import Hardware
from ..plan import Plan
from ..trace import Gap, Trace
from . import PolicyOption, PolicyOptions, register
from ._common import Planner, gap_end, gap_ops, issue_order, no_fit

if TYPE_CHECKING:
    from scipy import sparse

N_FEATURES = 4  # size, frequency, gap length, recency

OPTIONS = (
    PolicyOption("page_bytes", int, 2 * 2**20, "aggregation page for small tensors (accepts 4MiB)"),
    PolicyOption("tiers", str, None, "comma-separated slow tiers (default: every offload tier)"),
    PolicyOption("episodes", int, 4, "RL episodes, each one ILP and one simulation (1 = no learning)"),
    PolicyOption("time_budget_s", float, 4.0, "start no episode that would end after this many seconds"),
    PolicyOption("node_limit", int, 500, "branch-and-bound nodes per ILP solve"),
)


@contextlib.contextmanager
def _native_stdout_silenced() -> Iterator[None]:
    """Send what native code writes to file descriptor 1 to the null device meanwhile.

    The HiGHS that scipy bundles prints a debugging line
    (``HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();``) to
    the process's stdout on some MIPs, whatever its output options say (an upstream
    bug, ERGO-Code/HiGHS#2783), which would land in the middle of a user's table or
    JSON. Python's own ``sys.stdout`` is flushed first, so nothing of ours is lost. If
    the descriptor cannot be redirected (no fd 1), the block runs as it is."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


@dataclass(frozen=True)
class Unit:
    """Tensors that share one gap and move together (a page, or one large tensor)."""

    gaps: tuple[Gap, ...]
    after_op: int
    end: int  # closing use, unwrapped
    nbytes: int
    features: tuple[float, float, float, float]  # hot-is-high, each in [0, 1]


def build_units(trace: Trace, budget: float, page_bytes: int) -> list[Unit]:
    """Candidate gaps that cover an op over the budget, aggregated into pages."""
    n = trace.n_ops
    live = trace.live_bytes
    over = live > budget
    if not over.any():
        return []
    over2 = np.concatenate([over, over])
    pre = np.concatenate([[0], np.cumsum(over2)])
    sizes = trace.sizes
    groups: dict[tuple[int, int], list[Gap]] = {}
    for g in trace.gaps:
        end = gap_end(g, n)
        if gap_ops(g, n) < 1 or pre[end] - pre[g.after_op + 1] == 0 or sizes[g.tensor] == 0:
            continue
        groups.setdefault((g.after_op, end), []).append(g)
    raw: list[tuple[tuple[Gap, ...], int, int]] = []
    for (a, end), gs in sorted(groups.items()):
        small = sorted((g for g in gs if sizes[g.tensor] < page_bytes), key=lambda g: (-sizes[g.tensor], g.tensor))
        for g in gs:
            if sizes[g.tensor] >= page_bytes:
                raw.append(((g,), a, end))
        pages: list[list[Gap]] = []
        fill: list[int] = []
        for g in small:  # first fit, largest first
            s = int(sizes[g.tensor])
            for k in range(len(pages)):
                if fill[k] + s <= page_bytes:
                    pages[k].append(g)
                    fill[k] += s
                    break
            else:
                pages.append([g])
                fill.append(s)
        raw += [(tuple(pg), a, end) for pg in pages]
    # features
    start2 = np.concatenate([trace.op_start_s[:-1], trace.op_start_s[:-1] + trace.ideal_s, [2 * trace.ideal_s]])
    uses_per_tensor = np.bincount(
        np.fromiter((t for ts in trace.op_tensors for t in ts), dtype=np.int64), minlength=trace.n_tensors
    )
    nbytes = np.array([sum(int(sizes[g.tensor]) for g in gs) for gs, _, _ in raw], dtype=np.float64)
    freq = np.array([np.mean([uses_per_tensor[g.tensor] for g in gs]) for gs, _, _ in raw], dtype=np.float64)
    length = np.array([gs[0].length_s for gs, _, _ in raw], dtype=np.float64)
    rec = np.empty(len(raw))
    for i, (gs, a, _) in enumerate(raw):
        u = trace.uses(gs[0].tensor)
        k = int(np.searchsorted(u, a))
        prev = int(u[k - 1]) if k > 0 else a
        rec[i] = start2[a] - start2[prev]

    def scale(x: np.ndarray) -> np.ndarray:
        lo, hi = (float(x.min()), float(x.max())) if x.size else (0.0, 0.0)
        return (x - lo) / (hi - lo) if hi > lo else np.zeros_like(x)

    feats = np.stack(
        [1 - scale(np.log1p(nbytes)), scale(freq), 1 - scale(length), 1 - scale(rec)], axis=1
    ) if raw else np.zeros((0, N_FEATURES))
    return [Unit(gs, a, end, int(nbytes[i]), tuple(float(f) for f in feats[i])) for i, (gs, a, end) in enumerate(raw)]


class _Ilp:
    """The placement ILP of one (trace, hardware, budget), re-solved per weight vector."""

    def __init__(
        self, trace: Trace, hw: Hardware, budget: float, units: list[Unit], tiers: tuple[str, ...], node_limit: int,
        repair_tries: int = 16,
    ):
        self.trace, self.hw, self.budget, self.units, self.tiers = trace, hw, budget, units, tiers
        self.node_limit = node_limit
        self.repair_tries = repair_tries
        n, U = trace.n_ops, len(units)
        self.n = n
        a = np.array([u.after_op for u in units], dtype=np.int64)
        end = np.array([u.end for u in units], dtype=np.int64)
        lens = end - a - 1
        # Each unit's gap covers one circular run of ops: [start, start + span) on the
        # trace laid twice end to end. The op x unit cover matrix this describes is not
        # built: on long traces it has tens of millions of entries, and every question
        # asked of it (a unit's ops, the units over some ops, a few of its rows for the
        # LP) is answered from the runs directly (_ops, _units_over, _cover_rows).
        self.start = (a + 1) % n
        self.span = np.minimum(lens, n)
        self._laps, self._rest = lens // n, lens % n  # whole iterations a gap spans, and the rest
        self._bounds = list(zip(self.start.tolist(), (self.start + self.span).tolist()))  # for _ops, as ints
        self.size = np.array([u.nbytes for u in units], dtype=np.float64)
        self.deficit = trace.live_bytes.astype(np.float64) - budget
        self.caps = np.array([hw.tier(t).capacity for t in tiers], dtype=np.float64)
        gap_s = np.array([u.gaps[0].length_s for u in units])
        # round trip per unit and tier: route latency + bytes / bandwidth, both ways
        rt = np.empty((U, len(tiers)))
        for k, t in enumerate(tiers):
            bw_out, bw_in = hw.route_bandwidth(hw.device, t), hw.route_bandwidth(t, hw.device)
            lat = hw.route_latency(hw.device, t) + hw.route_latency(t, hw.device)
            rt[:, k] = lat + self.size / bw_out + self.size / bw_in
        self.rt = rt
        self.exposed = np.maximum(rt - gap_s[:, None], 0.0)

    def covered(self, x: np.ndarray) -> np.ndarray:
        """The op x unit cover matrix times ``x``: per op, the sum of ``x`` over the
        units whose gap covers it. Each gap is one circular run of ops, so a
        difference array and a prefix sum give it in O(ops + units) rather than
        O(every (op, unit) pair). ``x`` holds whole bytes, so every partial sum is an
        exact float and the result is the matrix product's, bit for bit."""
        n = self.n
        d = np.bincount(self.start, weights=x, minlength=2 * n + 1)
        d -= np.bincount(self.start + self._rest, weights=x, minlength=2 * n + 1)
        run = np.cumsum(d[: 2 * n])
        return run[:n] + run[n:] + float(x @ self._laps)

    def _ops(self, u: int) -> slice | np.ndarray:
        """The ops unit ``u``'s gap covers, as an index into a per-op array: a slice
        (a view, no copy) unless the run wraps past the last op. Every use adds to or
        compares these ops elementwise, so their order does not matter."""
        s, e = self._bounds[u]
        if e <= self.n:
            return slice(s, e)
        return np.concatenate([np.arange(s, self.n), np.arange(e - self.n)])

    def _units_over(self, ops: np.ndarray) -> np.ndarray:
        """The units (ascending) whose gap covers at least one of ``ops``: a prefix
        count of the marked ops over the trace laid twice answers every run at once."""
        mark = np.zeros(2 * self.n, dtype=np.int64)
        mark[ops] = 1
        mark[ops + self.n] = 1
        pre = np.concatenate([[0], np.cumsum(mark)])
        return np.flatnonzero(pre[self.start + self.span] > pre[self.start])

    def _cover_rows(self, ops: np.ndarray) -> sparse.csr_matrix:
        """Rows ``ops`` of the op x unit cover matrix (how many times each unit's gap
        covers the op: its whole laps of the trace, plus one if the op is in the rest
        of its run), with the same entries in the same order (units ascending in each
        row) as slicing the full matrix, so the LP built from it is the same."""
        from scipy import sparse

        count = self._laps[None, :] + ((ops[:, None] - self.start[None, :]) % self.n < self._rest[None, :])
        r, u = np.nonzero(count)  # row-major: units ascending within each row
        indptr = np.concatenate([[0], np.cumsum(np.bincount(r, minlength=ops.size))])
        return sparse.csr_matrix(
            (count[r, u].astype(np.float64), u, indptr), shape=(ops.size, len(self.units))
        )

    def solve(self, weights: np.ndarray) -> tuple[np.ndarray, str]:
        """(tier index per unit or -1; all -2 when infeasible, and how it was solved).

        Each round solves the LP relaxation over the current rows, fixes the variables
        it leaves integral, and solves the remaining binaries exactly as a MIP (HiGHS);
        the covering structure leaves only a handful fractional, so this is close to the
        ILP's optimum at a fraction of a full branch-and-cut's time. Rows where the whole
        curve is still violated are added and the round repeats. Fixing at 0 what the
        LP leaves at 0 can miss a cheap integral answer (the LP covers a small deficit
        with a fraction of a large unit; the MIP must then take all of it), so the answer
        is improved by :meth:`_drop_and_repair` on the units the LP left fractional."""
        from scipy import sparse
        from scipy.optimize import Bounds, LinearConstraint, milp

        U, K = len(self.units), len(self.tiers)
        feats = np.array([u.features for u in self.units]).reshape(U, N_FEATURES)
        heat = feats @ weights
        # seconds: moving a hot unit costs more than its transfers, an exposed one more still
        cost = self.rt * (1.0 + heat[:, None]) + 4.0 * self.exposed
        c = np.concatenate([cost[:, k] for k in range(K)])  # x laid out tier-major
        over = np.flatnonzero(self.deficit > 0)
        rows = set(over[np.linspace(0, over.size - 1, min(over.size, 96)).astype(int)].tolist())
        rows.add(int(np.argmax(self.deficit)))
        one = LinearConstraint(sparse.hstack([sparse.identity(U)] * K).tocsr(), lb=0, ub=1)
        free_total = 0
        lo = hi = np.zeros(U * K)
        for _ in range(12):
            r = np.array(sorted(rows))
            Cs = self._cover_rows(r).multiply(self.size[None, :]).tocsr()
            cons = [LinearConstraint(sparse.hstack([Cs] * K).tocsr(), lb=self.deficit[r], ub=np.inf), one]
            for k in range(K):
                if math.isfinite(self.caps[k]):
                    blocks = [Cs if j == k else sparse.csr_matrix((len(r), U)) for j in range(K)]
                    cons.append(LinearConstraint(sparse.hstack(blocks).tocsr(), lb=-np.inf, ub=self.caps[k]))
            lp = milp(c, constraints=cons, integrality=np.zeros(U * K), bounds=Bounds(0, 1))
            if lp.x is None:
                return np.full(U, -2), "infeasible"
            lo = (lp.x > 1 - 1e-6).astype(float)
            hi = (lp.x > 1e-6).astype(float)
            free_total += int((hi - lo).sum())
            with _native_stdout_silenced():
                res = milp(
                    c, constraints=cons, integrality=np.ones(U * K), bounds=Bounds(lo, hi),
                    options={"node_limit": self.node_limit, "mip_rel_gap": 1e-4},
                )
                if res.x is None:  # fixing cut off every integer point: solve it whole
                    res = milp(
                        c, constraints=cons, integrality=np.ones(U * K), bounds=Bounds(0, 1),
                        options={"node_limit": self.node_limit, "mip_rel_gap": 1e-2},
                    )
            if res.x is None:
                return self._greedy(cost), "greedy (the ILP found no solution within its node limit)"
            x = np.round(res.x).reshape(K, U).T
            choice = np.where(x.max(axis=1) > 0.5, x.argmax(axis=1), -1)
            bad = self._violations(choice)
            if not bad.size:
                fractional = np.flatnonzero((hi - lo).reshape(K, U).max(axis=0) > 0.5)
                choice, swaps = self._drop_and_repair(choice, cost, fractional)
                choice = self._ties_to_first_tier(self._prune(choice, cost), cost)
                return choice, (
                    f"highs: LP relaxation, then MIP over its {free_total} fractional binaries"
                    + (f"; {swaps} unit(s) replaced by cheaper ones" if swaps else "")
                )
            rows.update(bad.tolist())
        return self._greedy(cost), "greedy (cutting planes did not converge)"

    def _ties_to_first_tier(self, choice: np.ndarray, cost: np.ndarray) -> np.ndarray:
        """``choice`` with every unit whose cost is the same on an earlier tier of
        ``tiers`` (fastest round trip first) moved there while that tier has room over
        the unit's gap, units in order. The ILP is indifferent between equal costs (and
        the solver's answer among them is arbitrary): this settles such ties the same
        way whatever the tiers' capacities, so more room only moves units to a tier
        that is no slower."""
        K = len(self.tiers)
        if K < 2:
            return choice
        occ = np.stack([self.covered((choice == k) * self.size) for k in range(K)])
        for u in np.flatnonzero(choice > 0).tolist():
            k0 = int(choice[u])
            col = self._ops(u)
            for k in range(k0):
                if cost[u, k] <= cost[u, k0] and (occ[k, col] + self.size[u] <= self.caps[k]).all():
                    occ[k0, col] -= self.size[u]
                    occ[k, col] += self.size[u]
                    choice[u] = k
                    break
        return choice

    def _drop_and_repair(self, choice: np.ndarray, cost: np.ndarray, units: np.ndarray) -> tuple[np.ndarray, int]:
        """(improved choice, how many units were replaced): for each unit in ``units``
        that ``choice`` takes, then for the ``repair_tries`` most expensive units it
        takes, drop it and cover what it covered with the units left on the device,
        cheapest per byte of deficit they relieve first, and drop what that made
        redundant; keep the result if it costs less. The choice stays feasible on every
        row. (A bound on tries, like the node limit, keeps the work a function of the
        inputs.)"""
        total = self._cost_of(choice, cost)
        swaps = 0
        taken = np.flatnonzero(choice >= 0)
        priciest = taken[np.lexsort((taken, -cost[taken, choice[taken]]))][: self.repair_tries]
        tries = list(dict.fromkeys(units.tolist() + priciest.tolist()))
        for f in tries:
            if choice[f] < 0:
                continue
            trial = choice.copy()
            trial[f] = -1
            trial = self._cover_rest(trial, cost, exclude=f)
            if trial is not None:
                trial = self._prune(trial, cost)
                c = self._cost_of(trial, cost)
                if c < total * (1 - 1e-12):
                    choice, total, swaps = trial, c, swaps + 1
        return choice, swaps

    def _prune(self, choice: np.ndarray, cost: np.ndarray) -> np.ndarray:
        """``choice`` without the units it does not need: most expensive first, a unit
        goes back to the device if every op stays covered without it (a greedy cover
        can take a unit that later ones make redundant)."""
        on = (choice >= 0) * self.size
        # bytes each op over the budget is covered beyond its deficit, and +inf at the
        # ops within it (any unit may leave those; inf stays inf): then one min over a
        # unit's ops decides it (rounding is monotone, so min(slack) - size is the
        # least of slack - size over those ops)
        slack = np.where(self.deficit > 0, self.covered(on) - self.deficit, np.inf)
        taken = np.flatnonzero(choice >= 0)
        for u in taken[np.lexsort((taken, -cost[taken, choice[taken]]))].tolist():
            col = self._ops(u)
            if slack[col].min(initial=np.inf) - self.size[u] >= -0.5:
                choice[u] = -1
                slack[col] -= self.size[u]
        return choice

    @staticmethod
    def _cost_of(choice: np.ndarray, cost: np.ndarray) -> float:
        taken = np.flatnonzero(choice >= 0)
        return float(cost[taken, choice[taken]].sum())

    def _cover_rest(self, choice: np.ndarray, cost: np.ndarray, exclude: int) -> np.ndarray | None:
        """``choice`` completed (greedily) until every op's deficit is covered, or None
        if the units left cannot cover it within the tiers' capacities. Each step takes
        the unit and tier with the least cost per useful byte (its bytes, capped by the
        largest deficit left among the ops it covers)."""
        K = len(self.tiers)
        left = self.deficit - self.covered((choice >= 0) * self.size)
        short = np.flatnonzero(left > 0.5)
        if not short.size:
            return choice
        # only units over an op that is short can help, and the short ops only shrink
        cand = self._units_over(short)
        cand = cand[(choice[cand] < 0) & (cand != exclude)]
        if not cand.size:
            return None
        # Max of a per-op array over each candidate's ops (-inf for one with none). A
        # range-maximum table answers every candidate's run at once: O(n log n) per
        # call instead of touching every (candidate, op) pair, which on a 9,000-op
        # trace with long gaps is millions of reads per greedy step.
        per_cand_max = _RangeMax(self.start[cand], self.span[cand])

        occ = np.stack([self.covered((choice == k) * self.size) for k in range(K)])
        size, free = self.size[cand], np.ones(cand.size, dtype=bool)
        while (left[short] > 0.5).any():
            need = per_cand_max(left)  # the largest deficit left among its ops
            ok = free & (need > 0.5)
            if not ok.any():
                return None
            ratio = np.full((cand.size, K), np.inf)
            useful = np.minimum(size, need)
            for k in range(K):
                fits = ok.copy()
                if math.isfinite(self.caps[k]):
                    fits &= per_cand_max(occ[k]) + size <= self.caps[k]
                ratio[fits, k] = cost[cand[fits], k] / useful[fits]
            i, k = divmod(int(np.argmin(ratio)), K)  # ties: lowest unit, then lowest tier
            if not math.isfinite(ratio[i, k]):
                return None
            u = int(cand[i])
            col = self._ops(u)
            choice[u], free[i] = k, False
            left[col] -= self.size[u]
            occ[k, col] += self.size[u]
        return choice

    def _violations(self, choice: np.ndarray) -> np.ndarray:
        on = (choice >= 0) * self.size
        over = self.deficit - self.covered(on) > 0.5
        for k in range(len(self.tiers)):
            occ = self.covered((choice == k) * self.size)
            over |= occ > self.caps[k]
        bad = np.flatnonzero(over)
        if bad.size > 64:  # add the worst ones and a spread of the rest
            bad = bad[np.linspace(0, bad.size - 1, 64).astype(int)]
        return bad

    def _greedy(self, cost: np.ndarray) -> np.ndarray:
        """Cheapest bytes first until the curve holds (a fallback, said in meta)."""
        U = len(self.units)
        choice = np.full(U, -1)
        best_k = cost.argmin(axis=1)
        order = np.lexsort((np.arange(U), cost[np.arange(U), best_k] / np.maximum(self.size, 1)))
        left = self.deficit.copy()
        occ = np.zeros((len(self.tiers), self.n))
        for u in order.tolist():
            if (left <= 0).all():
                break
            col = self._ops(u)
            if not (left[col] > 0).any():
                continue
            for k in np.argsort(cost[u], kind="stable").tolist():
                if (occ[k, col] + self.size[u] <= self.caps[k]).all():
                    choice[u] = k
                    occ[k, col] += self.size[u]
                    left[col] -= self.size[u]
                    break
        return choice


class _RangeMax:
    """``max(values[(start[i] + j) % n] for j in range(span[i]))`` for every i, -inf
    where ``span[i]`` is 0 (``span <= n``), for fixed runs and any ``values``. A sparse
    table over ``values`` laid twice end to end (so a run that wraps past the last op
    is one range): level ``j`` holds the maxima of windows of ``2**j``; a run of length
    L is the max of the two windows of the largest ``2**j <= L`` at its two ends.
    Maxima are exact, so this gives the same floats as reducing over each run's ops.
    The runs' levels and window ends are worked out once here: the greedy cover asks
    about the same runs at every step, with new values."""

    def __init__(self, start: np.ndarray, span: np.ndarray):
        self.size = start.size
        live = np.flatnonzero(span > 0)
        s, L = start[live], span[live]
        level = np.floor(np.log2(L)).astype(np.int64)
        self.top = int(level.max()) if live.size else -1
        # per level: (which runs, the windows' first ends, their second ends)
        self.levels: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []
        for j in np.unique(level).tolist():
            pick = level == j
            lo = s[pick]
            self.levels.append((j, live[pick], lo, lo + L[pick] - (1 << j)))

    def __call__(self, values: np.ndarray) -> np.ndarray:
        out = np.full(self.size, -np.inf)
        if self.top < 0:
            return out
        table = [np.concatenate([values, values])]
        for j in range(1, self.top + 1):
            prev, w = table[-1], 1 << (j - 1)
            table.append(np.maximum(prev[:-w], prev[w:]))
        for j, runs, lo, hi in self.levels:
            t = table[j]
            out[runs] = np.maximum(t[lo], t[hi])
        return out


def _range_max(values: np.ndarray, start: np.ndarray, span: np.ndarray) -> np.ndarray:
    """:class:`_RangeMax` for one set of values."""
    return _RangeMax(start, span)(values)


def _plan_from(trace: Trace, hw: Hardware, budget: float, units: list[Unit], tiers: tuple[str, ...], choice: np.ndarray, meta: dict) -> Plan:
    p = Planner(trace, hw, budget)
    for u, k in zip(units, choice.tolist()):
        if k >= 0:
            for g in u.gaps:  # a page's tensors leave together and come back together
                p.take(g, tiers[k])
    if not p.fits():
        raise p.no_fit("deeptm", f"with {len(p.offloads)} tensors placed by the ILP")
    p.place_prefetches()
    plan = p.plan("deeptm", meta)
    # at each op: evictions smallest first, prefetches in the order they are needed
    return dataclasses.replace(plan, moves=issue_order(plan.moves, trace))


@register("deeptm", OPTIONS)
def deeptm(trace: Trace, hardware: Hardware, options: PolicyOptions) -> Plan:
    """DeepTM's plan (see the module docstring).

    Args:
        trace: the iteration.
        hardware: the machine; its offload tiers are DeepTM's slow memory.
        options: ``episodes`` and ``time_budget_s`` bound the learning (each episode is
            an ILP solve and a simulation); ``page_bytes`` sets the aggregation;
            ``tiers`` restricts the slow tiers; ``node_limit`` bounds each solve.

    Raises:
        PlanError: no placement meets the budget (the slow tiers cannot hold enough, or
            the bytes live at some op exceed the budget in ways no gap can relieve).

    Example:
        >>> make_plan("deeptm", trace, load_hardware("cpu-dram-pmem"), budget="64GiB", episodes=6)  # doctest: +SKIP
    """
    from ..simulate import simulate

    t0 = time.perf_counter()
    budget = float(options.budget_bytes)
    page = int(options.get("page_bytes", 2 * 2**20))
    tiers_opt = options.get("tiers", None)
    tiers = tuple(str(tiers_opt).split(",")) if tiers_opt else hardware.offload_tiers
    for t in tiers:
        hardware.tier(t)
    episodes = max(1, int(options.get("episodes", 4)))
    time_budget = float(options.get("time_budget_s", 4.0))
    node_limit = int(options.get("node_limit", 500))

    units = build_units(trace, budget, page)
    if not units:
        if trace.peak_live_bytes > budget:
            raise no_fit("deeptm", trace, hardware, budget, "no inactive gap covers the ops over the budget", trace.live_bytes)
        return Plan("deeptm", (), budget_bytes=budget, meta={"units": 0, "episodes": 0})
    ilp = _Ilp(trace, hardware, budget, units, tiers, node_limit)
    rng = np.random.default_rng(options.seed)
    theta = np.zeros(N_FEATURES)  # logits of the weights; softmax(0) = equal weights
    sigma, lr = 0.5, 2.0
    baseline = None
    best: tuple[float, int, Plan] | None = None
    history = []
    cut = False
    last_err: PlanError | None = None
    for ep in range(episodes):
        spent = time.perf_counter() - t0
        if ep and spent + spent / ep > time_budget:  # the next episode would overrun
            cut = True
            break
        options.report(ep / episodes, f"episode {ep + 1} of {episodes}")
        eps = rng.normal(0.0, sigma, N_FEATURES) if ep else np.zeros(N_FEATURES)
        w = np.exp(theta + eps)
        w /= w.sum()
        choice, how = ilp.solve(w)
        if (choice == -2).all():
            raise no_fit("deeptm", trace, hardware, budget, f"the placement ILP over {len(units)} units and tiers {', '.join(tiers)} is infeasible", trace.live_bytes)
        meta = {"units": len(units), "tiers": list(tiers), "weights": [round(float(x), 4) for x in w], "solver": how}
        try:
            plan = _plan_from(trace, hardware, budget, units, tiers, choice, meta)
        except PlanError as e:
            last_err = e
            continue
        reward = simulate(trace, hardware, plan).ratio
        history.append(round(float(reward), 4))
        if best is None or reward > best[0]:
            best = (reward, ep, plan)
        # REINFORCE on the logits with a running-mean baseline
        if baseline is None:
            baseline = reward
        else:
            theta = theta + lr * (reward - baseline) * eps / sigma**2
            baseline = 0.7 * baseline + 0.3 * reward
    if best is None:
        assert last_err is not None
        raise last_err
    options.report(1.0, "done")
    reward, ep, plan = best
    plan.meta.update({"episodes": len(history), "rewards": history, "best_episode": ep, "rl_cut": cut})
    return plan
