"""Recompute chains for a chosen saved set: what a partitioner's backward re-runs.

A compiled graph's partitioner (torch's min-cut, or a plan that tags tensors
``MUST_RECOMPUTE``) keeps a *saved set* for the backward and re-runs the forward ops
that re-create every other tensor the backward reads, each just before its first
backward use; a re-created tensor then stays until its last use. :func:`recompute_chains`
says that in the plan's vocabulary: one :class:`~tierflow.plan.Recompute` per backward
op that first needs a dropped tensor, its chain the forward ops from the saved set (or
the parameters and inputs) to the dropped tensors, in trace order.

A tensor a chain needs is *available* (the chain reads it, the plan holds it until the
chain has run) when it is saved, persistent or external, or still live in the trace at
the chain's op (not dropped), or re-created by an earlier chain and not dead yet.
Anything else is made again by the chain: a dropped tensor of this chain is kept, the
others are temporaries (a forward-only intermediate between the saved set and what the
backward reads). Where torch's backward graph would compute such an intermediate once
and reuse it for a later recompute, a later chain here re-runs its op again: the
compute is counted twice, the bytes not.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import PlanError
from ..plan import Recompute
from ..trace import Trace


def recompute_chains(trace: Trace, dropped: Iterable[int], saved: Iterable[int] = ()) -> tuple[Recompute, ...]:
    """The chains that re-create ``dropped`` before their first backward uses.

    Args:
        trace: the iteration (forward ops, then backward ops).
        dropped: tensor ids made by forward ops and read by backward ops, not kept.
        saved: tensor ids the backward may read from the forward (held until read).

    Returns:
        One :class:`Recompute` per distinct first backward use, in trace order.

    Raises:
        PlanError: a dropped tensor has no backward use, or is not made by a forward op.

    Example:
        >>> from tierflow.synthetic import gpt_trace  # doctest: +SKIP
        >>> recompute_chains(trace, {12, 17}, saved={3})  # doctest: +SKIP
    """
    drop = set(int(t) for t in dropped)
    held = set(int(t) for t in saved)
    persistent, external = trace.persistent, trace.external
    first, death = trace.first_use, trace.death
    phases = [o.phase for o in trace.ops]
    groups: dict[int, list[int]] = {}
    for t in sorted(drop):
        uses = trace.uses(t)
        bwd = [int(u) for u in uses if phases[u] == "backward"]
        maker = int(first[t])
        if not bwd:
            raise PlanError(f"recompute: tensor {t} ({trace.tensors[t].name}) has no backward use")
        if phases[maker] != "forward" or persistent[t] or external[t]:
            raise PlanError(f"recompute: tensor {t} ({trace.tensors[t].name}) is not made by a forward op")
        groups.setdefault(min(bwd), []).append(t)
    remade_until: dict[int, int] = {}  # re-created by an earlier chain: its death
    out: list[Recompute] = []
    for before in sorted(groups):
        chain: set[int] = set()

        def available(t: int, before: int = before) -> bool:
            if t in held or persistent[t] or external[t]:
                return True
            if t in drop:
                return remade_until.get(t, -1) >= before
            return int(first[t]) < before <= int(death[t])

        todo = list(groups[before])
        while todo:
            t = todo.pop()
            maker = int(first[t])
            if maker in chain:
                continue
            if phases[maker] != "forward":
                raise PlanError(f"recompute: tensor {t} ({trace.tensors[t].name}) needed by a chain "
                                f"is not made by a forward op")
            chain.add(maker)
            for a in trace.ops[maker].inputs:
                # an input born at the op itself (in place) is the op's own output
                if int(first[a]) != maker and not available(a):
                    todo.append(a)
        for t in groups[before]:
            remade_until[t] = int(death[t])
        out.append(Recompute(tuple(sorted(groups[before])), tuple(sorted(chain)), before))
    return tuple(out)


__all__ = ["recompute_chains"]
