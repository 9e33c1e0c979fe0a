"""The partitioner hook: where tierflow's plan enters a compiled graph.

AOT autograd traces a joint forward+backward graph and a *partitioner* splits it into
the forward and backward graphs, choosing what the forward saves. :class:`PlanPartitioner`
is that partitioner: it runs torch's own (``min_cut_rematerialization_partition``) on a
copy first, to see the saved set torch would choose (:mod:`tierflow.compiled.graph_trace`),
asks its planner for a plan (:mod:`tierflow.compiled.plan`), tags the joint graph's nodes
of the tensors the plan recomputes ``MUST_RECOMPUTE`` (torch's min-cut honours the tag:
:func:`tag_recompute`), partitions the real graph, reads back which of them really left
the saved set, then rewrites the two halves for the offloaded ones: each offloaded tensor goes through ``tierflow::offload``
after its last forward use (the forward saves the op's token instead of the tensor) and
comes back through ``tierflow::prefetch``, which starts the copy back ahead of its first
backward use where :func:`tierflow.compiled.prefetch.prefetch_points` puts it, and
``tierflow::wait`` at that use (:mod:`tierflow.compiled.ops`).

With inductor it is installed as ``torch._inductor.config.custom_partitioner_fn``, which
receives the joint graph after inductor's joint passes; :meth:`PlanPartitioner.uuid`
keys torch's FX graph cache on the plan, so a new plan recompiles and the same plan
hits. For other AOT backends the same object is ``aot_autograd``'s ``partition_fn``.

Private torch APIs used here: ``min_cut_rematerialization_partition`` and inductor's
``CustomPartitionerFn``. :func:`hook_support` says whether they exist in this torch;
the front-end falls back to the eager runtime when they do not.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from .graph_trace import (
    GraphFacts,
    TangentSplit,
    alias_chain,
    graph_facts,
    hint_int,
    hinted_order,
    is_random,
    is_view,
    storage_groups,
    storage_maker,
    tangent_split,
)
from .plan import GraphPlan

_warned_untagged = False


def hook_support() -> str | None:
    """``None`` when this torch has what the hook needs, else what is missing."""
    try:
        from torch._functorch.partitioners import min_cut_rematerialization_partition  # noqa: F401
        from torch._inductor import config as inductor_config
        from torch._inductor.custom_graph_pass import CustomPartitionerFn  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure means: not this torch
        return f"torch {torch.__version__} lacks the partitioner hook ({e})"
    if not hasattr(inductor_config, "custom_partitioner_fn"):
        return f"torch {torch.__version__} has no torch._inductor.config.custom_partitioner_fn"
    return None


def _base_class() -> type:
    try:
        from torch._inductor.custom_graph_pass import CustomPartitionerFn

        return CustomPartitionerFn
    except Exception:  # noqa: BLE001 - an older torch: the aot_autograd path only
        return object


@dataclass
class PartitionRecord:
    """What one partition did, for stats.

    Attributes:
        facts: the graph as torch would have partitioned it.
        plan: the plan applied.
        offloaded: saved tensors rewritten to go through the host tier.
        slots: the back-end slot of each.
        saved_after: bytes the forward saves after the rewrite (tokens count 0).
        recomputed: names of the saved set torch would have chosen (``facts.saved``)
            that the real partition left out (torch re-makes them in the backward graph):
            the plan's recompute names torch honoured, and what it took along with them.
        saved_count_after: saved tensors of the real partition (before the offload
            rewrite; recompute may add tensors at its frontier).
        grads_offloaded: gradients rewritten to go through the host tier inside the
            backward graph: their slot and bytes.
        slot_bytes: bytes a slot moves where they are not its saved tensor's own: a
            storage several saved views share (attention's q, k and v split from one
            projection) moves once, as its base, under the first view's name (the
            other views are in ``offloaded`` but own no slot).
        prefetch_ops: per offloaded saved tensor, the backward ops between the start of
            its copy back and its first use (0: the copy starts at the use).
        prefetch_peak_bytes: the real partition's live-bytes peak on its trace with the
            offloads and every prefetch counted from its start
            (:func:`tierflow.compiled.prefetch.prefetch_points`).
        tags_dropped: partitioning with the recompute tags failed, the graph was
            partitioned without them.
        real: the real partition as a trace (before the offload rewrite): the basis
            of ``GraphReport.predicted_peak_bytes_planned``.
        prefetch_start: per copy back started ahead of its first use, the op of
            ``real``'s trace it starts at.
        tangents_moved: gradients the backward graph receives that it copies to the host
            tier after their early readers and back before their late ones
            (:func:`rewrite_tangents`): their slot and bytes.
    """

    facts: GraphFacts
    plan: GraphPlan
    offloaded: list[str] = field(default_factory=list)
    slots: dict[str, int] = field(default_factory=dict)
    saved_after: int = 0
    recomputed: list[str] = field(default_factory=list)
    saved_count_after: int = 0
    tags_dropped: bool = False
    grads_offloaded: dict[str, tuple[int, int]] = field(default_factory=dict)
    slot_bytes: dict[str, int] = field(default_factory=dict)
    prefetch_ops: dict[str, int] = field(default_factory=dict)
    prefetch_peak_bytes: int = 0
    real: GraphFacts | None = None
    prefetch_start: dict[str, int] = field(default_factory=dict)
    tangents_moved: dict[str, tuple[int, int]] = field(default_factory=dict)


_PLAN_FILES = ("hook.py", "graph_trace.py", "plan.py", "ops.py", "frontend.py", "memo.py", "prefetch.py")


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def _fake(op: Any, *args: Any) -> Any:
    """The op's fake output for FX meta: fake inputs dispatch to the fake kernel."""
    return op(*args)


