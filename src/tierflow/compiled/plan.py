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

A gradient the backward graph receives (a tangent) read early and late in the graph,
whose gap spans the peak op, leaves the device first: copied out after its early
readers and back before its late ones
(:class:`~tierflow.compiled.graph_trace.HeldTangent`).

A storage that can be neither (a graph input, a random op's output, returned to the
caller) stays. The plan is a pure function of the facts and the target, so the same
graph and target give the same plan (and the same cache key: :meth:`GraphPlan.key`).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np

from .graph_trace import BYTES_PER_S, GraphFacts, HeldTangent, SavedTensor


@dataclass(frozen=True, slots=True)
class GraphPlan:
    """One graph's plan.

    Attributes:
        offload: names of saved tensors to copy to the host tier and back.
        target_bytes: the live bytes the plan aims at (``None``: keep everything).
        predicted_peak_bytes: the trace's peak with the plan (above the step's start).
        unreachable: the target could not be met at some op (what is left on the device
            there is not saved for backward, or can be neither offloaded nor
            recomputed); the plan still brings every other op to the target.
        recompute: names of saved tensors torch's partitioner is to re-make in the
            backward graph instead of saving.
        offload_grads: gradients (the backward graph's outputs) copied to the host
            tier after their last use in the graph and back just before it returns.
        offload_tangents: gradients the backward graph receives, copied to the host
            tier after their early readers and back before their late ones.
    """

    offload: frozenset[str] = frozenset()
    target_bytes: int | None = None
    predicted_peak_bytes: int = 0
    unreachable: bool = False
    slots: dict[str, int] = field(default_factory=dict, compare=False)
    recompute: frozenset[str] = frozenset()
    offload_grads: frozenset[str] = frozenset()
    offload_tangents: frozenset[str] = frozenset()

    def key(self) -> str:
        """A digest that changes exactly when the plan does (for torch's caches)."""
        text = ",".join(sorted(self.offload)) + "|recompute:" + ",".join(sorted(self.recompute))
        text += "|grads:" + ",".join(sorted(self.offload_grads))
        if self.offload_tangents:  # (absent when empty: other plans keep their keys)
            text += "|tangents:" + ",".join(sorted(self.offload_tangents))
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


def curve_with(facts: GraphFacts, offload: list[SavedTensor], tangents: list[HeldTangent] = ()) -> np.ndarray:
    """The facts' live-bytes curve with ``offload`` (offloaded or recomputed tensors) off
    the device inside their gaps, once per storage, and the received gradients
    ``tangents`` off it between their readers."""
    curve = facts.curve.copy()
    for s in {s.tensor: s for s in offload}.values():
        _drop(curve, [s])
    for t in tangents:
        _drop_tangent(curve, t)
    return curve


def unit_bytes(group: list[SavedTensor]) -> int:
    """Bytes that leave the device when ``group`` (saved tensors of one storage) does."""
    return group[0].group_bytes if group[0].group else group[0].bytes


def unit_offloadable(group: list[SavedTensor]) -> bool:
    """One copy frees the storage: a single dense saved tensor, or a storage group
    (:func:`tierflow.compiled.graph_trace.storage_groups`) offloaded as its base."""
    if group[0].group:
        return all(s.offloadable for s in group)
    return len(group) == 1 and group[0].offloadable


def _storages(facts: GraphFacts, min_bytes: int) -> dict[int | str, list[SavedTensor]]:
    """The saved tensors worth planning, by storage (trace tensor id, or the group's
    base for views that leave together), each with a gap."""
    groups: dict[int | str, list[SavedTensor]] = {}
    for s in facts.saved:
        groups.setdefault(s.group or s.tensor, []).append(s)
    return {t: g for t, g in groups.items() if unit_bytes(g) >= min_bytes
            and g[0].first_bwd_use - g[0].last_fwd_use > 1
            and (all(s.recomputable for s in g) or unit_offloadable(g))}


def _drop(curve: np.ndarray, group: list[SavedTensor]) -> None:
    """Take ``group`` off ``curve`` inside its gap, once per trace tensor."""
    head = group[0]
    if head.first_bwd_use - head.last_fwd_use > 1:
        for s in {s.tensor: s for s in group}.values():
            curve[head.last_fwd_use + 1 : head.first_bwd_use] -= s.bytes


def movable_grads(facts: GraphFacts, min_bytes: int = 1 << 16) -> list[SavedTensor]:
    """The gradients a plan may move out inside the backward graph: offloadable, of
    ``min_bytes`` or more, with at least one op in their gap."""
    return [g for g in facts.grads
            if g.offloadable and g.bytes >= min_bytes and g.first_bwd_use - g.last_fwd_use > 1]


