"""A constructive search for a placement under a capacity: fill the skyline from below.

The placement grows from the floor. Its top edge over time (the skyline) is kept. At a
valley (a stretch where the skyline is flat and higher on both sides), the cell at the
stretch's left end must be covered by a buffer that starts there, sits on the skyline
and ends inside the stretch, or be left empty. Each node picks the stretch with the
fewest such moves (fail first: a stretch with none is a dead end found at once) and
tries its buffers in the restart's order (one of each group of equal buffers) and, last, leaving the stretch empty up to
its lower neighbour.

One rule prunes: a buffer not yet placed will sit above the skyline wherever it is
live, so at every instant the skyline plus the sizes of the unplaced buffers live then
must fit under the capacity. Placing a buffer never breaks it (both sides move by its
size); leaving space empty may.

Where the busiest instants fill the whole capacity all the time (a perfect packing of
a full set) this finds the packing in a few hundred nodes. With free space the choice
of where to leave it empty is blind and the search does no better than greedy, which
is why the ladder runs it beside CP-SAT, not instead. Leaving space only up to the
lower neighbour is a heuristic restriction: an exhausted search proves nothing.

Example::

    off = skyline(red.lower, red.upper, red.size, cap, order, node_limit=20_000)
"""

from __future__ import annotations

import numpy as np


def orders(lower: np.ndarray, upper: np.ndarray, size: np.ndarray, count: int, seed: int = 0) -> list[np.ndarray]:
    """``count`` candidate orders for the restarts: largest size, longest life, largest
    area, then randomly perturbed areas (seeded). A restart tries, at each node, the
    fitting buffers in its order."""
    life = upper - lower
    area = life * size
    n = len(size)
    idx = np.arange(n)
    out = [np.lexsort((idx, -life, -size)), np.lexsort((idx, -size, -life)), np.lexsort((idx, -size, -area))]
    rng = np.random.default_rng(seed)
    while len(out) < count:
        out.append(np.lexsort((idx, -(area * rng.uniform(0.5, 1.5, size=n)))))
    return out[:count]


def skyline(lower: np.ndarray, upper: np.ndarray, size: np.ndarray, cap: int, order: np.ndarray,
            node_limit: int, stop=None) -> tuple[np.ndarray | None, int]:
    """A placement with every top at most ``cap``, or None if none was found within
    ``node_limit`` nodes (or ``stop`` became true).

    Args:
        lower, upper, size: the buffers (compressed time, reduced units, sizes >= 1).
        cap: the capacity.
        order: the preference among buffers that fit at a node (a permutation).
        node_limit: moves tried in all.
        stop: anything truthy when the search should end early (checked every 256 nodes).

    Returns:
        (offsets or None, nodes used).
    """
    n = len(size)
    if n == 0:
        return np.zeros(0, dtype=np.int64), 0
    horizon = int(upper.max())
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    # unplaced buffers by start, in order of preference
    starts: dict[int, list[int]] = {}
    for i in sorted(range(n), key=lambda i: rank[i]):
        starts.setdefault(int(lower[i]), []).append(i)
    height = np.zeros(horizon, dtype=np.int64)
    pending = np.zeros(horizon + 1, dtype=np.int64)
    np.add.at(pending, lower, size)
    np.add.at(pending, upper, -size)
    pending = np.cumsum(pending)[:horizon]
    if int(pending.max()) > cap:
        return None, 0
    placed = np.zeros(n, dtype=bool)
    offsets = np.zeros(n, dtype=np.int64)
    up, sz = upper.tolist(), size.tolist()
    # the stack: per level, the moves left to try and the undo of the move made
    stack: list[tuple[list, tuple | None]] = []
    nodes = 0
    left = n

    def moves() -> list | None:
        """The moves at the most constrained stretch; None when everything is placed."""
        if left == 0:
            return None
        change = np.flatnonzero(height[1:] != height[:-1]) + 1
        bounds = np.concatenate([[0], change, [horizon]])
        best: list | None = None
        best_key = None
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            h = int(height[a])
            if (a > 0 and height[a - 1] < h) or (b < horizon and height[b] < h):
                # not a valley: the buffer covering (a, h) may start before a or end
                # after b once the lower side is filled, so no move here is forced
                continue
            out: list = []
            seen: set[tuple[int, int]] = set()
            for i in starts.get(a, ()):
                # buffers of one lifetime and size are interchangeable: try one of them
                if not placed[i] and up[i] <= b and h + sz[i] <= cap and (up[i], sz[i]) not in seen:
                    seen.add((up[i], sz[i]))
                    out.append(("place", i))
            if h < cap:
                left_h = int(height[a - 1]) if a > 0 else cap
                right_h = int(height[b]) if b < horizon else cap
                target = min(left_h, right_h, cap)
                if int((pending[a:b] + target).max()) <= cap:
                    out.append(("waste", a, b, h, target))
            elif not out:
                continue  # full to the capacity: nothing to do here
            key = (len(out), h, a)
            if best_key is None or key < best_key:
                best, best_key = out, key
                if not out:
                    break
        return best if best is not None else []

    todo = moves()
    while todo is not None:
        if nodes >= node_limit or (stop is not None and not nodes % 256 and stop):
            return None, nodes
        if not todo:  # dead end: undo the last move and try the next at that level
            while stack:
                todo, undo = stack.pop()
                _undo(undo, height, pending, placed, lower, up, sz)
                if undo[0] == "place":
                    left += 1
                if todo:
                    break
            else:
                return None, nodes
            continue
        move = todo.pop(0)
        nodes += 1
        if move[0] == "place":
            i = move[1]
            lo, hi = int(lower[i]), up[i]
            offsets[i] = height[lo]
            height[lo:hi] += sz[i]
            pending[lo:hi] -= sz[i]
            placed[i] = True
            left -= 1
        else:
            _, a, b, _, target = move
            height[a:b] = target
        stack.append((todo, move))
        todo = moves()
    return offsets, nodes


def _undo(move, height, pending, placed, lower, up, sz) -> None:
    if move[0] == "place":
        i = move[1]
        lo, hi = int(lower[i]), up[i]
        height[lo:hi] -= sz[i]
        pending[lo:hi] += sz[i]
        placed[i] = False
    else:
        _, a, b, h, _ = move
        height[a:b] = h