class PlanPartitioner(_base_class()):  # type: ignore[misc]
    """Partition a joint graph with a tierflow plan.

    Args:
        decide: the planner: given the graph's facts, the plan.
        key: what the plan depends on beyond the graph (the budget target), for
            :meth:`uuid`.
        on_partition: receives each :class:`PartitionRecord`.
    """

    #: Device types whose offloaded tensors come back through ``prefetch`` + ``wait``
    #: (the copy started ahead of the first use); elsewhere one ``reload`` at the use.
    #: CUDA only by default: on the CPU a copy is synchronous, so starting it early
    #: overlaps nothing, and the split measured a higher inductor peak there (docs/compiled.md).
    prefetch_devices: tuple[str, ...] = ("cuda",)

    def __init__(self, decide: Callable[[GraphFacts], GraphPlan], key: str,
                 on_partition: Callable[[PartitionRecord], None], slot_base: int = 0,
                 fused_addmm: bool = False) -> None:
        self.decide = decide
        self.key = key
        self.on_partition = on_partition
        self.slot_base = slot_base
        # inductor's backend: its add(mm) -> addmm fusion runs the product at the add
        # (see sink_fused_matmuls); the trace must see it there
        self.fused_addmm = fused_addmm

    def uuid(self) -> Any:
        """The cache key: the plan's inputs beyond the graph, and this package's code."""
        from pathlib import Path

        here = Path(__file__).parent
        try:
            from torch._inductor.custom_graph_pass import get_hash_for_files

            code = get_hash_for_files(tuple(str(here / f) for f in _PLAN_FILES)).hex()[:16]
        except Exception:  # noqa: BLE001 - an older torch: key on the plan alone
            code = "nocode"
        return f"tierflow-plan:{self.key}:{code}:prefetch={','.join(self.prefetch_devices)}"

    def __reduce__(self) -> tuple[Any, ...]:
        # Inductor pickles its config for cache keys; the partitioner stands there as
        # its uuid (the planner and callbacks it holds are not picklable).
        return (str, (self.uuid(),))

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        kwargs.setdefault("compiler", "inductor")
        n_out = kwargs["num_fwd_outputs"]
        dry_fwd, dry_bwd = min_cut_rematerialization_partition(_copy(gm), joint_inputs, **kwargs)
        hoist_saved_views(dry_fwd, n_out)
        if self.fused_addmm:
            sink_fused_matmuls(dry_bwd)
        facts = graph_facts(dry_fwd, dry_bwd, n_out)
        plan = self.decide(facts)
        record = PartitionRecord(facts, plan)
        fwd, bwd = self._partition(gm, joint_inputs, kwargs, plan, record)
        hoist_saved_views(fwd, n_out)
        if self.fused_addmm:
            sink_fused_matmuls(bwd)
        real = graph_facts(fwd, bwd, n_out)
        still = {s.name for s in real.saved}
        # Torch re-makes what the tags ask for and may take more along (a layer norm's
        # mean and rstd with its output): every name of the unplanned saved set gone.
        record.recomputed = sorted(s.name for s in facts.saved if s.name not in still)
        record.saved_count_after = len(real.saved)
        record.real = real
        if plan.offload or plan.offload_grads or plan.offload_tangents:
            self._rewrite(fwd, bwd, n_out, plan, record, real)
        out = list(fwd.graph.find_nodes(op="output")[0].args[0])
        record.saved_after = sum(
            _bytes(n) for n in out[n_out:] if isinstance(n, fx.Node) and n.target is not torch.ops.tierflow.offload.default
        )
        self.on_partition(record)
        return fwd, bwd

    def _partition(self, gm: fx.GraphModule, joint_inputs: Any, kwargs: dict[str, Any], plan: GraphPlan,
                   record: PartitionRecord) -> tuple[fx.GraphModule, fx.GraphModule]:
        """The real partition, with the plan's recompute tags when it has some.

        The tags go on a copy, so a partition that fails with them (a tag torch's
        min-cut cannot honour) leaves ``gm`` as it came for the untagged retry."""
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        global _warned_untagged
        if plan.recompute:
            tagged = _copy(gm)
            if tag_recompute(tagged, plan.recompute):
                try:
                    return min_cut_rematerialization_partition(tagged, joint_inputs, **kwargs)
                except Exception as e:  # noqa: BLE001 - any failure: partition without the tags
                    record.tags_dropped = True
                    if not _warned_untagged:
                        _warned_untagged = True
                        warnings.warn(f"tierflow compiled: partitioning with recompute tags failed ({type(e).__name__}: {e}); "
                                      "partitioned without them (the plan's recomputes are kept)", RuntimeWarning, stacklevel=3)
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    def _rewrite(self, fwd: fx.GraphModule, bwd: fx.GraphModule, n_out: int, plan: GraphPlan,
                 record: PartitionRecord, real: GraphFacts) -> None:
        from . import ops  # noqa: F401 - registers the tierflow:: ops
        from .prefetch import prefetch_points

        output = fwd.graph.find_nodes(op="output")[0]
        outs = list(output.args[0])
        user_out = {n for n in outs[:n_out] if isinstance(n, fx.Node)}
        position = {n: i for i, n in enumerate(fwd.graph.nodes)}
        bwd_placeholders = {n.name: n for n in bwd.graph.find_nodes(op="placeholder")}
        # storages saved only through views go first, whole (graph_trace.storage_groups)
        grouped = _shared_storages(outs, n_out, plan.offload)
        for base, members in grouped.items():
            _offload_storage(fwd, bwd, base, members, outs, self.slot_base, record)
        in_group = {i for members in grouped.values() for i in members}
        todo: dict[int, tuple[int, ...]] = {}  # output index -> dense order, of each to offload
        for i in range(n_out, len(outs)):
            x = outs[i]
            if not isinstance(x, fx.Node) or x.name not in plan.offload or x in user_out:
                continue
            if i in in_group or any(outs[j] is x for j in todo) or x.name not in bwd_placeholders:
                continue
            val = x.meta.get("val")
            order = hinted_order(val) if isinstance(val, torch.Tensor) else None
            if order is not None:
                todo[i] = order
        # The copies back start where prefetch_points puts them on the real partition's
        # trace: its backward ops are the backward graph's call_function nodes, in order.
        known = {s.name for s in real.saved}
        ahead = any(outs[i].meta["val"].device.type in self.prefetch_devices for i in todo)
        prefetch = prefetch_points(real, [outs[i].name for i in todo if outs[i].name in known], plan.target_bytes,
                                   **({} if ahead else {"bytes_per_s": math.inf}))  # (inf: each at its use)
        bwd_ops = [n for n in bwd.graph.nodes if n.op == "call_function"]
        for i, order in todo.items():
            x = outs[i]
            val = x.meta["val"]
            users = [u for u in x.users if u.op != "output"]
            last_use = max(users, key=lambda u: position[u]) if users else x
            slot = self.slot_base + i
            tok = _insert_offload(fwd.graph, last_use, x, slot)
            outs[i] = tok
            p = bwd_placeholders[x.name]
            bwd_order = {n: k for k, n in enumerate(bwd.graph.nodes)}
            first = min(p.users, key=lambda u: bwd_order[u], default=None)
            if first is None:
                continue
            after = _sequencer(bwd, first, bwd_order)
            if after is None:  # nothing computed before its first use: no gap to save
                outs[i] = x
                fwd.graph.erase_node(tok)
                continue
            if val.device.type not in self.prefetch_devices:
                back = _insert_reload(bwd.graph, first, p, tok.meta["val"], after, order, val)
                p.replace_all_uses_with(back, delete_user_cb=lambda u, back=back: u is not back)
                p.meta["val"] = tok.meta["val"]
                p.meta.pop("tensor_meta", None)
                record.offloaded.append(x.name)
                record.slots[x.name] = slot
                record.prefetch_ops[x.name] = 0
                continue
            begin = first
            k = prefetch.start.get(x.name, real.n_fwd + len(bwd_ops)) - real.n_fwd
            if 0 <= k < len(bwd_ops) and bwd_order[bwd_ops[k]] < bwd_order[first]:
                begin = bwd_ops[k]
            started = _insert_prefetch(bwd.graph, begin, p, tok.meta["val"], _sequencer(bwd, begin, bwd_order), order, val)
            done = _insert_wait(bwd.graph, first, started, p, after)
            p.replace_all_uses_with(started, delete_user_cb=lambda u, ours=(started, done): u not in ours)
            p.meta["val"] = tok.meta["val"]
            p.meta.pop("tensor_meta", None)
            record.offloaded.append(x.name)
            record.slots[x.name] = slot
            record.prefetch_ops[x.name] = sum(1 for n in bwd_ops if bwd_order[begin] <= bwd_order[n] < bwd_order[first])
            if begin is not first:
                record.prefetch_start[x.name] = prefetch.start[x.name]
        record.prefetch_peak_bytes = int(prefetch.curve.max()) if len(prefetch.curve) else 0
        output.args = (tuple(outs),)
        if plan.offload_tangents:
            rewrite_tangents(bwd, plan.offload_tangents, self.slot_base, record)
        if plan.offload_grads:
            _rewrite_grads(bwd, plan.offload_grads, self.slot_base, record)
        fwd.graph.lint()
        bwd.graph.lint()
        fwd.recompile()
        bwd.recompile()


