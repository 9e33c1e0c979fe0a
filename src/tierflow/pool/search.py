"""Branch and bound over canonical placements (after MiniMalloc, Moffitt, ASPLOS'24).

A *canonical* solution places buffers in non-decreasing offset order, each at the
lowest offset its already-placed time neighbours allow (its *floor*). Every packing can
be pushed down into a canonical one without raising its peak, so searching canonical
placements only loses nothing; ties in offset are broken by a static preorder, which
removes the permutations of equal-offset placements.

At each node the candidates are the unplaced buffers whose floor is at least the
offset just used (in preorder past the last buffer on ties), tried lowest floor first.
Two rules prune:

* dominance: a buffer whose floor is at or above the lowest *top* any unplaced buffer
  could reach would leave a hole under it that that buffer fits in; skip it (and every
  later candidate, since they are sorted by floor);
* section inference: time is cut into sections at every lifetime boundary; in each
  section the unplaced buffers must stack above the lowest floor among them, so that
  floor plus their total size must fit the capacity. On large problems the cheaper
  variant uses the top of the placed buffers in the section instead of the floors.

The search decides one capacity at a time: a fixed capacity prunes far harder than
optimising. :func:`feasible` runs it under a node limit and a deadline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ._graph import neighbours

_INF = np.int64(2**62)

# above this many buffers the per-section floor of unplaced buffers costs more than it saves
STRONG_LIMIT = 4000
# on large problems only this many lowest candidates are kept per node
WIDE_LIMIT = 48


@dataclass
class Outcome:
    """Result of one capacity attempt: ``offsets`` (units) when one was found;
    ``exhausted`` when the whole canonical space was searched without one (a proof
    that the capacity is infeasible); ``nodes`` placements tried."""

    offsets: np.ndarray | None
    exhausted: bool
    nodes: int


class Sections:
    """Elementary time sections of a problem and each buffer's section range."""

    def __init__(self, lower: np.ndarray, upper: np.ndarray, units: np.ndarray) -> None:
        pts = np.unique(np.concatenate([lower, upper]))
        self.s0 = np.searchsorted(pts, lower)
        self.s1 = np.searchsorted(pts, upper)  # buffer covers sections [s0, s1)
        self.n_sections = max(len(pts) - 1, 0)
        delta = np.zeros(self.n_sections + 1, dtype=np.int64)
        np.add.at(delta, self.s0, units)
        np.add.at(delta, self.s1, -units)
        self.total = np.cumsum(delta[:-1])
        # per buffer, the most units live in any of its sections (MiniMalloc's "total")
        if len(lower):
            idx = np.empty(2 * len(lower), dtype=np.int64)
            idx[0::2], idx[1::2] = self.s0, self.s1
            padded = np.append(self.total, 0)
            self.buffer_total = np.maximum.reduceat(padded, idx)[0::2]
        else:
            self.buffer_total = np.zeros(0, dtype=np.int64)

    def members(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """CSR of section -> buffers, each section ending with the sentinel ``n`` (so no
        section is empty for ``reduceat``)."""
        lens = self.s1 - self.s0
        buf = np.repeat(np.arange(n), lens)
        starts = np.repeat(np.cumsum(lens) - lens, lens)
        sec = np.repeat(self.s0, lens) + (np.arange(int(lens.sum())) - starts)
        sec = np.concatenate([sec, np.arange(self.n_sections)])
        buf = np.concatenate([buf, np.full(self.n_sections, n)])
        order = np.argsort(sec, kind="stable")
        ptr = np.zeros(self.n_sections + 1, dtype=np.int64)
        np.cumsum(np.bincount(sec, minlength=self.n_sections), out=ptr[1:])
        return ptr, buf[order]


def preorders(lower: np.ndarray, upper: np.ndarray, units: np.ndarray, sec: Sections) -> dict[str, np.ndarray]:
    """Static orders for tie-breaking and branching, named by their keys (all
    descending): T total in the buffer's busiest section, W sections spanned, A area,
    S size, L lifetime."""
    n = len(lower)
    idx = np.arange(n)
    t = sec.buffer_total
    w = sec.s1 - sec.s0
    a = units * (upper - lower)
    return {
        "TWA": np.lexsort((idx, -a, -w, -t)),
        "WAT": np.lexsort((idx, -t, -a, -w)),
        "TAW": np.lexsort((idx, -w, -a, -t)),
        "A": np.lexsort((idx, -units, -a)),
        "S": np.lexsort((idx, lower, -units)),
        "LS": np.lexsort((idx, -units, -(upper - lower))),
    }


class _Abort(Exception):
    """The node limit or the deadline ran out."""


def feasible(
    lower: np.ndarray,
    upper: np.ndarray,
    units: np.ndarray,
    capacity: int,
    order: np.ndarray,
    sec: Sections,
    members: tuple[np.ndarray, np.ndarray] | None,
    deadline: float,
    node_limit: int,
) -> Outcome:
    """Search for a canonical placement with every top at most ``capacity`` (units).

    Whenever the unplaced buffers fall apart into groups with disjoint lifetimes (the
    placed ones already fix everything between them), each group is solved on its own:
    a group that fails fails the node, without retrying the other groups' choices. This
    dynamic decomposition is what keeps the search from thrashing.

    Args:
        lower, upper, units: the buffers (sizes in alignment units).
        capacity: the capacity to decide.
        order: static preorder (buffer indices, first = preferred).
        sec: the problem's sections.
        members: :meth:`Sections.members` for the strong section inference, or ``None``
            for the cheap one.
        deadline: ``time.perf_counter()`` value at which to give up.
        node_limit: placements to try before giving up.
    """
    n = len(lower)
    if n == 0:
        return Outcome(np.zeros(0, dtype=np.int64), False, 0)
    if int(units.min()) <= 0:
        raise ValueError("feasible() needs positive sizes; place empty buffers at 0 beforehand")
    if int(sec.total.max(initial=0)) > capacity or int(units.max()) > capacity:
        return Outcome(None, True, 0)
    s = _Search(lower, upper, units, capacity, order, sec, members, deadline, node_limit)
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * n + 1000))
    try:
        ok = s.solve(np.arange(n), -1, -1)
    except _Abort:
        return Outcome(None, False, s.nodes)
    finally:
        sys.setrecursionlimit(limit)
    return Outcome(s.offsets.copy() if ok else None, not ok, s.nodes)


