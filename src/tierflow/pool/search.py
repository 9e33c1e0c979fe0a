"""Branch and bound over canonical placements (after MiniMalloc, Moffitt, ASPLOS'24).

A *canonical* solution places buffers in non-decreasing offset order, each at the
lowest offset its already-placed time neighbours allow (its *floor*). Every packing can
be pushed down into a canonical one without raising its peak, so searching canonical
placements only loses nothing; ties in offset are broken by a static preorder, which
removes the permutations of equal-offset placements.

At each node the candidates are the unplaced buffers whose floor is at least the
offset just used (in preorder past the last buffer on ties), tried lowest floor first.
Three rules prune:

* dominance: a buffer whose floor is at or above the lowest *top* any unplaced buffer
  could reach would leave a hole under it that that buffer fits in; skip it (and every
  later candidate, since they are sorted by floor);
* section inference: time is cut into sections at every lifetime boundary; in each
  section the unplaced buffers must stack above the lowest floor among them, so that
  floor plus their total size must fit the capacity;
* decomposition: when the unplaced buffers fall apart into groups with disjoint
  lifetimes, each group is solved on its own, and one that fails fails the node.

The search decides one capacity at a time (a fixed capacity prunes far harder than
optimising); :func:`feasible` runs it under a node limit and a deadline. The inner loop
is compiled (:mod:`._kernels`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

# below this many (buffer, section) incidences in a node the strong section inference
# (the lowest floor of each section's unplaced buffers) is gathered; above, it costs
# more than it prunes and the top of the placed buffers stands in
STRONG_LIMIT = 200_000
# the pools (entries each) may grow to this; a search that needs more gives up (on tens
# of thousands of buffers every level copies a large part: the memory would run out)
MAX_POOL = 1 << 24


@dataclass
class Outcome:
    """Result of one capacity attempt: ``offsets`` (units) when one was found;
    ``exhausted`` when the whole canonical space was searched without one (a proof
    that the capacity is infeasible); ``nodes`` placements tried."""

    offsets: np.ndarray | None
    exhausted: bool
    nodes: int


class Sections:
    """Elementary time sections of a problem and each buffer's section range.

    Attributes:
        s0, s1: per buffer, it covers sections ``[s0, s1)``.
        n_sections: number of sections.
        total: per section, the units live in it.
        buffer_total: per buffer, the most units live in any of its sections.
        by_s0: buffers sorted by ``s0``; ``first_at[s]`` is the position in it of the
            first buffer starting at section ``s`` or later (``first_at[n_sections]``
            is the count).
    """

    def __init__(self, lower: np.ndarray, upper: np.ndarray, units: np.ndarray) -> None:
        pts = np.unique(np.concatenate([lower, upper]))
        self.s0 = np.searchsorted(pts, lower).astype(np.int64)
        self.s1 = np.searchsorted(pts, upper).astype(np.int64)
        self.n_sections = max(len(pts) - 1, 0)
        delta = np.zeros(self.n_sections + 1, dtype=np.int64)
        np.add.at(delta, self.s0, units)
        np.add.at(delta, self.s1, -units)
        self.total = np.cumsum(delta[:-1])
        if len(lower):
            idx = np.empty(2 * len(lower), dtype=np.int64)
            idx[0::2], idx[1::2] = self.s0, self.s1
            padded = np.append(self.total, 0)
            self.buffer_total = np.maximum.reduceat(padded, idx)[0::2]
        else:
            self.buffer_total = np.zeros(0, dtype=np.int64)
        self.by_s0 = np.argsort(self.s0, kind="stable").astype(np.int64)
        self.first_at = np.searchsorted(self.s0[self.by_s0], np.arange(self.n_sections + 1)).astype(np.int64)


def preorders(lower: np.ndarray, upper: np.ndarray, units: np.ndarray, sec: Sections) -> dict[str, np.ndarray]:
    """Static orders for tie-breaking and branching, named by their keys (all
    descending): T total in the buffer's busiest section, W lifetime (MiniMalloc's
    width), A area, S size, L lifetime."""
    n = len(lower)
    idx = np.arange(n)
    t = sec.buffer_total
    w = upper - lower
    a = units * (upper - lower)
    return {
        "TWA": np.lexsort((idx, -a, -w, -t)),
        "WAT": np.lexsort((idx, -t, -a, -w)),
        "TAW": np.lexsort((idx, -w, -a, -t)),
        "A": np.lexsort((idx, -units, -a)),
        "S": np.lexsort((idx, lower, -units)),
        "LS": np.lexsort((idx, -units, -(upper - lower))),
    }


class Search:
    """The canonical search at one capacity under one preorder, resumable.

    :meth:`advance` runs it for a number of placements and returns; the state stays in
    arrays between calls, so a caller can interleave several searches and check its
    clock between steps while the outcome depends on node counts only.

    Args:
        units: the buffers' sizes in alignment units, all positive (place empty buffers
            at 0 beforehand: a zero height would defeat the dominance rule).
        capacity: the capacity to decide.
        order: static preorder (buffer indices, first = preferred on ties).
        sec: the problem's sections.
        area: per buffer, size times lifetime (a preorder key).
        keys: the preorder that groups split off during the search get: letters T
            (most units live in any of the buffer's sections), W (``width``), A
            (area), most significant first, all descending.
        width: per buffer, its lifetime (default: the sections it spans).

    Raises:
        ValueError: a buffer of size 0, or an unknown key.
    """

    def __init__(
        self,
        units: np.ndarray,
        capacity: int,
        order: np.ndarray,
        sec: Sections,
        area: np.ndarray,
        keys: str = "TWA",
        width: np.ndarray | None = None,
    ) -> None:
        from . import _kernels as K

        self._k = K
        n = len(units)
        if n and int(units.min()) <= 0:
            raise ValueError("the search needs positive sizes; place empty buffers at 0 beforehand")
        self.n = n
        self.capacity = int(capacity)
        self.sec = sec
        self.units = np.ascontiguousarray(units, dtype=np.int64)
        self.wide = np.ascontiguousarray(sec.s1 - sec.s0 if width is None else width, dtype=np.int64)
        self.area = np.ascontiguousarray(area, dtype=np.int64)
        if not keys or set(keys) - set("TWA"):
            raise ValueError(f"preorder keys {keys!r}: expected letters of T, W, A")
        self.keys3 = np.array(["TWA".index(c) for c in keys], dtype=np.int64)
        self.rank = np.empty(n, dtype=np.int64)
        self.rank[order] = np.arange(n)
        self.minoff = np.zeros(n, dtype=np.int64)
        self.placed = np.zeros(n, dtype=np.bool_)
        self.offsets = np.zeros(n, dtype=np.int64)
        self.total = sec.total.astype(np.int64)
        self.floor = np.zeros(sec.n_sections, dtype=np.int64)
        self.fr = np.zeros((2 * n + 4, K.FRAME_SIZE), dtype=np.int64)
        # the pools grow on demand (GROW): start at what a few dozen levels need
        self.pbuf = np.zeros(max(64, 33 * n), dtype=np.int64)
        self.mbuf = np.zeros_like(self.pbuf)
        self.rbuf = np.zeros_like(self.pbuf)
        self.sbuf_t = np.zeros(max(64, 32 * sec.n_sections), dtype=np.int64)
        self.sbuf_f = np.zeros_like(self.sbuf_t)
        self.cbuf = np.zeros(max(128, 64 * n), dtype=np.int64)
        self.ctl = np.zeros(K.CTL_SIZE, dtype=np.int64)
        self.pbuf[:n] = sec.by_s0
        self.ctl[K.C_A], self.ctl[K.C_Z], self.ctl[K.C_PTOP] = 0, n, n
        self.ctl[K.C_CUR] = self.ctl[K.C_RANK] = -1
        self.result: bool | None = None  # True found, False exhausted, None undecided
        self.gave_up = False  # the pools hit MAX_POOL: the search cannot go on
        if n == 0:
            self.result = True
        elif int(sec.total.max(initial=0)) > capacity:
            self.result = False

    @property
    def nodes(self) -> int:
        """Placements tried so far."""
        return int(self.ctl[self._k.C_NODES])

    def advance(self, nodes: int) -> bool | None:
        """Search for up to ``nodes`` more placements. Returns :attr:`result`: True
        (a placement within the capacity: :attr:`offsets`), False (none exists) or None
        (undecided yet)."""
        K = self._k
        if self.result is not None or self.gave_up:
            return self.result
        self.ctl[K.C_PAUSE] = self.nodes + max(1, int(nodes))
        while True:
            r = K.run(self.sec.s0, self.sec.s1, self.units, self.wide, self.area, self.keys3, self.capacity,
                      STRONG_LIMIT, self.rank, self.minoff, self.placed, self.offsets, self.total, self.floor,
                      self.fr, self.pbuf, self.mbuf, self.rbuf, self.sbuf_t, self.sbuf_f, self.cbuf,
                      self.ctl)  # fmt: skip
            if r == K.GROW:
                if not self._grow(int(self.ctl[K.C_POOL])):
                    self.gave_up = True
                    return None
                continue
            if r == K.FOUND:
                self.result = True
            elif r == K.EXHAUSTED:
                self.result = False
            return self.result

    def _grow(self, pool: int) -> bool:
        """Double pool ``pool`` (1 parts, 2 sections, 3 candidates); False when that
        would pass :data:`MAX_POOL`."""

        def twice(a: np.ndarray) -> np.ndarray:
            return np.concatenate([a, np.zeros_like(a)])

        size = {1: len(self.pbuf), 2: len(self.sbuf_t), 3: len(self.cbuf)}[pool]
        if 2 * size > MAX_POOL:
            return False
        if pool == 1:
            self.pbuf, self.mbuf, self.rbuf = twice(self.pbuf), twice(self.mbuf), twice(self.rbuf)
        elif pool == 2:
            self.sbuf_t, self.sbuf_f = twice(self.sbuf_t), twice(self.sbuf_f)
        else:
            self.cbuf = twice(self.cbuf)
        return True


def feasible(
    units: np.ndarray,
    capacity: int,
    order: np.ndarray,
    sec: Sections,
    deadline: float,
    node_limit: int,
    area: np.ndarray | None = None,
    keys: str = "TWA",
    width: np.ndarray | None = None,
    step: int = 1 << 16,
) -> Outcome:
    """Search for a canonical placement with every top at most ``capacity`` (units).

    Args:
        units: the buffers' sizes in alignment units, all positive.
        capacity: the capacity to decide.
        order: static preorder (buffer indices, first = preferred on ties).
        sec: the problem's sections.
        deadline: ``time.perf_counter()`` value at which to give up.
        node_limit: placements to try before giving up.
        area: per buffer, size times lifetime (default: size times sections spanned).
        keys: the preorder of groups split off during the search (see :class:`Search`).
        width: per buffer, its lifetime (the W key; default: the sections it spans).
        step: placements between two looks at the clock.

    Raises:
        ValueError: a buffer of size 0.
    """
    if area is None:
        area = units * (sec.s1 - sec.s0)
    s = Search(units, capacity, order, sec, area, keys, width)
    while s.result is None and not s.gave_up and s.nodes < node_limit and time.perf_counter() < deadline:
        s.advance(min(step, node_limit - s.nodes))
    if s.result:
        return Outcome(s.offsets.copy(), False, s.nodes)
    return Outcome(None, s.result is False, s.nodes)


def lowest_first(units: np.ndarray, order: np.ndarray, sec: Sections) -> np.ndarray:
    """The first leaf of the canonical search without a capacity: repeatedly place the
    unplaced buffer with the lowest floor (preorder on ties). Returns offsets (units)."""
    from . import _kernels as K

    n = len(units)
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    return K.lowest_first(sec.s0, sec.s1, np.ascontiguousarray(units, dtype=np.int64), rank, sec.by_s0, sec.first_at)