def _shared_storages(outs: list[Any], n_out: int, names: frozenset[str]) -> dict[fx.Node, list[int]]:
    """The storage groups (:func:`graph_trace.storage_groups`) whose saved views are all
    in ``names``: no view's copy alone would free the storage."""
    return {base: members for base, members in storage_groups(outs, n_out).items()
            if all(outs[i].name in names for i in members)}


def _offload_storage(fwd: fx.GraphModule, bwd: fx.GraphModule, base: fx.Node, members: list[int],
                     outs: list[Any], slot_base: int, record: PartitionRecord) -> bool:
    """Offload ``base``'s storage once for the saved views ``outs[members]`` of it: the
    forward copies ``base`` out after the last use of any view of it and saves the token
    in each view's place; the backward reloads ``base`` before the first use of any of
    them and re-makes each view from it (the same view ops on a tensor with the same
    strides: the same elements at the same places). Whether it was done."""
    xs = [outs[i] for i in members]
    placeholders = {n.name: n for n in bwd.graph.find_nodes(op="placeholder")}
    ps = [placeholders.get(x.name) for x in xs]
    if any(p is None for p in ps):
        return False
    bwd_order = {n: k for k, n in enumerate(bwd.graph.nodes)}
    firsts = [min(p.users, key=lambda u: bwd_order[u]) for p in ps if p.users]
    if not firsts:
        return False
    first = min(firsts, key=lambda u: bwd_order[u])
    after = _sequencer(bwd, first, bwd_order)
    if after is None:
        return False
    position = {n: k for k, n in enumerate(fwd.graph.nodes)}
    aliases = [n for n in fwd.graph.nodes if n.op == "call_function" and storage_maker(n) is base]
    readers = [u for a in aliases for u in a.users if u.op != "output"]
    last_use = max([base, *aliases, *readers], key=lambda u: position[u])
    order = hinted_order(base.meta["val"])
    slot = slot_base + members[0]
    tok = _insert_offload(fwd.graph, last_use, base, slot)
    back = _insert_reload(bwd.graph, first, ps[0], tok.meta["val"], after, order, base.meta["val"])
    for x, p in zip(xs, ps, strict=True):
        made = _replay(bwd.graph, alias_chain(x, base) or [], back, first)
        p.replace_all_uses_with(made, delete_user_cb=lambda u, back=back: u is not back)
        p.meta["val"] = tok.meta["val"]
        p.meta.pop("tensor_meta", None)
    for i in members:
        outs[i] = tok
    record.offloaded.extend(x.name for x in xs)
    record.slots[xs[0].name] = slot
    record.slot_bytes[xs[0].name] = _bytes(base)
    return True


