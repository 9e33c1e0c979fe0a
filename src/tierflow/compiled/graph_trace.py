"""A tierflow :class:`~tierflow.trace.Trace` made from a compiled graph's forward and
backward halves (as torch's partitioner split them), and the saved set it implies.

The trace is the planner's own format: ops in execution order (the forward graph's
``call_function`` nodes, then the backward graph's), tensors with their bytes (symbolic
sizes read through their hints, never specialized), kinds (``parameter``/``input`` for
the forward graph's placeholders, ``input`` too for the backward's output gradients,
held to the graph's end, ``activation`` for what the backward graph reads from the
forward, ``gradient`` for the backward's outputs, ``temporary`` otherwise). A view
shares its base's tensor id, so bytes are counted once per storage.

Op times are a roofline estimate (:func:`estimate_op_s`): matrix products at the
machine's FLOP rate, everything else at its memory bandwidth. They rank recompute
against copies; the bytes are what the budget is checked against.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from torch import fx

from ..trace import Op, TensorInfo, Trace

# A CPU's order of magnitude: the choice between copying and keeping does not hang on
# these, only the simulated step time does.
FLOPS_PER_S = 2e11
BYTES_PER_S = 2e10
MATMULS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product")


@dataclass(frozen=True, slots=True)
class SavedTensor:
    """One tensor the forward graph saves for the backward graph.

    Attributes:
        name: the node's name (the same in the joint, forward and backward graphs).
        bytes: its storage's bytes (a symbolic size by its hint).
        producer: the op that made it (``aten.mm.default``).
        module: the ``nn.Module`` path it was made under (``""``: unknown).
        tensor: its tensor id in the graph's trace (its base's, for a view).
        last_fwd_use, first_bwd_use: op indices in the trace; the gap between them is
            where the plan may take it off the device.
        offloadable: a dense tensor that is neither a graph input, nor returned to the
            caller, nor sharing its storage with another saved tensor.
        recomputable: torch's partitioner could re-make it in the backward graph: made by
            a forward op (its storage is not a graph input's), not returned to the caller,
            read by the backward, and its storage not made by a random op (re-running one
            would draw new numbers).
        group: for a view of a storage that leaves the device only with the other saved
            views of it (:func:`storage_groups`), the name of the node that made the
            storage; then ``group_bytes`` are the storage's bytes, ``last_fwd_use`` and
            ``first_bwd_use`` the group's gap, and ``offloadable`` says the group is.
    """

    name: str
    bytes: int
    producer: str
    module: str
    tensor: int
    last_fwd_use: int
    first_bwd_use: int
    offloadable: bool
    recomputable: bool = False
    group: str = ""
    group_bytes: int = 0


@dataclass(frozen=True, slots=True)
class HeldTangent:
    """A gradient the backward graph receives (a *tangent*: the gradient of one of the
    forward's outputs, made by the loss) read both early and late in the graph, and the
    gap in which a plan may take its bytes off the device.

    Its readers (ops reading it or a view of it) are split at their largest gap
    (:func:`tangent_split`): the early readers read it in place, the late ones a copy
    brought back right before the first of them. HF GPT-2's logits' gradient under
    inductor: the head's input gradient is the backward's first kernel, the tied
    embedding's weight gradient (fused into an ``addmm``) its last.

    Attributes:
        name: the backward graph's placeholder.
        bytes: its bytes (a symbolic size by its hint).
        tensor: its tensor id in the graph's trace.
        last_early_use: trace op index of the last early reader.
        first_late_use: trace op index of the first late reader.
        last_use: trace op index of its last reader (the copy brought back dies after it).
        offloadable: dense, of non-zero bytes.
    """

    name: str
    bytes: int
    tensor: int
    last_early_use: int
    first_late_use: int
    last_use: int
    offloadable: bool

    def off_device(self, n_ops: int) -> list[tuple[int, int]]:
        """The op ranges ``[lo, hi)`` where its bytes are off the device when it moves:
        the gap, and (on a trace that holds it to the graph's end) after its last reader."""
        return [(self.last_early_use + 1, self.first_late_use), (self.last_use + 1, n_ops)]


@dataclass(frozen=True, slots=True)
class GraphFacts:
    """A compiled graph as the planner sees it.

    Attributes:
        trace: the step's ops and tensors (forward then backward).
        saved: the saved set torch's partitioner chose.
        n_fwd: forward ops in the trace.
        curve: bytes live at each op above the step's start (parameters and inputs
            left out, as they are there before the step).
        grads: the backward graph's outputs (the inputs' gradients) as a plan may move
            them: ``last_fwd_use`` is their last use in the backward graph,
            ``first_bwd_use`` the graph's last op (they come back to the device before
            the graph returns them); ``offloadable`` when dense and returned once.
        tangents: the gradients the backward graph receives, held to its end on the
            curve, with the gap where a plan may move them (:class:`HeldTangent`).
    """

    trace: Trace
    saved: tuple[SavedTensor, ...]
    n_fwd: int
    curve: np.ndarray
    grads: tuple[SavedTensor, ...] = ()
    tangents: tuple[HeldTangent, ...] = ()

    @property
    def peak_bytes(self) -> int:
        return int(self.curve.max()) if len(self.curve) else 0

    @property
    def saved_bytes(self) -> int:
        return sum(s.bytes for s in self.saved)


def hint_int(x: object, fallback: int = 4096) -> int:
    """An int for a size that may be symbolic: its hint, never a guard."""
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        node = x.node
        hint = node.hint if getattr(node, "hint", None) is not None else None
        if hint is None:
            shape_env = getattr(node, "shape_env", None)
            try:
                hint = shape_env.size_hint(node.expr) if shape_env is not None else None
            except Exception:  # an unbacked size: no hint exists
                hint = None
        return int(hint) if hint is not None else fallback
    return int(x)


def tensor_bytes(val: object) -> int:
    """Bytes of a (fake) tensor's elements, symbolic sizes by their hints."""
    if not isinstance(val, torch.Tensor):
        return 0
    n = 1
    for s in val.shape:
        n *= hint_int(s)
    return n * val.element_size()


def is_view(node: fx.Node) -> bool:
    """The node's output shares its first tensor input's storage (an aten view op)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def estimate_op_s(node: fx.Node) -> float:
    """Roofline time of one node: FLOPs of a matrix product, else bytes moved."""
    val = node.meta.get("val")
    out_b = tensor_bytes(val) if isinstance(val, torch.Tensor) else 0
    in_b = sum(tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes)
    name = str(node.target)
    if any(m in name for m in MATMULS) and isinstance(val, torch.Tensor):
        k = 1
        for a in node.all_input_nodes:
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor) and v.dim() >= 2:
                k = max(k, hint_int(v.shape[-1]))
        flops = 2.0 * (out_b / max(val.element_size(), 1)) * k
        return max(flops / FLOPS_PER_S, (in_b + out_b) / BYTES_PER_S)
    return (in_b + out_b) / BYTES_PER_S


def is_random(node: fx.Node) -> bool:
    """The node draws from the RNG (``torch.Tag.nondeterministic_seeded``): re-running it
    would not give the same numbers."""
    tags = getattr(node.target, "tags", None) or ()
    return torch.Tag.nondeterministic_seeded in tags


def storage_maker(node: fx.Node) -> fx.Node:
    """The node that made ``node``'s storage: through views to their base, and through a
    ``getitem`` to the multi-output op it reads."""
    import operator

    while node.op == "call_function" and node.all_input_nodes:
        if is_view(node) or node.target is operator.getitem:
            node = node.all_input_nodes[0]
        else:
            break
    return node


def alias_chain(node: fx.Node, base: fx.Node) -> list[fx.Node] | None:
    """The nodes from ``base`` (left out) to ``node`` (included), each reading the one
    before it as its first input; ``None`` when a step reads another node too (a
    symbolic size: replaying it in the backward graph would need the backward's own)."""
    chain: list[fx.Node] = []
    while node is not base:
        if not node.all_input_nodes or any(a is not node.all_input_nodes[0] for a in node.all_input_nodes):
            return None
        chain.append(node)
        node = node.all_input_nodes[0]
    return chain[::-1]


def storage_groups(outs: list[object], n_out: int) -> dict[fx.Node, list[int]]:
    """Saved tensors that can leave the device only together, by the dense tensor whose
    storage they view: the positions in the forward's outputs ``outs`` of each group.

    A group is a storage saved through several views, or through one view that is not
    dense (attention's q, k and v, slices of one projection's output): no single view's
    copy would free the storage, and a slice with gaps has no dense order. The storage
    must be dense, made by a forward op, returned to the caller through no view, and each
    view must be re-makeable from it by ops that read nothing else (:func:`alias_chain`)."""
    by_base: dict[fx.Node, list[int]] = {}
    for i in range(n_out, len(outs)):
        x = outs[i]
        if isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor):
            by_base.setdefault(storage_maker(x), []).append(i)
    returned = {storage_maker(n) for n in outs[:n_out] if isinstance(n, fx.Node)}
    groups: dict[fx.Node, list[int]] = {}
    for base, members in by_base.items():
        xs = [outs[i] for i in members]
        if len(members) == 1 and (xs[0] is base or hinted_order(xs[0].meta["val"]) is not None):
            continue  # one dense saved tensor: offloaded as itself
        val = base.meta.get("val")
        if (base.op != "call_function" or base in returned or not isinstance(val, torch.Tensor)
                or hinted_order(val) is None or any(alias_chain(x, base) is None for x in xs)):
            continue
        groups[base] = members
    return groups


@dataclass(frozen=True, slots=True)
class TangentSplit:
    """A received gradient's readers in a backward graph, split at their largest gap.

    Attributes:
        aliases: the placeholder and the views made from it (each reading the one before).
        early: readers that run before the gap (they read it in place).
        late: readers after the gap (they read a copy brought back before the first).
    """

    aliases: tuple[fx.Node, ...]
    early: tuple[fx.Node, ...]
    late: tuple[fx.Node, ...]


def tangent_split(placeholder: fx.Node, order: dict[fx.Node, int]) -> TangentSplit | None:
    """Where a backward graph's input ``placeholder`` can be off the device: its readers
    split at the largest run of computing ops between two of them; ``None`` when it
    cannot move (unread, returned by the graph, read through a view that reads another
    node too, or no op between any two readers).

    Past its last reader nothing holds it (the compiled code drops it there, and torch's
    runtime keeps no other reference: measured), so only a gap between readers is worth
    a copy.

    Args:
        placeholder: the backward graph's placeholder (a tangent).
        order: each node's position in the graph.
    """
    aliases = [placeholder]
    for a in aliases:  # (grows while walked: views of views)
        aliases.extend(u for u in a.users if u.op == "call_function" and is_view(u) and u not in aliases
                       and alias_chain(u, placeholder) is not None)
    inside = set(aliases)
    readers = sorted({u for a in aliases for u in a.users if u not in inside}, key=order.__getitem__)
    if len(readers) < 2 or any(u.op != "call_function" or is_view(u) for u in readers):
        return None  # no gap, returned (a view of it too), or viewed by a view it cannot re-make
    computed = np.array(sorted(k for n, k in order.items() if n.op == "call_function" and not is_view(n)))
    at = [order[u] for u in readers]
    gaps = [int(np.searchsorted(computed, at[k + 1]) - np.searchsorted(computed, at[k], side="right"))
            for k in range(len(readers) - 1)]
    k = max(range(len(gaps)), key=lambda i: (gaps[i], -i))
    if gaps[k] < 1:
        return None
    return TangentSplit(tuple(aliases), tuple(readers[: k + 1]), tuple(readers[k + 1:]))


def _module_of(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1]
    return path[0] if isinstance(path, tuple) else str(path)


def graph_facts(fwd: fx.GraphModule, bwd: fx.GraphModule, num_fwd_outputs: int) -> GraphFacts:
    """The trace and saved set of a partitioned graph.

    Args:
        fwd, bwd: the partitioner's forward and backward graphs.
        num_fwd_outputs: how many of the forward graph's outputs go to the caller (the
            rest are saved for backward).
    """
    tensors: list[TensorInfo] = []
    ops: list[Op] = []
    tid: dict[tuple[str, str], int] = {}  # (graph, node name) -> tensor id
    op_of: dict[str, int] = {}  # backward node name -> its op's index (before a shift below)

    def new_tensor(nbytes: int, kind: str, name: str, **kw) -> int:
        tensors.append(TensorInfo(len(tensors), nbytes, kind, name=name, **kw))
        return len(tensors) - 1

    fwd_out = list(fwd.graph.find_nodes(op="output")[0].args[0])
    user_outputs = {n.name for n in fwd_out[:num_fwd_outputs] if isinstance(n, fx.Node)}
    saved_nodes = [n for n in fwd_out[num_fwd_outputs:] if isinstance(n, fx.Node)
                   and isinstance(n.meta.get("val"), torch.Tensor)]
    saved_names = {n.name for n in saved_nodes}

    def walk(gm: fx.GraphModule, g: str, phase: str) -> None:
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if node.op == "placeholder":
                if not isinstance(val, torch.Tensor):
                    continue
                if g == "bwd" and node.name in saved_names:
                    tid[(g, node.name)] = tid[("fwd", node.name)]
                elif g == "fwd":
                    tid[(g, node.name)] = new_tensor(tensor_bytes(val), "input", node.name, external=True)
                else:  # an output gradient (a tangent), made by the step before this graph ran
                    tid[(g, node.name)] = new_tensor(tensor_bytes(val), "input", node.name)
                continue
            if node.op != "call_function":
                continue
            ins = sorted({tid[(g, a.name)] for a in node.all_input_nodes if (g, a.name) in tid})
            outs: list[int] = []
            if isinstance(val, torch.Tensor):
                base = node.all_input_nodes[0] if node.all_input_nodes else None
                if is_view(node) and base is not None and (g, base.name) in tid:
                    tid[(g, node.name)] = tid[(g, base.name)]
                else:
                    kind = "activation" if node.name in saved_names else "temporary"
                    tid[(g, node.name)] = new_tensor(tensor_bytes(val), kind, node.name)
                    outs.append(tid[(g, node.name)])
            if g == "bwd":
                op_of[node.name] = len(ops)
            ops.append(Op(str(node.target), phase, estimate_op_s(node), tuple(ins), tuple(outs),
                          scope=_module_of(node) or None))

    walk(fwd, "fwd", "forward")
    n_fwd = len(ops)
    walk(bwd, "bwd", "backward")
    if not ops:
        ops.append(Op("empty", "forward", 0.0, (), ()))
        n_fwd = 1
    last = len(ops) - 1
    # The backward graph's outputs (gradients) and the forward's outputs to the caller
    # stay held after their last use in the graph.
    bwd_out = [n for n in bwd.graph.find_nodes(op="output")[0].args[0] if isinstance(n, fx.Node)]
    held: dict[int, int] = {}
    for n in bwd_out:
        if ("bwd", n.name) in tid:
            held[tid[("bwd", n.name)]] = last
    # The backward graph's other inputs (the output gradients) are held to its end.
    # NOTE: conservative. This was modelled on HF GPT-2's 16 MiB logits gradient, live at
    # the backward's allocator peak long after its first reader; what held it was its
    # last reader, inductor's fused tied-embedding addmm, the backward's last kernel.
    # Measured since: copied out between its readers (HeldTangent), it left the peak as
    # it did when its storage was also freed in place, so nothing outside the graph
    # holds it (GPT-2 4L at 30%: 40.9 MiB either way). Freed at the last reader would be
    # exact; the plans of the other models were measured with this curve.
    for p in bwd.graph.find_nodes(op="placeholder"):
        if p.name not in saved_names and ("bwd", p.name) in tid:
            held[tid[("bwd", p.name)]] = last
    for name in user_outputs:
        if ("fwd", name) in tid:
            held[tid[("fwd", name)]] = max(held.get(tid[("fwd", name)], 0), min(n_fwd, last))
    tensors = [
        TensorInfo(t.id, t.bytes, "gradient" if held.get(t.id) == last and t.kind == "temporary" else t.kind,
                   name=t.name, external=t.external, held_until=held.get(t.id))
        for t in tensors
    ]
    # Tensors no op touched (a placeholder nobody reads) must still be used by one op.
    used = set()
    for o in ops:
        used.update(o.inputs)
        used.update(o.outputs)
    unused = tuple(t.id for t in tensors if t.id not in used)
    shift = 0
    if unused:
        ops.insert(0, Op("placeholders", "forward", 0.0, unused, ()))
        n_fwd += 1
        shift = 1
    trace = Trace(ops, tensors, name="compiled graph", meta={"source": "joint graph", "n_fwd": n_fwd})

    first_use, last_use = trace.first_use, trace.last_use
    uses_by_tensor: dict[int, list[int]] = {}
    for i, o in enumerate(trace.ops):
        for t in set(o.inputs) | set(o.outputs):
            uses_by_tensor.setdefault(t, []).append(i)
    base_count: dict[int, int] = {}
    for n in saved_nodes:
        base_count[tid[("fwd", n.name)]] = base_count.get(tid[("fwd", n.name)], 0) + 1
    saved: list[SavedTensor] = []
    for n in saved_nodes:
        t = tid[("fwd", n.name)]
        uses = uses_by_tensor.get(t, [])
        fwd_uses = [u for u in uses if u < n_fwd]
        bwd_uses = [u for u in uses if u >= n_fwd]
        dense = hinted_order(n.meta["val"]) is not None
        offloadable = (
            dense and n.op != "placeholder" and n.name not in user_outputs and base_count[t] == 1
            and not trace.tensors[t].external and bool(bwd_uses) and tensors[t].bytes > 0
        )
        maker = storage_maker(n)
        recomputable = (
            n.op != "placeholder" and maker.op == "call_function" and not is_random(maker)
            and n.name not in user_outputs and not trace.tensors[t].external and bool(bwd_uses)
            and tensors[t].bytes > 0 and 0 <= int(first_use[t]) < n_fwd
        )
        saved.append(SavedTensor(
            name=n.name, bytes=trace.tensors[t].bytes, producer=str(n.target), module=_module_of(n),
            tensor=t, last_fwd_use=max(fwd_uses) if fwd_uses else int(first_use[t]),
            first_bwd_use=min(bwd_uses) if bwd_uses else int(last_use[t]), offloadable=offloadable,
            recomputable=recomputable,
        ))
    saved = _with_groups(saved, fwd_out, num_fwd_outputs, tid, uses_by_tensor, n_fwd)
    # A compiled backward graph returns every gradient when it ends: inside it, a
    # gradient made early is held to the end unless the plan moves it.
    grads: list[SavedTensor] = []
    returned = Counter(tid[("bwd", n.name)] for n in bwd_out if ("bwd", n.name) in tid)
    for n in bwd_out:
        t = tid.get(("bwd", n.name))
        if t is None or n.op != "call_function" or not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        uses = uses_by_tensor.get(t, [])
        movable = (returned[t] == 1 and trace.tensors[t].kind == "gradient" and bool(uses)
                   and hinted_order(n.meta["val"]) is not None and trace.tensors[t].bytes > 0)
        grads.append(SavedTensor(
            name=n.name, bytes=trace.tensors[t].bytes, producer=str(n.target), module=_module_of(n),
            tensor=t, last_fwd_use=max(uses) if uses else last, first_bwd_use=last, offloadable=movable,
        ))
    tangents = _held_tangents(bwd, saved_names, tid, {k: v + shift for k, v in op_of.items()}, len(trace.ops))
    return GraphFacts(trace, tuple(saved), n_fwd, live_curve(trace), tuple(grads), tangents)


def _held_tangents(bwd: fx.GraphModule, saved_names: set[str], tid: dict[tuple[str, str], int],
                   op_of: dict[str, int], n_ops: int) -> tuple[HeldTangent, ...]:
    """The backward graph's received gradients (its placeholders that are not saved
    tensors) that could leave the device inside it, with their gaps."""
    order = {n: k for k, n in enumerate(bwd.graph.nodes)}
    out: list[HeldTangent] = []
    for p in bwd.graph.find_nodes(op="placeholder"):
        val = p.meta.get("val")
        if p.name in saved_names or ("bwd", p.name) not in tid or not isinstance(val, torch.Tensor):
            continue
        split = tangent_split(p, order)
        if split is None:
            continue
        nbytes = tensor_bytes(val)
        out.append(HeldTangent(
            name=p.name, bytes=nbytes, tensor=tid[("bwd", p.name)], last_early_use=op_of[split.early[-1].name],
            first_late_use=op_of[split.late[0].name], last_use=op_of[split.late[-1].name],
            offloadable=nbytes > 0 and hinted_order(val) is not None))
    return tuple(out)


def _with_groups(saved: list[SavedTensor], fwd_out: list[object], n_out: int, tid: dict[tuple[str, str], int],
                 uses_by_tensor: dict[int, list[int]], n_fwd: int) -> list[SavedTensor]:
    """``saved`` with each member of a storage group (:func:`storage_groups`) given its
    group, the storage's bytes and the group's gap: from the last forward use of the
    storage or any view of it to the first backward use of any member."""
    import dataclasses

    by_name = {s.name: k for k, s in enumerate(saved)}
    out = list(saved)
    for base, members in storage_groups(fwd_out, n_out).items():
        names = [fwd_out[i].name for i in members]
        if any(n not in by_name for n in names) or ("fwd", base.name) not in tid:
            continue
        ids = {tid[("fwd", base.name)]} | {saved[by_name[n]].tensor for n in names}
        fwd_uses = [u for t in ids for u in uses_by_tensor.get(t, []) if u < n_fwd]
        lo = max(fwd_uses, default=0)
        hi = min(saved[by_name[n]].first_bwd_use for n in names)
        for n in names:
            s = saved[by_name[n]]
            out[by_name[n]] = dataclasses.replace(
                s, group=base.name, group_bytes=tensor_bytes(base.meta.get("val")), last_fwd_use=lo, first_bwd_use=hi,
                offloadable=hi > lo and s.bytes > 0)
    return out


def hinted_order(val: torch.Tensor) -> tuple[int, ...] | None:
    """The dimension order that makes a (fake) tensor dense, read from size and stride
    hints (comparing symbolic strides would guard on them), or ``None``."""
    sizes = [hint_int(s) for s in val.shape]
    strides = [hint_int(s) for s in val.stride()]
    order = tuple(sorted(range(len(sizes)), key=lambda d: (-strides[d], -sizes[d])))
    expect = 1
    for d in reversed(order):
        if sizes[d] != 1 and strides[d] != expect:
            return None
        expect *= sizes[d]
    return order


def live_curve(trace: Trace) -> np.ndarray:
    """Bytes live at each op, left out what is there before the step (inputs)."""
    diff = np.zeros(trace.n_ops + 1, dtype=np.int64)
    for t in trace.tensors:
        if t.external or t.persistent:
            continue
        first, last = int(trace.first_use[t.id]), int(trace.last_use[t.id])
        if t.held_until is not None:
            last = max(last, t.held_until)
        diff[first] += t.bytes
        diff[last + 1] -= t.bytes
    return np.cumsum(diff)[:-1]


__all__ = ["GraphFacts", "HeldTangent", "SavedTensor", "TangentSplit", "tangent_split", "alias_chain", "graph_facts", "hint_int", "is_random", "live_curve", "storage_groups", "storage_maker",
           "tensor_bytes"]
