"""The two levers beside moving, for ``tierflow``'s joint planner: what can be recomputed
or host-stepped, at what cost, and the trace a chosen set of them leaves to the movers.

Three parts, each a pure function of its inputs:

* **Candidates.** :func:`recompute_options` lists, per activation that forward makes and
  backward reads again, the forward ops that re-create it just before its first backward
  use (its writers, and the writers of any input no longer on the device then: chains of
  pure forward ops, so it needs no module scopes and works on G10's workloads too), with
  their compute time and the bytes and span it frees. :func:`host_step_options` lists the
  parameters whose optimizer update can run on the host (one unit per group of optimizer
  ops that share tensors: a ``foreach`` op shared by several parameters is all or none),
  with the link bytes (gradient down, parameter up), host bytes processed and device
  time and memory it frees.
* **Choice.** :func:`choose_recomputes` takes options cheapest per byte first (compute
  seconds per byte freed), only where the live curve is over the line and only while
  they make each such op fall below it, and groups them into :class:`~tierflow.plan.Recompute`
  records that are consistent by construction (:func:`check_recomputes` is the
  independent check: every re-run op's inputs are there, its other outputs are not
  live duplicates).
* **Lowering.** :func:`lower` rewrites the trace as the levers leave it (a
  :class:`Lowered` trace): host-stepped optimizer ops and optimizer state gone, each
  recompute chain inserted as real ops before the op that needs it, the re-created
  tensors new tensors born there (the dropped originals die at their last forward
  use). Any move planner plans on it as on any trace; :meth:`Lowered.plan` maps its
  moves back to the original trace's ids and adds the recompute and host-step records.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from ...hardware import Hardware
from ...plan import HostStep, Move, Plan, Recompute
from ...trace import Op, TensorInfo, Trace

# kinds whose tensors forward makes and backward reads again (what checkpointing drops)
_RECOMPUTABLE_KINDS = ("activation", "temporary")


@dataclass(frozen=True)
class RecomputeOption:
    """Re-create ``tensor`` before ``before_op`` by re-running ``ops``.

    Attributes:
        tensor: the dropped tensor.
        drop_after: its last use before ``before_op`` (it is off the device in between).
        before_op: its first backward use.
        ops: the forward ops re-run, in order (its writers, and those of inputs of theirs
            that are no longer on the device at ``before_op``).
        cost_s: their compute time.
        nbytes: the tensor's size.
        rng: a re-run op draws random numbers (restore the RNG state).
    """

    tensor: int
    drop_after: int
    before_op: int
    ops: tuple[int, ...]
    cost_s: float
    nbytes: int
    rng: bool

    @property
    def per_byte_s(self) -> float:
        """Compute seconds per byte freed (the choice's key)."""
        return self.cost_s / max(self.nbytes, 1)


@dataclass(frozen=True)
class HostStepOption:
    """One unit of optimizer work that can run on the host.

    Attributes:
        steps: one :class:`~tierflow.plan.HostStep` per parameter of the unit.
        ops: the optimizer ops of the unit (no longer run on the device).
        device_s: their device time, freed from the compute stream.
        down_bytes: gradient bytes to the host per iteration.
        up_bytes: parameter bytes back per iteration.
        host_bytes: bytes the host update processes (parameter, gradient, state).
        state_bytes: optimizer state that leaves the device for good.
    """

    steps: tuple[HostStep, ...]
    ops: tuple[int, ...]
    device_s: float
    down_bytes: int
    up_bytes: int
    host_bytes: int
    state_bytes: int


def _is_view(op: Op, t: int) -> bool:
    """``op`` lists ``t`` as input and output but does not change it: a view
    (``aten::view``, ``t``, ``_unsafe_view``, ...), which launches no kernel, so a
    captured trace gives it no time. An in-place update takes time."""
    return op.duration_s == 0.0 and t in op.inputs


def _writers(trace: Trace) -> list[list[int]]:
    """Per tensor, the ops that write it (views of it left out)."""
    out: list[list[int]] = [[] for _ in range(trace.n_tensors)]
    for i, op in enumerate(trace.ops):
        for t in dict.fromkeys(op.outputs):
            if not _is_view(op, t):
                out[t].append(i)
    return out


def _rerunnable(op: Op, trace: Trace) -> bool:
    """A forward op that is safe to re-run: pure, and writing no persistent tensor."""
    return op.phase == "forward" and op.pure and not any(trace.tensors[t].persistent for t in op.outputs)


def _live_at(trace: Trace, x: int, at: int) -> bool:
    return bool(trace.persistent[x]) or int(trace.birth[x]) <= at <= int(trace.death[x])


def recompute_options(trace: Trace, max_ops: int = 8) -> list[RecomputeOption]:
    """Every activation that can be dropped after forward and re-created by re-running
    pure forward ops just before its first backward use, one option each (by tensor id).

    A tensor qualifies if it is not persistent, of an activation or temporary kind, used
    in forward, then first again by a backward op at least two ops later (something
    lies between), and every op that writes it before then is a pure forward op. The
    chain is its writers; an input of theirs that is not on the device at the backward
    use (dead by then) is re-created too, by its own writers, up to ``max_ops`` ops. An
    input that another forward op overwrites between the chain and the backward use
    would be read with another value: such a tensor has no option.
    """
    writers = _writers(trace)
    ops = trace.ops
    phases = [o.phase for o in ops]
    dur = trace.durations
    out: list[RecomputeOption] = []
    for t in range(trace.n_tensors):
        info = trace.tensors[t]
        if info.persistent or info.kind not in _RECOMPUTABLE_KINDS or info.bytes <= 0:
            continue
        uses = trace.uses(t).tolist()
        back = [u for u in uses if phases[u] == "backward"]
        if not back:
            continue
        b = back[0]
        before = [u for u in uses if u < b]
        if not before or any(phases[u] != "forward" for u in before) or b - before[-1] < 2:
            continue
        chain = _chain(trace, writers, t, b, max_ops)
        if chain is None:
            continue
        out.append(RecomputeOption(
            t, before[-1], b, chain, float(dur[list(chain)].sum()), info.bytes,
            any(ops[i].rng for i in chain)))
    return out


def _chain(trace: Trace, writers: list[list[int]], t: int, b: int, max_ops: int) -> tuple[int, ...] | None:
    """The ops that re-create ``t`` at op ``b``, or None (see :func:`recompute_options`)."""
    chain: set[int] = set()
    made: set[int] = set()
    todo = [t]
    while todo:
        x = todo.pop()
        if x in made:
            continue
        made.add(x)
        ws = [w for w in writers[x] if w < b]
        if not ws or any(not _rerunnable(trace.ops[w], trace) for w in ws):
            return None
        chain.update(ws)
        if len(chain) > max_ops:
            return None
        for w in ws:
            for y in trace.ops[w].inputs:
                if y in made or any(y in trace.ops[v].outputs for v in ws if v < w):
                    continue
                if _live_at(trace, y, b):
                    # read at op w: nothing may overwrite it between w and b
                    if any(w < v < b for v in writers[y]):
                        return None
                    continue
                todo.append(y)  # gone by b: re-create it too (a temporary of the chain)
    return tuple(sorted(chain))


def host_step_options(trace: Trace, hw: Hardware) -> list[HostStepOption]:
    """The optimizer's units of work that can run on the host (none without
    ``hw.host_compute``): connected groups of optimizer ops (sharing a tensor), each
    updating at least one parameter whose gradient and state it names. A parameter's
    gradient and state are found by name (``NAME.grad``, ``NAME.KEY``) or, in a unit with
    one parameter, by kind. A unit whose parameters cannot all be paired is left out."""
    if hw.host_compute is None:
        return []
    ops = trace.ops
    opt = [i for i, o in enumerate(ops) if o.phase == "optimizer" and o.tensors]
    tensors = trace.tensors
    out = []
    for unit in trace.op_groups(opt):
        ts = sorted({t for i in unit for t in ops[i].tensors})
        params = [t for t in ts if tensors[t].kind == "parameter" and any(t in ops[i].outputs for i in unit)]
        grads = [t for t in ts if tensors[t].kind == "gradient"]
        states = [t for t in ts if tensors[t].kind == "optimizer_state"]
        if not params:
            continue
        steps = []
        for p in params:
            name = tensors[p].name
            if len(params) == 1:
                g = grads
                s = states
            else:
                g = [x for x in grads if name and tensors[x].name == f"{name}.grad"]
                s = [x for x in states if name and tensors[x].name.startswith(f"{name}.")]
            if len(g) != 1:
                break
            steps.append(HostStep(p, g[0], tuple(s), tuple(unit)))
        else:
            # every tensor of the unit must be its own: a gradient or state read elsewhere
            # (outside the optimizer) stays where it is needed
            if any(not all(ops[u].phase == "optimizer" for u in trace.uses(x).tolist()) for x in states):
                continue
            sz = trace.sizes
            down = int(sum(int(sz[h.grad]) for h in steps))
            up = int(sum(int(sz[h.param]) for h in steps))
            state = int(sum(int(sz[x]) for h in steps for x in h.state))
            out.append(HostStepOption(tuple(steps), tuple(unit), float(trace.durations[unit].sum()),
                                      down, up, down + up + state, state))
    return out


def reserve_for_moves(trace: Trace, options: list[RecomputeOption], capacity: float,
                      bandwidth: float) -> tuple[set[int], float]:
    """Tensors to leave to the movers rather than recompute: the dearest to recompute per
    byte among those whose gap is long enough to hide a round trip over the link with
    room to spare (four one-way transfer times), until ``capacity`` bytes. Returns (their
    ids, their bytes). Moving them costs nothing where the link has room, recomputing
    them costs their chains' time; the link's room is what the caller's ``capacity``
    estimates (the bytes it carries one way during the forward pass, say)."""
    start = trace.op_start_s
    kept: set[int] = set()
    total = 0.0
    for o in sorted(options, key=lambda o: (-o.per_byte_s, o.tensor)):
        if total + o.nbytes > capacity:
            continue
        if start[o.before_op] - start[o.drop_after + 1] < 4 * o.nbytes / bandwidth:
            continue
        kept.add(o.tensor)
        total += o.nbytes
    return kept, total


def choose_recomputes(trace: Trace, options: list[RecomputeOption], over: np.ndarray,
                      max_per_byte_s: float = float("inf"), remake_early: bool = True) -> list[RecomputeOption]:
    """Options to take, cheapest per byte first, while they relieve ops over the line.

    ``over[k]`` is how many bytes op ``k`` is over the line (what moves would otherwise
    carry away). An option is taken if some op of its span is still over, and its cost
    per byte is at most ``max_per_byte_s``; it lowers ``over`` over its span.

    Chains read each other's tensors: in a transformer's backward the product of an MLP's
    gate and up projections is needed before either projection, so re-making the product
    reads both while they are still dropped. Such a tensor is then re-made earlier, at
    the first point a taken chain reads it (its option's ``before_op`` moves there, and
    its chain joins that record; recursively for what its own chain reads), so that the
    records :func:`group` makes are consistent. A candidate whose span would be empty
    after that is skipped. Ties by tensor id.
    """
    over = np.asarray(over, dtype=np.float64).copy()
    order = sorted(options, key=lambda o: (o.per_byte_s, o.tensor))
    taken: dict[int, RecomputeOption] = {}
    ins_of: dict[int, set[int]] = {}
    reads: dict[int, set[int]] = {}  # tensor -> taken options' tensors whose chains read it

    def need(x: int, at: int, tent: dict[int, RecomputeOption]) -> bool:
        """Make ``x`` be on the device at op ``at`` (re-made by then if it is dropped),
        in ``tent``; False if it cannot be."""
        ox = tent.get(x, taken.get(x))
        if ox is None or not ox.drop_after < at < ox.before_op:
            return True
        if at - ox.drop_after < 2:
            return False  # it would be re-made right after its drop: nothing freed
        tent[x] = dataclasses.replace(ox, before_op=at)
        return all(need(y, at, tent) for y in ins_of[x])

    for o in order:
        if o.per_byte_s > max_per_byte_s:
            break
        lo, hi = o.drop_after + 1, o.before_op - 1
        if not (over[lo : hi + 1] > 0).any():
            continue
        # taken chains that read this tensor while it would be dropped: re-make it there
        first = min((taken[c].before_op for c in reads.get(o.tensor, ())
                     if o.drop_after < taken[c].before_op < o.before_op), default=None)
        if first is not None:
            if first - o.drop_after < 2 or not remake_early:
                continue
            o = dataclasses.replace(o, before_op=first)
        ins = _chain_inputs(trace, o)
        ins_of[o.tensor] = ins
        tent: dict[int, RecomputeOption] = {}
        if not all(need(x, o.before_op, tent) for x in ins) or (tent and not remake_early):
            del ins_of[o.tensor]
            continue
        taken.update(tent)
        taken[o.tensor] = o
        for x in ins:
            reads.setdefault(x, set()).add(o.tensor)
        over[o.drop_after + 1 : o.before_op] -= o.nbytes
    return [taken[t] for t in sorted(taken)]


def _chain_inputs(trace: Trace, o: RecomputeOption) -> set[int]:
    """Tensors the chain reads that it does not make itself."""
    made: set[int] = set()
    ins: set[int] = set()
    for i in o.ops:
        op = trace.ops[i]
        ins.update(x for x in op.inputs if x not in made)
        made.update(op.outputs)
    return ins


def group(chosen: list[RecomputeOption], trace: Trace) -> tuple[Recompute, ...]:
    """One :class:`~tierflow.plan.Recompute` per ``before_op``: the union of its options'
    tensors and ops, in trace order."""
    by_op: dict[int, list[RecomputeOption]] = {}
    for o in chosen:
        by_op.setdefault(o.before_op, []).append(o)
    out = []
    for b in sorted(by_op):
        os_ = by_op[b]
        ops = tuple(sorted({i for o in os_ for i in o.ops}))
        out.append(Recompute(tuple(sorted(o.tensor for o in os_)), ops, b, any(o.rng for o in os_)))
    return tuple(out)


def check_recomputes(trace: Trace, recomputes: tuple[Recompute, ...]) -> list[str]:
    """Independent check of recompute records against the trace (what
    :func:`choose_recomputes` promises): each re-run op is a pure forward op before
    ``before_op``; each input is an output of an earlier op of the chain, or on the
    device at ``before_op`` (persistent, or live then and not dropped by another record
    at that point); each re-created tensor is dropped after its last use before
    ``before_op`` and is an output of the chain; an RNG op only with ``restore_rng``.
    (A re-run op's other outputs are the chain's temporaries, as the
    :class:`~tierflow.plan.Recompute` contract says, even where the original is still
    live: the copy is freed after the chain's last step that reads it.)
    Returns the problems found (empty: consistent)."""
    problems = []
    dropped: dict[int, tuple[int, int]] = {}  # tensor -> (last use before, before_op)
    for r in recomputes:
        for t in r.tensors:
            uses = trace.uses(t)
            prev = uses[uses < r.before_op]
            if trace.persistent[t] or not prev.size or r.before_op not in set(uses.tolist()) and int(trace.death[t]) < r.before_op:
                problems.append(f"recompute before op {r.before_op}: tensor {t} is not one it can drop")
                continue
            dropped[t] = (int(prev[-1]), r.before_op)
    for r in recomputes:
        made: set[int] = set()
        for i in r.ops:
            op = trace.ops[i]
            if not (i < r.before_op and op.phase == "forward" and op.pure):
                problems.append(f"recompute before op {r.before_op}: op {i} is not a pure forward op before it")
            if op.rng and not r.restore_rng:
                problems.append(f"recompute before op {r.before_op}: op {i} draws random numbers, RNG not restored")
            for x in op.inputs:
                if x in made:
                    continue
                gone = x in dropped and dropped[x][0] < r.before_op < dropped[x][1]
                if gone or not _live_at(trace, x, r.before_op):
                    problems.append(f"recompute before op {r.before_op}: op {i} reads tensor {x}, not on the device")
            made.update(op.outputs)
        for t in r.tensors:
            if t not in made:
                problems.append(f"recompute before op {r.before_op}: tensor {t} is not made by its ops")
    return problems


@dataclass
class Lowered:
    """A trace as the levers leave it, and the way back to the original's ids.

    Attributes:
        trace: the lowered trace (plan moves on it with any move planner).
        original: the trace the levers are for.
        op_of: per lowered op, the original op it is (``-1`` for a re-run op).
        before_of: per lowered op, for a re-run op the original op it runs before.
        tensor_of: per lowered tensor, the original tensor (a re-created tensor maps to
            the tensor it re-creates; ``-1`` for a chain's temporary).
        recreated: lowered ids of re-created tensors (moves of theirs are dropped).
        recomputes, host_steps: the records the plan carries.
    """

    trace: Trace
    original: Trace
    op_of: np.ndarray
    before_of: np.ndarray
    tensor_of: np.ndarray
    recreated: frozenset[int]
    recomputes: tuple[Recompute, ...] = ()
    host_steps: tuple[HostStep, ...] = ()
    extra_s: float = 0.0  # compute-stream time added (re-run ops) less time removed
    meta: dict = field(default_factory=dict)

    def plan(self, lowered_plan: Plan, policy: str = "tierflow") -> Plan:
        """The original trace's plan for a plan made on the lowered trace: its moves in
        original ids, plus the recompute and host-step records. A move of a re-created
        tensor or a chain temporary is dropped; one issued after a re-run op is issued
        after the op before its chain (a prefetch) or after the op it runs before (an
        eviction, dropped if the tensor dies there); a prefetch needed by a re-run op
        is needed by the op its chain runs before (where the chain reads it)."""
        tr = self.original
        moves = []
        for m in lowered_plan.moves:
            if m.tensor in self.recreated:
                continue
            t = int(self.tensor_of[m.tensor])
            if t < 0:
                continue
            a = int(self.op_of[m.after_op])
            if a < 0:
                b = int(self.before_of[m.after_op])
                if m.kind == "prefetch":
                    a = b - 1 if b > 0 else tr.n_ops - 1
                else:
                    if not tr.persistent[t] and int(tr.death[t]) <= b:
                        continue
                    a = b
            need = m.needed_by
            if need is not None:
                nb = int(self.op_of[need])
                if nb < 0:
                    # needed by a re-run op: by the op its chain runs before, where the
                    # chain reads it (a use of a non-persistent tensor, as the validator
                    # counts uses); a weight by its next use of the trace's own from there
                    nb = int(self.before_of[need])
                    if tr.persistent[t]:
                        uses = tr.uses(t)
                        later = uses[uses >= nb]
                        nb = int(later[0]) if later.size else int(uses[0])
                need = nb
            moves.append(Move(m.kind, t, a, m.tier, need))
        return Plan(policy, tuple(moves), budget_bytes=lowered_plan.budget_bytes,
                    reactive=lowered_plan.reactive, frees_dead=lowered_plan.frees_dead,
                    refetch_dead=lowered_plan.refetch_dead, headroom=lowered_plan.headroom,
                    meta=dict(lowered_plan.meta), recomputes=self.recomputes,
                    host_steps=self.host_steps)


def lower(trace: Trace, recomputes: tuple[Recompute, ...] = (),
          host_steps: tuple[HostStepOption, ...] = ()) -> Lowered:
    """The trace as ``recomputes`` and ``host_steps`` leave it (see :class:`Lowered`).

    Host-stepped optimizer ops are removed, with every tensor only they used (optimizer
    state, the update's temporaries); each recompute chain is inserted before its
    ``before_op`` as copies of its ops, whose outputs are new tensors; from there on the
    re-created tensors' uses name the new tensors, so the originals die at their last
    use before it.
    """
    removed = {i for h in host_steps for i in h.ops}
    by_before = {r.before_op: r for r in recomputes}
    n_t = trace.n_tensors
    tensors: list[TensorInfo] = []
    tensor_of: list[int] = []
    new_id: dict[int, int] = {}

    def orig(t: int) -> int:
        if t not in new_id:
            new_id[t] = len(tensors)
            info = trace.tensors[t]
            tensors.append(TensorInfo(new_id[t], info.bytes, info.kind, info.persistent, info.name, info.key,
                                      external=info.external))
            tensor_of.append(t)
        return new_id[t]

    current: dict[int, int] = {}  # original tensor -> its re-created lowered id, from its before_op
    recreated: set[int] = set()
    ops: list[Op] = []
    op_of: list[int] = []
    before_of: list[int] = []
    extra = 0.0
    for i, op in enumerate(trace.ops):
        r = by_before.get(i)
        if r is not None:
            local: dict[int, int] = {}
            for j in r.ops:
                src = trace.ops[j]
                ins = tuple(local.get(x, current.get(x, None)) if (x in local or x in current) else orig(x)
                            for x in src.inputs)
                outs = []
                for y in src.outputs:
                    if y not in local:
                        info = trace.tensors[y]
                        nid = len(tensors)
                        tensors.append(TensorInfo(nid, info.bytes, info.kind, False, f"{info.name}@recompute", None))
                        tensor_of.append(y if y in r.tensors else -1)
                        local[y] = nid
                    outs.append(local[y])
                ops.append(Op(src.name, "backward", src.duration_s, ins, tuple(outs), src.scope, src.rng, src.pure))
                op_of.append(-1)
                before_of.append(i)
                extra += src.duration_s
            for t in r.tensors:
                current[t] = local[t]
                recreated.add(local[t])
        if i in removed:
            extra -= op.duration_s
            continue
        ops.append(Op(op.name, op.phase, op.duration_s,
                      tuple(current[x] if x in current else orig(x) for x in op.inputs),
                      tuple(current[x] if x in current else orig(x) for x in op.outputs),
                      op.scope, op.rng, op.pure))
        op_of.append(i)
        before_of.append(-1)
    del n_t
    if any(t.held_until is not None for t in trace.tensors):
        # a tensor's memory held past its last use (the runtime's trace) is held to the
        # same original op here: the last lowered op at or before it
        at = np.full(trace.n_ops, -1, dtype=np.int64)
        for k, i in enumerate(op_of):
            if i >= 0:
                at[i] = k
        at = np.maximum.accumulate(at)
        dropped = {t for r in recomputes for t in r.tensors}
        for k, t in enumerate(tensor_of):
            # (a recomputed tensor's memory is held by its re-made copy, not the original)
            if t < 0 or (new_id.get(t) == k and t in dropped):
                continue
            held = trace.tensors[t].held_until
            if held is not None and at[held] >= 0:
                tensors[k] = dataclasses.replace(tensors[k], held_until=int(at[held]))
    low = Trace(ops, tensors, name=f"{trace.name}+levers", meta=dict(trace.meta))
    return Lowered(low, trace, np.array(op_of, dtype=np.int64), np.array(before_of, dtype=np.int64),
                   np.array(tensor_of, dtype=np.int64), frozenset(recreated), tuple(recomputes),
                   tuple(h for u in host_steps for h in u.steps), extra)