class _Search:
    def __init__(self, lower, upper, units, capacity, order, sec, members, deadline, node_limit) -> None:
        n = len(lower)
        self.n = n
        self.lower, self.upper, self.units = lower, upper, units
        self.capacity = capacity
        self.rank = np.empty(n, dtype=np.int64)
        self.rank[order] = np.arange(n)
        self.minoff = np.zeros(n + 1, dtype=np.int64)
        self.minoff[n] = _INF  # the sentinel member of every section
        self.placed = np.zeros(n + 1, dtype=bool)
        self.placed[n] = True
        self.offsets = np.zeros(n, dtype=np.int64)
        self.total = sec.total.copy()
        self.floor = np.zeros(sec.n_sections, dtype=np.int64)  # top of placed buffers
        self.s0, self.s1 = sec.s0, sec.s1
        self.lo_l, self.up_l, self.sz_l = lower.tolist(), upper.tolist(), units.tolist()
        self.s0_l, self.s1_l = sec.s0.tolist(), sec.s1.tolist()
        self.members = members
        self.wide = members is None
        # explicit neighbour lists where they are small; a vectorised scan otherwise
        self.ptr, self.adj = neighbours(lower, upper) if n <= STRONG_LIMIT else (None, None)
        self.by_lower = np.argsort(lower, kind="stable")
        self.deadline = deadline
        self.node_limit = node_limit
        self.nodes = 0
        self.trail: list[tuple] = []

    # -- state changes ------------------------------------------------------------------
    def place(self, b: int) -> None:
        o = int(self.minoff[b])
        h = o + self.sz_l[b]
        self.offsets[b] = o
        self.placed[b] = True
        a, z = self.s0_l[b], self.s1_l[b]
        self.total[a:z] -= self.sz_l[b]
        old_floor = self.floor[a:z].copy()
        np.maximum(self.floor[a:z], h, out=self.floor[a:z])
        if self.adj is not None:
            nb = self.adj[self.ptr[b] : self.ptr[b + 1]]
            hit = nb[(self.minoff[nb] < h) & ~self.placed[nb]]
        else:
            n = self.n
            hit = np.flatnonzero(
                (self.lower < self.up_l[b]) & (self.upper > self.lo_l[b]) & (self.minoff[:n] < h) & ~self.placed[:n]
            )
        old_min = self.minoff[hit].copy()
        self.minoff[hit] = h
        self.trail.append((b, a, z, old_floor, hit, old_min))

    def undo_to(self, mark: int) -> None:
        while len(self.trail) > mark:
            b, a, z, old_floor, hit, old_min = self.trail.pop()
            self.minoff[hit] = old_min
            self.floor[a:z] = old_floor
            self.total[a:z] += self.sz_l[b]
            self.placed[b] = False

    # -- inference ----------------------------------------------------------------------
    def consistent(self, a: int, z: int, cur: int) -> bool:
        """Section inference over sections ``[a, z)`` (the part being solved)."""
        total = self.total[a:z]
        if self.members is not None:
            ptr, buf = self.members
            lo, hi = int(ptr[a]), int(ptr[z])
            m = buf[lo:hi]
            vals = np.where(self.placed[m], _INF, self.minoff[m])
            base = np.minimum.reduceat(vals, ptr[a:z] - lo) if z > a else vals[:0]
        else:
            base = self.floor[a:z]
        need = np.maximum(base, cur) + total
        return not bool(np.any(need[total > 0] > self.capacity))

    def split(self, part: np.ndarray) -> list[np.ndarray]:
        """The part's buffers grouped by connected lifetimes (sorted by start)."""
        part = part[np.argsort(self.lower[part], kind="stable")]
        if part.size < 2:
            return [part]
        reach = np.maximum.accumulate(self.upper[part])
        cuts = np.flatnonzero(self.lower[part][1:] >= reach[:-1]) + 1
        return np.split(part, cuts) if cuts.size else [part]

    def candidates(self, part: np.ndarray, cur: int, cur_rank: int) -> np.ndarray:
        mo = self.minoff[part]
        min_height = int((mo + self.units[part]).min())
        rk = self.rank[part]
        ok = (mo < min_height) & ((mo > cur) | ((mo == cur) & (rk > cur_rank)))
        c = np.flatnonzero(ok)
        if c.size > 1:
            if self.wide and c.size > WIDE_LIMIT:
                c = c[np.argpartition(mo[c], WIDE_LIMIT)[:WIDE_LIMIT]]
            c = c[np.lexsort((rk[c], mo[c]))]
        return part[c]

    # -- search -------------------------------------------------------------------------
    def solve(self, part: np.ndarray, cur: int, cur_rank: int) -> bool:
        """Place every buffer of ``part`` (unplaced, one or more lifetime groups);
        on failure the state is as on entry."""
        if part.size == 0:
            return True
        groups = self.split(part)
        if len(groups) > 1:
            mark = len(self.trail)
            # the most crowded group first: it is the likeliest to fail
            groups.sort(key=lambda g: -int(self.units[g].sum()))
            for g in groups:
                if not self.solve(g, -1, -1):
                    self.undo_to(mark)
                    return False
            return True
        a = int(self.s0[part].min())
        z = int(self.s1[part].max())
        # Every buffer placed from here sits at or above the offset it is placed at, so
        # placing one at o leaves each section needing o + its unplaced total: a
        # candidate at o fails when o + the part's largest section total exceeds the
        # capacity, and so does every later (higher) candidate.
        slack = self.capacity - int(self.total[a:z].max())
        for b in self.candidates(part, cur, cur_rank).tolist():
            if int(self.minoff[b]) > slack:
                break
            self.nodes += 1
            if self.nodes >= self.node_limit or (self.nodes & 63 == 0 and time.perf_counter() > self.deadline):
                raise _Abort
            if int(self.minoff[b]) + self.sz_l[b] > self.capacity:
                continue
            mark = len(self.trail)
            self.place(b)
            o = int(self.offsets[b])
            if self.consistent(a, z, o) and self.solve(part[part != b], o, int(self.rank[b])):
                return True
            self.undo_to(mark)
        return False


def lowest_first(lower: np.ndarray, upper: np.ndarray, units: np.ndarray, order: np.ndarray) -> np.ndarray:
    """The first leaf of the canonical search without a capacity: repeatedly place the
    unplaced buffer with the lowest floor (preorder on ties). O(n) numpy per buffer, no
    pair lists, so it scales to tens of thousands of buffers."""
    n = len(lower)
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    minoff = np.zeros(n, dtype=np.int64)
    offsets = np.zeros(n, dtype=np.int64)
    done = np.zeros(n, dtype=bool)
    floor = minoff.copy()  # minoff, with placed buffers pushed out of reach
    for _ in range(n):
        low = np.flatnonzero(floor == floor.min())
        b = int(low[np.argmin(rank[low])]) if low.size > 1 else int(low[0])
        o = int(minoff[b])
        offsets[b] = o
        done[b] = True
        floor[b] = _INF
        h = o + int(units[b])
        hit = np.flatnonzero((lower < upper[b]) & (upper > lower[b]) & (minoff < h) & ~done)
        minoff[hit] = h
        floor[hit] = h
    return offsets