def hoist_saved_views(fwd: fx.GraphModule, n_out: int) -> int:
    """Move each saved view to right after what it is made from; how many moved.

    The partitioner makes the views the backward reads (a reshape of a matrix product's
    output, say) at the end of the forward graph, so their base looks used to the end
    and could never leave the device in between. A view computes nothing and reads only
    its inputs' metadata: made early, its base's last real use is where the plan may take
    it off the device (the offload op copies the view's elements)."""
    outs = [n for n in fwd.graph.find_nodes(op="output")[0].args[0][n_out:] if isinstance(n, fx.Node)]
    saved = set(outs)
    moved = 0
    # NOTE: positions are kept as floats and a moved node takes the midpoint between its
    # anchor and the anchor's next node, so the order is read once, not per view.
    order: dict[fx.Node, float] = {n: float(i) for i, n in enumerate(fwd.graph.nodes)}
    for node in list(fwd.graph.nodes):  # graph order: a view's view moves after it
        if node not in saved or node.op != "call_function" or not is_view(node) or not node.all_input_nodes:
            continue
        anchor = max(node.all_input_nodes, key=lambda n: order[n])
        if anchor.next is not node:
            order[node] = (order[anchor] + order[anchor.next]) / 2.0
            anchor.append(node)
            moved += 1
    if moved:
        fwd.graph.lint()
        fwd.recompile()
    return moved