def movable_tangents(facts: GraphFacts, min_bytes: int = 1 << 16) -> list[HeldTangent]:
    """The received gradients a plan may move: offloadable, of ``min_bytes`` or more,
    with at least one op in their gap."""
    out = []
    for t in facts.tangents:
        if t.offloadable and t.bytes >= min_bytes and t.first_late_use - t.last_early_use > 1:
            out.append(t)
    return out


def _drop_tangent(curve: np.ndarray, t: HeldTangent) -> None:
    for lo, hi in t.off_device(len(curve)):
        curve[lo:hi] -= t.bytes


def floor_curve(facts: GraphFacts, min_bytes: int = 1 << 16, *, move_grads: bool = True,
                move_tangents: bool = True) -> np.ndarray:
    """The facts' curve with every saved storage a plan may move (:func:`plan_graph`'s
    candidates) and every movable gradient off the device inside its gap: the working
    set no plan of this graph lowers (the tensors an op reads and writes, and what
    can be neither offloaded nor recomputed).

    Args:
        facts: the graph.
        min_bytes: as :func:`plan_graph`'s (smaller storages stay).
        move_grads: count movable gradients as moved, as :func:`plan_graph` may.
        move_tangents: count received gradients read early and late as moved
            (:func:`movable_tangents`), as :func:`plan_graph` may.
    """
    curve = facts.curve.copy()
    for group in _storages(facts, min_bytes).values():
        _drop(curve, group)  # (a storage group's every view: its first view's bytes alone left 4 MiB per GPT-2 layer)
    if move_grads:
        for g in movable_grads(facts, min_bytes):
            curve[g.last_fwd_use + 1 : g.first_bwd_use] -= g.bytes
    for t in movable_tangents(facts, min_bytes) if move_tangents else ():
        _drop_tangent(curve, t)
    return curve


def plan_graph(facts: GraphFacts, target_bytes: int | None, min_bytes: int = 1 << 16, *,
               allow_recompute: bool = True, move_grads: bool = True, move_tangents: bool = True) -> GraphPlan:
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
        move_tangents: move the received gradients held through the peak between
            their readers (:func:`movable_tangents`).

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
    grads = movable_grads(facts, min_bytes) if move_grads else []
    moved_grads: list[str] = []
    # NOTE: received gradients first: one held through a peak between two readers
    # costs the two copies an offload costs, and nothing can be recomputed instead.
    tangents = movable_tangents(facts, min_bytes) if move_tangents else []
    moved_tangents: list[str] = []
    # Ops whose excess nothing can lower (the loss's working set between forward and
    # backward, say): set aside, so that the rest of the curve is still brought to the
    # target (stopping at the first one left the backward's peak where it was).
    stuck = np.zeros(len(curve), dtype=bool)
    while len(curve) and np.where(stuck, 0, curve).max() > target_bytes:
        peak_op = int(np.where(stuck, np.iinfo(np.int64).min, curve).argmax())
        held = [t for t in tangents if any(lo <= peak_op < hi for lo, hi in t.off_device(len(curve)))]
        if held:
            t = max(held, key=lambda t: (t.bytes, t.name))
            tangents.remove(t)
            moved_tangents.append(t.name)
            _drop_tangent(curve, t)
            continue
        spanning = [t for t, g in candidates.items() if g[0].last_fwd_use < peak_op < g[0].first_bwd_use]
        if not spanning:
            made = [g for g in grads if g.last_fwd_use < peak_op < g.first_bwd_use]
            if not made:
                unreachable = True
                stuck[peak_op] = True
                continue
            g = max(made, key=lambda g: (g.bytes, g.name))
            grads.remove(g)
            moved_grads.append(g.name)
            curve[g.last_fwd_use + 1 : g.first_bwd_use] -= g.bytes
            continue
        best = max(spanning, key=lambda t: (unit_bytes(candidates[t]), candidates[t][0].name))
        group = candidates.pop(best)
        head = group[0]
        can_offload = unit_offloadable(group)
        can_recompute = allow_recompute and all(s.recomputable for s in group)
        if not (can_offload or can_recompute):
            continue  # stays; the next largest spanning storage is tried
        if can_recompute and (not can_offload or recompute_s(facts, head.tensor, stays) < copy_s(unit_bytes(group))):
            recompute.extend(s.name for s in group)
            stays.difference_update(s.tensor for s in group)
        else:
            offload.extend(s.name for s in group)
        _drop(curve, group)
    return GraphPlan(offload=frozenset(offload), target_bytes=int(target_bytes),
                     predicted_peak_bytes=int(curve.max()) if len(curve) else 0,
                     unreachable=unreachable, recompute=frozenset(recompute),
                     offload_grads=frozenset(moved_grads), offload_tangents=frozenset(moved_tangents))
