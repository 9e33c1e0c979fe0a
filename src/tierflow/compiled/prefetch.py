"""Where the copy back of each offloaded saved tensor starts in the backward graph.

A reload issued right before the tensor's first backward use makes that op wait for the
whole copy. :func:`prefetch_points` moves each start earlier, op by op back from the
first use, until the ops in between cover the copy's predicted time (``bytes /
BYTES_PER_S``, the op times graph_trace estimated), never before the backward graph's
start nor before the tensor's last forward use, and never where the device tensor the
copy writes (allocated when the copy starts) would lift the live bytes above the limit.
Tensors are placed in the order of their first use, each on the curve with the earlier
ones' starts counted, so the returned curve is the graph's live bytes with every
prefetch counted from its start.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .graph_trace import BYTES_PER_S, GraphFacts, SavedTensor


@dataclass(frozen=True, slots=True)
class PrefetchPlan:
    """Where each copy back starts.

    Attributes:
        start: per offloaded name, the trace op index before which its copy back
            starts (its ``first_bwd_use`` when nothing can run beside the copy).
        curve: the live bytes at each op with the offloads and the prefetches counted.
        limit: the live bytes no start was allowed to exceed.
    """

    start: dict[str, int]
    curve: np.ndarray
    limit: int


def offloaded_curve(facts: GraphFacts, offloaded: Iterable[SavedTensor]) -> np.ndarray:
    """The facts' curve with each offloaded storage off the device from after its last
    forward use until its first backward use (the copy back allocated at that use)."""
    curve = facts.curve.copy()
    for s in {s.tensor: s for s in offloaded}.values():
        curve[s.last_fwd_use + 1 : s.first_bwd_use] -= s.bytes
    return curve


def prefetch_points(facts: GraphFacts, offloaded: Iterable[str], limit: int | None,
                    bytes_per_s: float = BYTES_PER_S) -> PrefetchPlan:
    """Start each offloaded tensor's copy back as early as its copy time asks and the
    limit allows (see the module docstring).

    Args:
        facts: the partitioned graph (its trace, saved set and curve).
        offloaded: names of the saved tensors the graph offloads.
        limit: live bytes a start may not exceed; ``None``, or below the curve's own
            peak with the offloads: the curve's peak (a prefetch never raises it).
        bytes_per_s: the host-to-device copy's rate.

    Raises:
        KeyError: a name that is not in the facts' saved set.

    Example:
        >>> p = prefetch_points(rec.facts, rec.offloaded, limit=64 << 20)  # doctest: +SKIP
        >>> all(p.start[n] <= first_use[n] for n in rec.offloaded)  # doctest: +SKIP
        True
    """
    by_name = {s.name: s for s in facts.saved}
    moved = [by_name[n] for n in offloaded]
    curve = offloaded_curve(facts, moved)
    peak = int(curve.max()) if len(curve) else 0
    cap = peak if limit is None else max(int(limit), peak)
    ops = facts.trace.ops
    start: dict[str, int] = {}
    for s in sorted(moved, key=lambda s: (s.first_bwd_use, s.name)):
        need = s.bytes / bytes_per_s
        lowest = max(s.last_fwd_use + 1, facts.n_fwd)
        at, covered = s.first_bwd_use, 0.0
        while at > lowest and covered < need and curve[at - 1] + s.bytes <= cap:
            at -= 1
            covered += ops[at].duration_s
        curve[at : s.first_bwd_use] += s.bytes
        start[s.name] = at
    return PrefetchPlan(start, curve, cap)


__all__ = ["PrefetchPlan", "offloaded_curve", "prefetch_points"]