def _backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The joint graph's backward: every node that reads a tangent, directly or not."""
    out: set[fx.Node] = set()
    for node in graph.nodes:  # topological: a node's inputs come first
        if (node.op == "placeholder" and node.name.startswith("tangents")) \
                or node.meta.get("partitioner_tag") == "is_backward" \
                or any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _recompute_unit(node: fx.Node) -> list[fx.Node]:
    """The nodes to tag together for ``node`` to be re-made: it, the views down to their
    base, and a multi-output op with all its ``getitem`` outputs (torch's partitioner
    fails on a view recomputed from a saved base, or a half-recomputed tuple)."""
    import operator

    unit: list[fx.Node] = []
    while True:
        unit.append(node)
        if node.op != "call_function" or not node.all_input_nodes:
            break
        if node.target is operator.getitem:
            maker = node.all_input_nodes[0]
            unit.append(maker)
            unit.extend(u for u in maker.users if u.target is operator.getitem)
            break
        if not is_view(node):
            break
        node = node.all_input_nodes[0]
    return list(dict.fromkeys(unit))


def tag_recompute(gm: fx.GraphModule, names: frozenset[str]) -> list[str]:
    """Tag the joint graph's nodes of the saved tensors ``names`` ``MUST_RECOMPUTE``;
    the names tagged.

    A name is left untagged (torch then saves it) when its unit (:func:`_recompute_unit`)
    holds a graph input, an op that draws from the RNG (``nondeterministic_seeded``:
    re-running it would draw new numbers), or a node of the backward."""
    from torch.utils.checkpoint import CheckpointPolicy

    by_name = {n.name: n for n in gm.graph.nodes}
    backward = _backward_nodes(gm.graph)
    done: list[str] = []
    for name in sorted(names):
        node = by_name.get(name)
        if node is None:
            continue
        unit = _recompute_unit(node)
        if any(m.op != "call_function" or m in backward or is_random(m) for m in unit):
            continue
        for m in unit:
            m.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        done.append(name)
    return done


