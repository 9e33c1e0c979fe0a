"""The plan a run follows, as one record: the trace and machine model it was made for,
the plan, and every per-op table the executor builds from them.

``Profiling._make_plan`` builds one; ``Run._take_plan`` (executor.py) is the one place
that makes a record the run's, and the plan cache (runtime/signatures.py) keeps a
record per signature and hands it back to ``_take_plan`` when the signature returns. A
change to a followed plan (its prediction made again, its host steps taken up again)
is a new record (:func:`dataclasses.replace`), never a field written in place, so a
record the cache keeps is never half of two plans.

``Run`` keeps each field as an attribute of its own (``run.trace``, ``run._optab``, ...),
written only by ``_take_plan``: the lean path reads them once per op, and an attribute of
``self`` is one lookup where a field of a held record is two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..hardware import Hardware
from ..plan import Plan
from ..trace import Trace


@dataclass(frozen=True)
class FollowedPlan:
    """One plan as the executor follows it.

    Args:
        trace: the trace the plan was made for (the coarse one where it is followed at
            ticks; after the first followed iterations, the re-timed one).
        plan: the policy's plan.
        hardware: the machine model the plan was made and simulated for.
        prediction: the simulator's result for the plan (None where it failed).
        hook: the ``HookFollower`` where the plan is followed at ticks, else None.
        actions: per op, the moves fired after it (``PlanFollowing._move_table``).
        start_away: persistent tensors (by key) the plan starts an iteration without,
            and the runtime tier they are on.
        external_tids: the trace's external tensors.
        held_baseline: bytes the loop held when the plan's iteration was profiled.
        retimer: the plan's ``Retimer`` (runtime/retime.py).
        recomputer: the plan's ``Recomputer`` (runtime/recompute.py).
        n_ops: ops the follower steps through.
        n_tensors: tensors of the trace.
        funcs: each op's function (None for a merged segment).
        out_sizes: each op's result sizes, as profiled.
        bind_in: per op, which arguments get trace ids (None: none).
        bind_out: per op, which results get trace ids (None: none).
        op_labels: each op's ``name#index``, for messages.
        next_op: per op, the next op the device runs (host steps skip theirs).
        has_moves: per op, whether ``actions`` has any.
        key_tid: persistent tensors' trace ids by key.
        born: per op, bytes of the temporaries it makes.
        optab: the lean path's per-op row (``Run._follow_op``).

    Example:
        >>> from dataclasses import fields
        >>> [f.name for f in fields(FollowedPlan)][:3]
        ['trace', 'plan', 'hardware']
    """

    trace: Trace
    plan: Plan
    hardware: Hardware
    prediction: Any
    hook: Any
    actions: list[tuple]
    start_away: dict[str, str]
    external_tids: frozenset[int]
    held_baseline: int
    retimer: Any
    recomputer: Any
    n_ops: int
    n_tensors: int
    funcs: list
    out_sizes: list
    bind_in: list
    bind_out: list
    op_labels: list[str]
    next_op: list[int]
    has_moves: list[bool]
    key_tid: dict[str, int]
    born: list[int]
    optab: list[tuple]


__all__ = ["FollowedPlan"]
