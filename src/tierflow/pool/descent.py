"""Lower a valid placement one capacity at a time by min-conflicts local search.

The ladder and the canonical search build placements from nothing; near their best
peak they stall. This starts from the best placement instead: ask for one unit less
than its peak, push every buffer that now sticks out down under the new capacity
(which makes some time neighbours overlap), then move one overlapping buffer at a time
to the offset where it overlaps least, with weights on the pairs that keep
overlapping (guided local search, the compiled ``min_conflicts`` of :mod:`._kernels`).
When no pair overlaps the placement is valid under the new capacity and the next unit
is asked; a try that does not get there in :data:`TRY_ITERS` moves starts again from
the last valid placement with a new seed.

Measured on MiniMalloc's J (409 buffers, one core, load about 0.7, a prototype of this
kernel): from the search's 1.0476 x the bound to 1.0414 in 11 s and to 1.0362 in 17 s,
lower than the ladder reached in 60 s; on D it moved nothing (BENCHMARKS.md). It proves nothing: a capacity
it cannot reach may still be feasible.

Every answer is checked for overlaps by plain numpy before it is kept.

Example::

    off, facts = descend(lower, upper, size, start, floor=lb, deadline=time.perf_counter() + 5)
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ._graph import neighbours, overlap_pairs

# moves a try gets before it starts again from the last valid placement: the weights
# it has learnt are lost on a restart (J in 8 s at load 4: 3-4 steps with a million
# moves a try, 0-2 with 200 thousand, the same with 3 million; BENCHMARKS.md)
TRY_ITERS = 1_000_000
# moves between two looks at the clock and the stop flag (compiled; interpreted, a move
# costs about a thousand Python steps, so the clock is read every CHUNK_INTERPRETED)
CHUNK = 20_000
CHUNK_INTERPRETED = 20
# a moved buffer stays put for TENURE + a random 0..TENURE moves
TENURE = 10


def overlapping(lower: np.ndarray, upper: np.ndarray, size: np.ndarray, off: np.ndarray) -> int:
    """The bytes (units) of overlap summed over the pairs of time neighbours: 0 when
    ``off`` is a placement (checked from the arrays, not from the kernel's state)."""
    a, b = overlap_pairs(lower, upper)
    ov = np.minimum(off[a] + size[a], off[b] + size[b]) - np.maximum(off[a], off[b])
    return int(np.maximum(ov, 0).sum())


def descend(
    lower: np.ndarray,
    upper: np.ndarray,
    size: np.ndarray,
    start: np.ndarray,
    floor: int,
    deadline: float,
    seed: int = 0,
    stop: Callable[[], bool] | None = None,
    better: Callable[[], np.ndarray | None] | None = None,
    found: Callable[[np.ndarray], None] | None = None,
    max_tries: int | None = None,
) -> tuple[np.ndarray, dict]:
    """Lower the peak of ``start`` a unit at a time until ``floor``, the deadline or
    ``stop()``.

    Args:
        lower, upper: lifetimes ``[lower, upper)``.
        size: sizes (units, each >= 1).
        start: a valid placement (units).
        floor: no placement peaks below it (the lower bound): the descent ends there.
        deadline: ``time.perf_counter()`` at which it returns.
        seed: seed of the first try (each try takes the next).
        stop: returns True to end the descent early.
        better: returns a valid placement another solver found, or None; when it peaks
            lower than the descent's own, the descent goes on from it.
        found: called with each lower placement the descent finds.
        max_tries: at most this many tries in all (with a deadline that does not bind,
            the answer is then the same on every run).

    Returns:
        The lowest placement found (``start`` itself when none) and facts: ``steps``
        (capacities reached), ``tries``, ``moves``.

    Raises:
        ValueError: ``start`` overlaps (the descent needs a valid start).
    """
    from . import _kernels as K

    size = np.asarray(size, dtype=np.int64)
    best = np.asarray(start, dtype=np.int64).copy()
    facts = {"steps": 0, "tries": 0, "moves": 0}
    n = len(size)
    if n == 0:
        return best, facts
    if overlapping(lower, upper, size, best):
        raise ValueError("descend: the start placement overlaps")
    ptr, adj = neighbours(np.asarray(lower), np.asarray(upper))
    src = np.repeat(np.arange(n), np.diff(ptr))
    adj = adj[np.lexsort((adj, src))]  # each row sorted, so the edges sort by (src, dst)
    key = src * n + adj
    rev = np.searchsorted(key, adj * n + src).astype(np.int64)
    peak = int((best + size).max())
    prof = np.zeros(peak + 2 * int(size.max()) + 4, dtype=np.int64)
    conf = np.zeros(n, dtype=np.int64)
    tabu = np.zeros(n, dtype=np.int64)
    chunk = CHUNK if K.HAVE_NUMBA else CHUNK_INTERPRETED

    def halted() -> bool:
        return (time.perf_counter() >= deadline or (stop is not None and stop())
                or (max_tries is not None and facts["tries"] >= max_tries))

    while peak > floor and not halted():
        other = better() if better is not None else None
        if other is not None and int((other + size).max()) < peak:
            best = np.asarray(other, dtype=np.int64).copy()
            peak = int((best + size).max())
            continue
        cap = peak - 1
        off = np.minimum(best, cap - size)
        w = np.ones(len(adj), dtype=np.int64)
        facts["tries"] += 1
        left, moves = 1, 0
        while left and moves < TRY_ITERS and time.perf_counter() < deadline and not (stop is not None and stop()):
            left, done = K.min_conflicts(size, ptr, adj, rev, cap, off, w, conf, tabu, min(chunk, TRY_ITERS - moves),
                                         seed + facts["tries"] * 1000 + moves // chunk, TENURE, prof)
            left, moves = int(left), moves + int(done)
        facts["moves"] += moves
        if left == 0 and int((off + size).max()) <= cap and overlapping(lower, upper, size, off) == 0:
            best, peak = off, int((off + size).max())
            facts["steps"] += 1
            if found is not None:
                found(best)
    return best, facts