GRAD_SLOTS = 1 << 19  # a graph's gradient slots start here within its slot range
TANGENT_SLOTS = GRAD_SLOTS + (1 << 18)  # and its received gradients' slots here


def rewrite_tangents(bwd: fx.GraphModule, names: frozenset[str], slot_base: int, record: PartitionRecord) -> None:
    """Copy each named gradient the backward graph receives (a tangent) to the host tier
    after its early readers and bring it back before its late ones
    (:func:`graph_trace.tangent_split`).

    HF GPT-2's logits' gradient under inductor is read by the head's input gradient,
    the backward's first kernel, and by the tied embedding's fused ``addmm``, its last:
    it was held through the whole backward by its own last reader.
    ``tierflow::offload_received`` right after the last early reader copies it out; the
    late readers read what ``tierflow::reload`` brings back right before the first of
    them, through the same view ops re-made on the copy, so the same kernels read the
    same values at the same strides (the fused ``addmm`` stays where plain compile puts
    it, reading the copy). The copy-out op is then the tangent's last reader, and the
    compiled code drops the tangent there (checked below: no node placed after it reads
    the tangent or a view of it; a breach fails the compile)."""
    from . import ops  # noqa: F401 - registers the tierflow:: ops

    for k, p in enumerate(bwd.graph.find_nodes(op="placeholder")):
        if p.name not in names:
            continue
        order = {n: i for i, n in enumerate(bwd.graph.nodes)}
        split = tangent_split(p, order)
        val = p.meta.get("val")
        if split is None or not isinstance(val, torch.Tensor) or (dense := hinted_order(val)) is None:
            continue
        last_early = split.early[-1]
        after = _sequencer(bwd, split.late[0], order)
        if after is None or order[after] <= order[last_early]:
            continue  # nothing computed in the gap
        slot = slot_base + TANGENT_SLOTS + k
        op = torch.ops.tierflow.offload_received.default
        with bwd.graph.inserting_after(last_early):
            tok = bwd.graph.call_function(op, (p, slot))
        tok.meta["val"] = _fake(op, val, slot)
        back = _insert_reload(bwd.graph, split.late[0], tok, tok.meta["val"], after, dense, val)
        _read_copy(bwd.graph, split, p, back)
        _drop_dead_views(split.aliases)
        order = {n: i for i, n in enumerate(bwd.graph.nodes)}
        late_readers = [u for a in split.aliases if a in order for u in a.users
                        if u is not tok and order[u] > order[tok]]
        if late_readers:  # (cannot happen: every late reader was moved to the copy)
            raise RuntimeError(f"tierflow compiled: {p.name} is still read after its copy out by "
                               f"{[u.name for u in late_readers]}")
        record.tangents_moved[p.name] = (slot, _bytes(p))


def _read_copy(graph: fx.Graph, split: TangentSplit, p: fx.Node, back: fx.Node) -> None:
    """Make each of ``split``'s late readers read ``back`` (the copy of ``p``) through
    the same view ops it read ``p`` through."""
    inside = set(split.aliases)
    made: dict[fx.Node, fx.Node] = {p: back}
    for u in split.late:
        for a in list(u.all_input_nodes):
            if a not in inside:
                continue
            if a not in made:
                made[a] = _replay(graph, alias_chain(a, p) or [], back, split.late[0])
            u.replace_input_with(a, made[a])


def _drop_dead_views(aliases: tuple[fx.Node, ...]) -> None:
    """Erase the views in ``aliases`` nothing reads any more (latest first)."""
    for a in reversed(aliases):
        if a.op == "call_function" and not a.users:
            a.graph.erase_node(a)


