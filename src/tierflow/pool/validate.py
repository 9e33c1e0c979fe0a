"""An independent checker for pool solutions.

It shares no code with the solvers: a sweep over time keeps the live buffers in a list
sorted by offset, and a buffer that starts is checked against its neighbours in that
list only. That suffices because the live set is kept pairwise disjoint: if the new
buffer overlaps any live one, it overlaps its predecessor or its successor in offset
order.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from .problem import PoolError, Problem


@dataclass(frozen=True)
class Report:
    """What :func:`validate` found.

    Attributes:
        valid: no error.
        peak: ``max(offset + size)`` recomputed from the offsets.
        errors: one line per fault (at most ``max_errors``).
    """

    valid: bool
    peak: int
    errors: tuple[str, ...] = field(default_factory=tuple)


def validate(problem: Problem, offsets: Sequence[int], peak: int | None = None, max_errors: int = 20) -> Report:
    """Check offsets against a problem.

    Checks: one integer offset per buffer, non-negative, a multiple of the alignment;
    no two buffers live at the same instant share a byte; and, when ``peak`` is given,
    that it equals the recomputed peak.
    """
    bufs = problem.buffers
    errors: list[str] = []
    offs = [int(o) for o in offsets]
    if len(offs) != len(bufs):
        return Report(False, 0, (f"{len(offs)} offsets for {len(bufs)} buffers",))
    top = 0
    for b, o in zip(bufs, offs):
        if o < 0:
            errors.append(f"buffer {b.id}: offset {o} is negative")
        if o % problem.alignment:
            errors.append(f"buffer {b.id}: offset {o} is not a multiple of {problem.alignment}")
        top = max(top, o + b.size)
    # events: (time, kind, index); kind 0 = end sorts before kind 1 = start (half-open)
    events = []
    for i, b in enumerate(bufs):
        if b.size > 0:  # an empty buffer occupies no byte
            events.append((b.lower, 1, i))
            events.append((b.upper, 0, i))
    events.sort()
    live: list[tuple[int, int, int]] = []  # (offset, end, index), sorted
    for _, kind, i in events:
        key = (offs[i], offs[i] + bufs[i].size, i)
        if kind == 0:
            j = bisect.bisect_left(live, key)
            if j < len(live) and live[j] == key:
                del live[j]
            continue
        j = bisect.bisect_left(live, key)
        if j > 0 and live[j - 1][1] > key[0]:
            errors.append(_clash(bufs, live[j - 1][2], i, offs))
        elif j < len(live) and live[j][0] < key[1]:
            errors.append(_clash(bufs, i, live[j][2], offs))
        else:
            live.insert(j, key)  # only disjoint buffers enter, so neighbours suffice
        if len(errors) >= max_errors:
            break
    if peak is not None and peak != top:
        errors.append(f"reported peak {peak} differs from the offsets' peak {top}")
    return Report(not errors, top, tuple(errors[:max_errors]))


def check(problem: Problem, offsets: Sequence[int], peak: int | None = None) -> int:
    """Like :func:`validate`, but returns the peak and raises on the first fault.

    Raises:
        PoolError: naming the buffers at fault.
    """
    r = validate(problem, offsets, peak)
    if not r.valid:
        raise PoolError(f"problem {problem.name!r}: invalid solution: {r.errors[0]}")
    return r.peak


def _clash(bufs, i: int, j: int, offs: list[int]) -> str:
    a, b = bufs[i], bufs[j]
    return (
        f"buffers {a.id} [{a.lower},{a.upper}) at [{offs[i]},{offs[i] + a.size}) and "
        f"{b.id} [{b.lower},{b.upper}) at [{offs[j]},{offs[j] + b.size}) overlap"
    )
