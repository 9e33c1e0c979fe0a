"""Time-overlap structure shared by the solvers (never by the validator)."""

from __future__ import annotations

import numpy as np


def overlap_pairs(lower: np.ndarray, upper: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every pair ``(i, j)`` of buffers whose lifetimes overlap, each pair once.

    Sorting by start, the buffers overlapping ``i`` that start no earlier than it are a
    contiguous run of the sorted order (those starting before ``upper[i]``); the runs
    are expanded with ``np.repeat`` so the work is O(n log n + pairs) in numpy.
    """
    n = len(lower)
    order = np.argsort(lower, kind="stable")
    ls = lower[order]
    stop = np.searchsorted(ls, upper[order], side="left")
    first = np.arange(1, n + 1)
    counts = np.maximum(stop - first, 0)
    src = np.repeat(np.arange(n), counts)
    # position within each run: a global arange minus the run's starting offset
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    dst = np.repeat(first, counts) + (np.arange(int(counts.sum())) - starts)
    return order[src], order[dst]


def neighbours(lower: np.ndarray, upper: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The overlap graph as CSR: the neighbours of ``i`` are ``adj[ptr[i]:ptr[i+1]]``."""
    n = len(lower)
    a, b = overlap_pairs(lower, upper)
    src = np.concatenate([a, b])
    dst = np.concatenate([b, a])
    order = np.argsort(src, kind="stable")
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(src, minlength=n), out=ptr[1:])
    return ptr, dst[order]