def _rewrite_grads(bwd: fx.GraphModule, names: frozenset[str], slot_base: int, record: PartitionRecord) -> None:
    """Each named gradient goes to the host tier after its storage's last reader in the
    backward graph and comes back just before the graph returns it.

    A compiled backward graph returns all gradients when it ends, so a hook outside it
    (a post-accumulate-grad hook) cannot free one earlier: this is the only place a
    gradient made early in the backward can leave the device before the graph ends."""
    output = bwd.graph.find_nodes(op="output")[0]
    outs = list(output.args[0])
    # the last tensor the graph computes: every reload waits for it (else inductor
    # would schedule the reload right after the copy out)
    after = _sequencer(bwd, output, {n: k for k, n in enumerate(bwd.graph.nodes)})
    done: set[str] = set()
    for i, g in enumerate(outs):
        if not isinstance(g, fx.Node) or g.name not in names or g.name in done or g.op != "call_function":
            continue
        val = g.meta.get("val")
        order = hinted_order(val) if isinstance(val, torch.Tensor) else None
        if order is None:
            continue
        pos = {n: k for k, n in enumerate(bwd.graph.nodes)}
        chain, n = [g], g  # the node and the views it comes from share its storage
        while is_view(n) and n.all_input_nodes:
            n = n.all_input_nodes[0]
            chain.append(n)
        readers = [u for c in chain for u in c.users if u.op != "output" and u not in chain]
        last = max([g, *readers], key=lambda u: pos[u])
        if after is None or pos[after] <= pos[last]:
            continue  # nothing runs between its last reader and the return: no gap
        slot = slot_base + GRAD_SLOTS + i
        tok = _insert_offload(bwd.graph, last, g, slot)
        outs[i] = _insert_reload(bwd.graph, output, tok, tok.meta["val"], after, order, val)
        done.add(g.name)
        record.grads_offloaded[g.name] = (slot, _bytes(g))
    output.args = (tuple(outs),)


def _replay(graph: fx.Graph, chain: list[fx.Node], base: fx.Node, before: fx.Node) -> fx.Node:
    """``chain`` (view ops, each reading the one before) made again from ``base``,
    right before ``before``: the last node made."""
    made = base
    with graph.inserting_before(before):
        for c in chain:
            prev = made
            made = graph.call_function(c.target, (made, *c.args[1:]), dict(c.kwargs))
            made.meta["val"] = c.target(prev.meta["val"], *c.args[1:], **c.kwargs)
    return made


def sink_fused_matmuls(bwd: fx.GraphModule) -> int:
    """Move each matrix product that inductor will fuse into the add using it (its
    post-grad ``add(mm(a, b), c) -> addmm(c, a, b)`` pattern) next to that add, with the
    views only it reads; how many moved.

    The fused product runs where the add is, so its inputs stay live until then (HF
    GPT-2's tied embedding: the logits' 16 MiB gradient waited to the backward's end
    for the head's weight gradient). Moving it in the graph changes nothing inductor
    emits (the same pattern, the same place) and lets the trace see what runs."""
    mm, add = torch.ops.aten.mm.default, torch.ops.aten.add.Tensor
    moved = 0
    for node in list(bwd.graph.nodes):
        if node.op != "call_function" or node.target is not add or node.kwargs or len(node.args) != 2:
            continue
        prod = next((a for a in node.args if isinstance(a, fx.Node) and a.target is mm and len(a.users) == 1), None)
        other = node.args[1] if prod is node.args[0] else node.args[0]
        if prod is None or not _fusable(prod, other, node):
            continue
        if prod.next is not node:
            node.prepend(prod)
            moved += 1
        stack = [prod]
        while stack:  # views read only by what moved follow it
            n = stack.pop()
            for a in n.all_input_nodes:
                if a.op == "call_function" and is_view(a) and len(a.users) == 1 and a.next is not n:
                    n.prepend(a)
                    stack.append(a)
    if moved:
        bwd.graph.lint()
        bwd.recompile()
    return moved


