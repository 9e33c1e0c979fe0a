"""What a compiled graph does with each saved activation: keep it, recompute it in the
backward graph, or offload it to the host tier and bring it back before its first
backward use.

:func:`plan_graph` is greedy on the graph's trace (:mod:`tierflow.compiled.graph_trace`):
while the live bytes at the peak op exceed the target, it takes the largest saved
storage whose gap (last forward use, first backward use) spans that op off the device
inside its gap, by one of two means:

* **recompute** when it cannot be offloaded (not dense, or its storage is shared by
  several saved tensors: all of them are recomputed together) or when re-running the
  forward ops that make it from what stays saved (graph_trace's op-time estimate,
  :func:`recompute_s`) costs less than its two copies (``2 * bytes / BYTES_PER_S``);
* **offload** otherwise.

A storage that can be neither (a graph input, a random op's output, returned to the
caller) stays. The plan is a pure function of the facts and the target, so the same
graph and target give the same plan (and the same cache key: :meth:`GraphPlan.key`).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np

from .graph_trace import BYTES_PER_S, GraphFacts, SavedTensor


@dataclass(frozen=True, slots=True)
class GraphPlan:
    """One graph's plan.

    Attributes:
        offload: names of saved tensors to copy to the host tier and back.
        target_bytes: the live bytes the plan aims at (``None``: keep everything).
        predicted_peak_bytes: the trace's peak with the plan (above the step's start).
        unreachable: the target could not be met (what is left on the device at the
            peak is not saved for backward, or can be neither offloaded nor recomputed).
        recompute: names of saved tensors torch's partitioner is to re-make in the
            backward graph instead of saving.
        offload_grads: gradients (the backward graph's outputs) copied to the host
            tier after their last use in the graph and back just before it returns.
    """

    offload: frozenset[str] = frozenset()
    target_bytes: int | None = None
    predicted_peak_bytes: int = 0
    unreachable: bool = False
    slots: dict[str, int] = field(default_factory=dict, compare=False)
    recompute: frozenset[str] = frozenset()
    offload_grads: frozenset[str] = frozenset()

    def key(self) -> str:
        """A digest that changes exactly when the plan does (for torch's caches)."""
        text = ",".join(sorted(self.offload)) + "|recompute:" + ",".join(sorted(self.recompute))
        text += "|grads:" + ",".join(sorted(self.offload_grads))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def copy_s(nbytes: int) -> float:
    """Seconds of an offload's two copies (to the host tier and back)."""
    return 2.0 * nbytes / BYTES_PER_S


def recompute_s(facts: GraphFacts, tensor: int, stays: set[int]) -> float:
    """Estimated seconds to re-make trace tensor ``tensor`` from the tensors in ``stays``
    (saved and not dropped) and the graph's inputs: the sum of the forward ops on the
    way (graph_trace's op times), ``inf`` when a tensor on the way is made by no
    forward op. A multi-output op's outputs are made by their ``getitem``, which the
    trace times as a read of nothing: such a chain is under-estimated."""
    trace = facts.trace
    maker: dict[int, int] = {}
    for i, op in enumerate(trace.ops[: facts.n_fwd]):
        for out in op.outputs:
            maker.setdefault(out, i)
    external, persistent = trace.external, trace.persistent
    need, seen, cost = [tensor], set(), 0.0
    while need:
        t = need.pop()
        if t in seen or (t != tensor and t in stays) or external[t] or persistent[t]:
            continue
        seen.add(t)
        i = maker.get(t)
        if i is None:
            return math.inf
        cost += trace.ops[i].duration_s
        need.extend(trace.ops[i].inputs)
    return cost


def curve_with(facts: GraphFacts, offload: list[SavedTensor]) -> np.ndarray:
    """The facts' live-bytes curve with ``offload`` (offloaded or recomputed tensors) off
    the device inside their gaps, once per storage."""
    curve = facts.curve.copy()
    for s in {s.tensor: s for s in offload}.values():
        if s.first_bwd_use - s.last_fwd_use > 1:
            curve[s.last_fwd_use + 1 : s.first_bwd_use] -= s.bytes
    return curve


def _storages(facts: GraphFacts, min_bytes: int) -> dict[int, list[SavedTensor]]:
    """The saved tensors worth planning, by storage (trace tensor id), each with a gap."""
    groups: dict[int, list[SavedTensor]] = {}
    for s in facts.saved:
        groups.setdefault(s.tensor, []).append(s)
    return {t: g for t, g in groups.items() if g[0].bytes >= min_bytes
            and g[0].first_bwd_use - g[0].last_fwd_use > 1
            and (all(s.recomputable for s in g) or (len(g) == 1 and g[0].offloadable))}


def floor_curve(facts: GraphFacts, min_bytes: int = 1 << 16, *, move_grads: bool = True) -> np.ndarray:
    """The facts' curve with every saved storage a plan may move (:func:`plan_graph`'s
    candidates) and every movable gradient off the device inside its gap: the working
    set no plan of this graph lowers (the tensors an op reads and writes, and what
    can be neither offloaded nor recomputed).

    Args:
        facts: the graph.
        min_bytes: as :func:`plan_graph`'s (smaller storages stay).
        move_grads: count movable gradients as moved, as :func:`plan_graph` may.
    """
    off = [g[0] for g in _storages(facts, min_bytes).values()]
    if move_grads:
        off += [g for g in facts.grads if g.offloadable and g.bytes >= min_bytes
                and g.first_bwd_use - g.last_fwd_use > 1]
    curve = facts.curve.copy()
    for s in off:
        curve[s.last_fwd_use + 1 : s.first_bwd_use] -= s.bytes
    return curve


def plan_graph(facts: GraphFacts, target_bytes: int | None, min_bytes: int = 1 << 16, *,
               allow_recompute: bool = True, move_grads: bool = True) -> GraphPlan:
    """Recompute or offload saved tensors until the trace's peak is at most ``target_bytes``
    (see the module docstring for the choice).

    Args:
        facts: the graph as the planner sees it.
        target_bytes: the live bytes to reach; ``None`` keeps everything.
        min_bytes: smaller tensors are not worth a copy's or a recompute's fixed cost.
        allow_recompute: ``False``: offload only (a storage that cannot be offloaded
            stays). The front-end passes ``False`` under inductor (see
            :func:`tierflow.compiled.compile`).
        move_grads: when no saved storage spans the peak (it is late in the backward
            graph, where the gradients made so far are held), move gradients to the
            host tier inside the graph, largest first.

    Example:
        >>> plan = plan_graph(rec.facts, target_bytes=64 << 20)  # doctest: +SKIP
        >>> sorted(plan.recompute), sorted(plan.offload)  # doctest: +SKIP
    """
    if target_bytes is None:
        return GraphPlan(predicted_peak_bytes=facts.peak_bytes)
    candidates = _storages(facts, min_bytes)
    stays = {s.tensor for s in facts.saved}
    offload: list[str] = []
    recompute: list[str] = []
    curve = facts.curve.copy()
    unreachable = False
    # NOTE: gradients after saved tensors: every moved gradient comes back in the
    # backward graph's last ops, where reloads cannot overlap anything.
    grads = [g for g in facts.grads if move_grads and g.offloadable and g.bytes >= min_bytes
             and g.first_bwd_use - g.last_fwd_use > 1]
    moved_grads: list[str] = []
    while len(curve) and curve.max() > target_bytes:
        peak_op = int(curve.argmax())
        spanning = [t for t, g in candidates.items() if g[0].last_fwd_use < peak_op < g[0].first_bwd_use]
        if not spanning:
            made = [g for g in grads if g.last_fwd_use < peak_op < g.first_bwd_use]
            if not made:
                unreachable = True
                break
            g = max(made, key=lambda g: (g.bytes, g.name))
            grads.remove(g)
            moved_grads.append(g.name)
            curve[g.last_fwd_use + 1 : g.first_bwd_use] -= g.bytes
            continue
        best = max(spanning, key=lambda t: (candidates[t][0].bytes, candidates[t][0].name))
        group = candidates.pop(best)
        head = group[0]
        can_offload = len(group) == 1 and head.offloadable
        can_recompute = allow_recompute and all(s.recomputable for s in group)
        if not (can_offload or can_recompute):
            continue  # stays; the next largest spanning storage is tried
        if can_recompute and (not can_offload or recompute_s(facts, best, stays) < copy_s(head.bytes)):
            recompute.extend(s.name for s in group)
            stays.discard(best)
        else:
            offload.append(head.name)
        curve[head.last_fwd_use + 1 : head.first_bwd_use] -= head.bytes
    return GraphPlan(offload=frozenset(offload), target_bytes=int(target_bytes),
                     predicted_peak_bytes=int(curve.max()) if len(curve) else 0,
                     unreachable=unreachable, recompute=frozenset(recompute),
                     offload_grads=frozenset(moved_grads))
