"""Shrink a pool problem before an exact search, and map its answer back.

Four reductions, none of which changes the optimum (in alignment units):

* **Sizes by their gcd.** Any placement can be pushed down until every buffer rests
  on the floor or on another buffer's top, without raising the peak; then every offset
  is a sum of sizes, so a multiple of their gcd ``g``. The optimum in units is ``g``
  times the optimum of the problem with sizes divided by ``g``, and a capacity proven
  infeasible in reduced units, ``c``, proves every capacity below ``g * (c + 1)``
  infeasible in units.
* **Buffers alone in time** (their lifetime overlaps no other non-empty buffer's) and
  **empty buffers** sit at offset 0; they are set aside. They cannot raise the peak
  above the largest of them, which the lower bound already counts.
* **Time compressed** to the ranks of the distinct lifetime ends: two half-open
  lifetimes overlap exactly when their ranked ones do.
* **Equal buffers** (same size and lifetime) are interchangeable: :attr:`Reduced.chains`
  lists each group in a fixed order, so a solver may require each to lie below the
  next (symmetry breaking) without losing a solution.

Example::

    red = reduce(problem)
    off = some_solver(red.lower, red.upper, red.size)   # reduced units
    offsets = red.expand(off)                           # bytes, in problem order
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._graph import overlap_pairs
from .problem import Problem


@dataclass(frozen=True)
class Reduced:
    """A reduced problem and the way back.

    Attributes:
        keep: indices (into the original problem) of the buffers that remain, in the
            order of the reduced arrays.
        lower, upper: compressed lifetimes ``[lower, upper)`` of the kept buffers.
        size: their sizes in reduced units of ``gcd`` alignment units, ``scale``
            bytes (each ``>= 1``).
        gcd: the divisor of the sizes in alignment units.
        alignment: the original problem's alignment (bytes per unit).
        lower_bound: the most reduced units live at one instant (0 when nothing is kept).
        chains: groups of equal kept buffers (indices into the reduced arrays), each
            with two or more members, in the order a solver may stack them.
        n: buffers in the original problem.
    """

    keep: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    size: np.ndarray
    gcd: int
    alignment: int
    lower_bound: int
    chains: tuple[tuple[int, ...], ...]
    n: int

    def __len__(self) -> int:
        return len(self.keep)

    @property
    def scale(self) -> int:
        """Bytes per reduced unit."""
        return self.gcd * self.alignment

    def expand(self, offsets: np.ndarray) -> np.ndarray:
        """Offsets in bytes for every buffer of the original problem, from offsets of
        the kept buffers in reduced units (set-aside buffers at 0)."""
        out = np.zeros(self.n, dtype=np.int64)
        out[self.keep] = np.asarray(offsets, dtype=np.int64) * self.scale
        return out

    def restrict(self, offsets: np.ndarray) -> np.ndarray | None:
        """The kept buffers' offsets in reduced units from offsets in bytes of the
        original problem, or None when one is not a multiple of :attr:`scale` (such a
        placement can still be pushed down onto the grid, but not by this map)."""
        off = np.asarray(offsets, dtype=np.int64)[self.keep]
        if np.any(off % self.scale):
            return None
        return off // self.scale

    def peak(self, offsets: np.ndarray) -> int:
        """The highest top of the kept buffers in reduced units."""
        return int((np.asarray(offsets) + self.size).max()) if len(self.keep) else 0


def reduce(problem: Problem) -> Reduced:
    """The reduced form of ``problem`` (module docstring)."""
    units = problem.units
    n = len(problem)
    nonempty = np.flatnonzero(units > 0)
    lo_all, hi_all = problem.lower[nonempty], problem.upper[nonempty]
    a, b = overlap_pairs(lo_all, hi_all)
    touched = np.zeros(len(nonempty), dtype=bool)
    touched[a] = True
    touched[b] = True
    keep = nonempty[touched]
    size = units[keep]
    g = int(np.gcd.reduce(size)) if len(keep) else 1
    size = size // g
    ends = np.unique(np.concatenate([problem.lower[keep], problem.upper[keep]]))
    lower = np.searchsorted(ends, problem.lower[keep]).astype(np.int64)
    upper = np.searchsorted(ends, problem.upper[keep]).astype(np.int64)
    return Reduced(
        keep=keep.astype(np.int64),
        lower=lower,
        upper=upper,
        size=size.astype(np.int64),
        gcd=g,
        alignment=problem.alignment,
        lower_bound=_live_max(lower, upper, size),
        chains=_equal_groups(lower, upper, size),
        n=n,
    )


def _live_max(lower: np.ndarray, upper: np.ndarray, size: np.ndarray) -> int:
    if not len(size):
        return 0
    live = np.zeros(int(upper.max()) + 1, dtype=np.int64)
    np.add.at(live, lower, size)
    np.add.at(live, upper, -size)
    return int(np.cumsum(live).max())


def _equal_groups(lower: np.ndarray, upper: np.ndarray, size: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """Groups of two or more buffers with the same (lower, upper, size), members in
    index order: the order is arbitrary but fixed, which is all symmetry breaking needs."""
    if not len(size):
        return ()
    order = np.lexsort((np.arange(len(size)), size, upper, lower))
    key = np.stack([lower[order], upper[order], size[order]], axis=1)
    new = np.ones(len(order), dtype=bool)
    new[1:] = np.any(key[1:] != key[:-1], axis=1)
    starts = np.flatnonzero(new)
    bounds = np.append(starts, len(order))
    return tuple(tuple(int(i) for i in order[s:e]) for s, e in zip(bounds[:-1], bounds[1:]) if e - s > 1)