def _fusable(prod: fx.Node, other: Any, add: fx.Node) -> bool:
    """Inductor's conditions for fusing ``add(prod, other)`` into an addmm: a tensor
    ``other`` of the product's dtype that broadcasts to its shape; on a GPU not when
    every user of the sum is pointwise (inductor then keeps the add to fuse it there)."""
    if not isinstance(other, fx.Node):
        return False
    a, b, c = (n.meta.get("val") for n in (*prod.args[:2], other))
    if not all(isinstance(v, torch.Tensor) for v in (a, b, c)):
        return False
    if not (a.dtype == b.dtype == c.dtype):
        return False
    mm_shape = (hint_int(a.shape[0]), hint_int(b.shape[1]))
    try:
        if tuple(torch.broadcast_shapes(tuple(hint_int(s) for s in c.shape), mm_shape)) != mm_shape:
            return False
    except RuntimeError:
        return False
    if c.device.type != "cpu" and add.users and all(
            u.op == "call_function" and torch.Tag.pointwise in (getattr(u.target, "tags", None) or ()) for u in add.users):
        return False
    return True


def _insert_offload(graph: fx.Graph, after: fx.Node, x: fx.Node, slot: int) -> fx.Node:
    """A ``tierflow::offload`` of ``x`` into ``slot``, right after ``after``: its token."""
    with graph.inserting_after(after):
        tok = graph.call_function(torch.ops.tierflow.offload.default, (x, slot))
    tok.meta["val"] = _fake(torch.ops.tierflow.offload.default, x.meta["val"], slot)
    return tok


def _insert_reload(graph: fx.Graph, before: fx.Node, token: fx.Node, token_val: Any, after: fx.Node,
                   order: tuple[int, ...], val: torch.Tensor) -> fx.Node:
    """A ``tierflow::reload`` of ``token`` right before ``before``, waiting for ``after``
    (see :func:`_sequencer`), giving back a tensor like ``val`` (dense in ``order``)."""
    args = (token, after, list(order), val.dtype, val.device)
    with graph.inserting_before(before):
        back = graph.call_function(torch.ops.tierflow.reload.default, args)
    back.meta["val"] = _fake(torch.ops.tierflow.reload.default, token_val, after.meta["val"], *args[2:])
    return back


def _insert_prefetch(graph: fx.Graph, before: fx.Node, token: fx.Node, token_val: Any, after: fx.Node | None,
                     order: tuple[int, ...], val: torch.Tensor) -> fx.Node:
    """A ``tierflow::prefetch`` of ``token`` right before ``before``, waiting for ``after``
    (``None``: free to run at the graph's start): the device tensor the copy writes, like
    ``val`` (dense in ``order``)."""
    args = (token, after, list(order), val.dtype, val.device)
    with graph.inserting_before(before):
        started = graph.call_function(torch.ops.tierflow.prefetch.default, args)
    started.meta["val"] = _fake(torch.ops.tierflow.prefetch.default, token_val,
                                after.meta["val"] if after is not None else None, *args[2:])
    return started


def _insert_wait(graph: fx.Graph, before: fx.Node, started: fx.Node, token: fx.Node, after: fx.Node) -> fx.Node:
    """A ``tierflow::wait`` for the copy into ``started`` right before ``before`` (its
    first use), after ``after`` (see :func:`_sequencer`)."""
    with graph.inserting_before(before):
        done = graph.call_function(torch.ops.tierflow.wait.default, (started, token, after))
    done.meta["val"] = None
    return done


def _sequencer(bwd: fx.GraphModule, first: fx.Node, order: dict[fx.Node, int]) -> fx.Node | None:
    """The last tensor the backward graph computes before ``first`` (not a view, nor one
    of tierflow's ops): the input that keeps a reload from being scheduled earlier."""
    ours = {torch.ops.tierflow.reload.default, torch.ops.tierflow.prefetch.default,
            torch.ops.tierflow.wait.default, torch.ops.tierflow.offload.default, torch.ops.tierflow.offload_received.default}
    before = [n for n in bwd.graph.nodes if order[n] < order[first] and n.op == "call_function"
              and isinstance(n.meta.get("val"), torch.Tensor) and n.target not in ours
              and not is_view(n)]
    return before[-1] if before else None


def _bytes(n: fx.Node) -> int:
    from .graph_trace import tensor_bytes

    return tensor_bytes(n.meta.get("val"))


__all__ = ["PartitionRecord", "PlanPartitioner", "hoist_saved_views", "hook_support", "rewrite_tangents", "tag_recompute"]
