"""Ticks and segments: the points between ops where a hook-driven runtime can act, and
the trace coarsened to them (the first step of the steady state decided in
docs/runtime.md, "The steady state on a GPU").

Why. A followed iteration that runs every aten op through a Python dispatch mode is
host-bound on a GPU (the H200 timelines: the GPU busy 25-44% of a planned step, waiting
for launches). Without the mode the runtime can still act at *ticks*, the hooks PyTorch
calls anyway or cheaply: a module's forward pre- and post-hooks, the saved-tensor pack
hook (forward) and unpack hook (backward, right before the node that reads the tensor),
and a parameter's post-accumulate-grad hook. A plan made for such a runtime must put
every action at a tick, and may move only the tensors a tick hands it. The planner sees
that when the trace it plans from is *coarsened*: one op per segment (the ops between
two ticks), and no gap in the life of a tensor no tick can reach.

What is recorded. While the profiled iteration runs, :class:`TickLog` notes each tick
with the index of the op it comes before (the number of ops recorded so far): module
``enter``/``leave`` with the module's path, ``pack`` with the saved tensor's ordinal
(the key ``saved:N`` the runtime gives that activation), ``unpack`` with the unpacked
storage's key, and ``grad`` with the parameter's name (key ``grad:NAME``). The trace
keeps them in ``meta["ticks"]`` as ``[op, kind, ident]``.

How a trace is coarsened (:func:`coarsen`). Segment boundaries are the ops a tick came
before, in the forward and backward phases, and every phase change; the optimizer's ops
stay one segment each (the runtime steps the optimizer through the dispatch mode, in
chunks). A coarse op lists the inputs and outputs of its ops and takes their summed
time. A tensor a tick cannot reach (an activation autograd does not save, a temporary)
is listed as used by every segment from its first to its last use, so it has no gap
and no plan moves it; a saved activation or a gradient is so listed until the segment
of the tick that hands it over (``pack``, ``grad``), after which its gaps are its own.
Parameters, optimizer state and the loop's tensors are reached by key, as now.

Limits. Ticks that fire inside an op (a hook run from C++ while the op is under way)
are placed at the op boundary the log saw, which is where the mode recorded them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..trace import Op, Trace

#: the tick kinds a hook-driven follower can act at
TICK_KINDS = ("enter", "leave", "pack", "unpack", "grad")
#: phases whose ops are merged into segments (the optimizer runs op by op)
MERGED_PHASES = ("forward", "backward")


class TickLog:
    """The ticks of one profiled iteration: ``(op, kind, ident)``, ``op`` the index of
    the recorded op the tick came before.

    Args:
        ops_so_far: how many ops the iteration has recorded now (called at each tick).
        paths: module id -> its path in the model (modules not in it are not ticks).
    """

    def __init__(self, ops_so_far: Any, paths: dict[int, str]):
        self._ops_so_far = ops_so_far
        self._paths = paths
        self.ticks: list[tuple[int, str, str]] = []
        self._handles: list[Any] = []

    def note(self, kind: str, ident: str) -> None:
        self.ticks.append((self._ops_so_far(), kind, ident))

    def start(self) -> None:
        """Listen to every module call (global forward hooks), until :meth:`stop`."""
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self.stop()
        paths = self._paths

        def enter(mod: Any, _args: Any) -> None:
            path = paths.get(id(mod))
            if path is not None:
                self.note("enter", path)

        def leave(mod: Any, _args: Any, _out: Any) -> None:
            path = paths.get(id(mod))
            if path is not None:
                self.note("leave", path)

        self._handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]

    def stop(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def for_trace(self, kept: list[int]) -> list[list[Any]]:
        """The ticks with their op indices in the trace, whose ops are the recorded ops
        ``kept`` (ascending; the runtime leaves out the ops its own hooks caused): a tick
        before recorded op ``j`` comes before the first kept op at or after ``j``."""
        import bisect

        return [[bisect.bisect_left(kept, j), kind, ident] for j, kind, ident in self.ticks]


@dataclass(frozen=True)
class Coarse:
    """A trace coarsened to segments.

    Attributes:
        trace: one op per segment, the same tensors (ids) as the fine trace.
        starts: each segment's first fine op; ``starts[k + 1]`` ends segment ``k``.
        segment_of: fine op index -> its segment.
        unreachable: tensors no tick can reach (no gaps in ``trace``).
        bound_at: tensor id -> the segment from which a tick has handed it over (a
            saved activation, a gradient; absent for the rest).
    """

    trace: Trace
    starts: tuple[int, ...]
    segment_of: np.ndarray
    unreachable: frozenset[int]
    bound_at: dict[int, int]

    @property
    def n_segments(self) -> int:
        return self.trace.n_ops


def boundaries(trace: Trace, ticks: Iterable[Any]) -> list[int]:
    """Each segment's first op: 0, the ops a tick came before (forward and backward),
    every phase change, and every op outside :data:`MERGED_PHASES`."""
    n = trace.n_ops
    cut = {0}
    for op, _kind, _ident in ticks:
        if 0 < op < n and trace.ops[op].phase in MERGED_PHASES:
            cut.add(int(op))
    for i in range(1, n):
        prev, cur = trace.ops[i - 1].phase, trace.ops[i].phase
        if cur != prev or cur not in MERGED_PHASES or prev not in MERGED_PHASES:
            cut.add(i)
    return sorted(cut)


def _bind_ops(trace: Trace, ticks: Iterable[Any]) -> dict[int, int]:
    """Tensor id -> the first op whose tick hands it to the runtime: a saved
    activation's ``pack``, a gradient's ``grad``."""
    by_key = {t.key: t.id for t in trace.tensors if t.key}
    out: dict[int, int] = {}
    for op, kind, ident in ticks:
        key = f"saved:{ident}" if kind == "pack" else f"grad:{ident}" if kind == "grad" else None
        tid = by_key.get(key) if key is not None else None
        if tid is not None and tid not in out:
            out[tid] = int(op)
    return out


def coarsen(trace: Trace, ticks: Iterable[Any] | None = None) -> Coarse:
    """``trace`` with one op per segment between ticks (see the module docstring).

    Args:
        trace: a trace from the runtime's profiled iteration.
        ticks: ``[op, kind, ident]`` per tick (default: ``trace.meta["ticks"]``).

    Returns:
        :class:`Coarse`. Every plan valid for its trace acts only at ticks, on tensors
        a tick reaches.
    """
    ticks = list(trace.meta.get("ticks", ()) if ticks is None else ticks)
    starts = boundaries(trace, ticks)
    n, n_seg = trace.n_ops, len(starts)
    segment_of = np.zeros(n, dtype=np.int64)
    for k, s in enumerate(starts):
        segment_of[s:] = k
    bind = _bind_ops(trace, ticks)
    first, last = trace.first_use, trace.last_use
    unreachable: set[int] = set()
    bound_at: dict[int, int] = {}
    extra: list[list[int]] = [[] for _ in range(n_seg)]  # forced uses: segment -> tensors
    for t in trace.tensors:
        if t.persistent or t.external or t.kind == "input":
            continue  # reached by key, or never moved
        if first[t.id] < 0:
            continue
        a, b = int(segment_of[first[t.id]]), int(segment_of[last[t.id]])
        if t.id in bind and bind[t.id] < n:
            # (through the segment of its tick: the tick binds it, the moves come after)
            k = int(segment_of[bind[t.id]])
            bound_at[t.id] = k
            b = min(b, k) if k >= a else a
        else:
            unreachable.add(t.id)
        for k in range(a, b + 1):
            extra[k].append(t.id)
    ops: list[Op] = []
    for k, s in enumerate(starts):
        e = starts[k + 1] if k + 1 < n_seg else n
        fine = trace.ops[s:e]
        ins = dict.fromkeys(x for o in fine for x in o.inputs)
        outs = dict.fromkeys(x for o in fine for x in o.outputs)
        for x in extra[k]:
            if x not in outs:
                ins.setdefault(x, None)
        first_op = fine[0]
        if len(fine) == 1:
            ops.append(replace(first_op, inputs=tuple(ins), outputs=tuple(outs)))
            continue
        scopes = {o.scope for o in fine}
        ops.append(Op(f"segment[{s}:{e}]", first_op.phase, float(sum(o.duration_s for o in fine)),
                      tuple(ins), tuple(outs), scope=scopes.pop() if len(scopes) == 1 else None,
                      rng=any(o.rng for o in fine), pure=all(o.pure for o in fine)))
    tensors = tuple(t if t.held_until is None else replace(t, held_until=int(segment_of[t.held_until]))
                    for t in trace.tensors)
    meta = {k: v for k, v in trace.meta.items() if k != "ticks"}
    meta["coarsened"] = {"ops": n, "segments": n_seg, "unreachable": len(unreachable)}
    coarse = Trace(tuple(ops), tensors, name=trace.name, meta=meta)
    return Coarse(coarse, tuple(starts), segment_of, frozenset(unreachable), bound_at)


__all__ = ["MERGED_PHASES", "TICK_KINDS", "Coarse", "TickLog", "boundaries", "coarsen"]
