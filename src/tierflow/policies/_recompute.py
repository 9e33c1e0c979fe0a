"""Shared machinery of the recompute peers (``checkpoint``, ``selective``).

Both wrap each *block* of the model (a transformer layer, a residual stage) in
``torch.utils.checkpoint`` (non-reentrant) and differ in what the block keeps. This
module finds the blocks on a trace, turns "keep these, recompute the rest" into one
:class:`~tierflow.plan.Recompute` per block, and computes the device curve such a plan
implies, so a policy knows before building the plan whether it meets the budget.

Blocks (:func:`find_blocks`):

* with scopes (``Op.scope``, the ``nn.Module`` path): the *repeated level* of the model.
  A scope component ending in a number (``h.3``, ``layers.12``, ``layer2.1``,
  ``encoder_layer_4``) is a member of the family of its siblings with the same stem; the
  blocks are the members of every family, at the shallowest depth where some family has
  two members whose forward ops are the same sequence of operators (digits in op names
  ignored). That picks
  ``transformer.h.N`` in GPT-2 and ``layers.N`` in Llama (not the MoE experts inside
  them) and ``layerK.M`` in ResNet (the bottlenecks: the four stages ``layer1..4``
  differ from each other, the blocks inside a stage do not). A regex ``pattern`` can
  name the block scopes instead. A block's region is each maximal run of consecutive
  forward ops under its scope (a module called twice is checkpointed twice, as
  ``checkpoint`` wraps each call);
* without scopes (G10 workloads) or without a repeated level: Chen et al. 2016's
  sqrt(n) segmentation of the forward ops as ``torch.utils.checkpoint.checkpoint_sequential``
  does it (pytorch/pytorch ``torch/utils/checkpoint.py``): ``segments`` chunks of
  ``n // segments`` ops, the last one (with the remainder) not checkpointed.

What a checkpointed block drops (:func:`block_recompute`): a tensor its own forward ops
produce, that some backward op uses, and that no forward op outside the region uses
(the region's outputs, such as the residual stream, are the next block's inputs and
stay). Everything the region reads from outside (its input, the parameters, masks)
stays. The dropped tensors are re-created by one chain run just before the first
backward op that uses any of them (non-reentrant checkpoint recomputes on the first
unpack and keeps each recomputed tensor until it is unpacked).

The device curve (:func:`planned_device_bytes`) counts, on top of the trace's live
bytes: a dropped tensor is absent from the op after its last use before the chain to
the op before the chain; an input the chain reads stays live until the chain runs
(see :class:`~tierflow.plan.Recompute`); the chain's other outputs (temporaries, and
duplicates of tensors still live, which PyTorch also allocates) are all held while the
chain runs, just before the op it runs before, when that op's own outputs are not born
yet: the count at that op is the larger of the two (as :func:`tierflow.plan.validate`
counts a chain).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from ..errors import PolicyError
from ..hardware import Hardware
from ..plan import Plan, Recompute
from ..trace import Trace
from ._common import no_fit

IMPURE = ("rerun", "keep")  # what a chain does with an op that is not pure
_NUMBERED = re.compile(r"^(.*?)(\d+)$")
_DIGITS = re.compile(r"\d+")  # op names that carry a layer index (h3.qkv) compare equal


@dataclass(frozen=True)
class Block:
    """One checkpointed region: a maximal run of consecutive forward ops.

    Attributes:
        name: the block's scope (``transformer.h.3``) or ``segment K``.
        ops: its forward op indices, consecutive and in order.
    """

    name: str
    ops: tuple[int, ...]


@dataclass(frozen=True)
class Blocks:
    """The regions found on a trace and how (``"scopes"``, ``"pattern"``, ``"sqrt(n)"``)."""

    blocks: tuple[Block, ...]
    found_by: str


def forward_ops(trace: Trace) -> list[int]:
    return [i for i, o in enumerate(trace.ops) if o.phase == "forward"]


def _runs(trace: Trace, key_of: dict[int, str]) -> list[Block]:
    """Maximal runs of consecutive forward ops with the same block key."""
    out: list[Block] = []
    cur: list[int] = []
    cur_key: str | None = None
    prev = -2
    for i in forward_ops(trace):
        k = key_of.get(i)
        if cur and (k != cur_key or i != prev + 1):
            out.append(Block(cur_key or "", tuple(cur)))
            cur = []
        if k is not None:
            cur.append(i)
        cur_key, prev = k, i
    if cur:
        out.append(Block(cur_key or "", tuple(cur)))
    return out


def _block_scopes_by_structure(trace: Trace) -> list[tuple[str, ...]]:
    """The block prefixes of the repeated level (see the module docstring), or []."""
    # numbered prefix -> its family (parent path, stem) and its forward op names
    signature: dict[tuple[str, ...], list[str]] = {}
    family: dict[tuple[str, ...], tuple[tuple[str, ...], str]] = {}
    composite: set[tuple[str, ...]] = set()  # prefixes with submodules of their own
    for i in forward_ops(trace):
        scope = trace.ops[i].scope
        if not scope:
            continue
        parts = tuple(scope.split("."))
        for k in range(1, len(parts) + 1):
            m = _NUMBERED.match(parts[k - 1])
            if m is None:
                continue
            prefix = parts[:k]
            family[prefix] = (parts[: k - 1], m.group(1))
            signature.setdefault(prefix, []).append(_DIGITS.sub("#", trace.ops[i].name))
            if k < len(parts):
                composite.add(prefix)
    by_depth: dict[int, dict[tuple, list[tuple[str, ...]]]] = {}
    for prefix, fam in family.items():
        by_depth.setdefault(len(prefix), {}).setdefault(fam, []).append(prefix)
    levels = []  # (ops covered, members, depth)
    for depth, families in by_depth.items():
        # a level repeats when one of its families has two members with submodules
        # running the same operators (the leaf layers of a Sequential are not blocks)
        def repeats(members: list[tuple[str, ...]]) -> bool:
            blocks = [tuple(signature[m]) for m in members if m in composite]
            return len(set(blocks)) < len(blocks)

        repeated = any(repeats(members) for members in families.values())
        if repeated:
            members = [m for ms in families.values() for m in ms]
            levels.append((sum(len(signature[m]) for m in members), len(members), depth, members))
    if not levels:
        return []
    most = max(lv[0] for lv in levels)
    # the level that covers (nearly) the most ops, and among those the finest
    _, _, _, members = max((lv for lv in levels if lv[0] >= 0.9 * most), key=lambda lv: (lv[1], -lv[2]))
    return sorted(members)


def find_blocks(trace: Trace, pattern: str = "", segments: int = 0) -> Blocks:
    """The checkpointed regions of ``trace`` (see the module docstring).

    Args:
        trace: the iteration.
        pattern: a regex a block's scope matches in full (e.g. ``transformer\\.h\\.\\d+``);
            an op belongs to the block of the shortest prefix of its scope that matches.
            Empty: the repeated level, found from the scopes.
        segments: for traces without scopes: how many segments (0: the integer nearest
            sqrt(n) for n forward ops).

    Raises:
        PolicyError: ``pattern`` is not a regex, or matches no op's scope.
    """
    key_of: dict[int, str] = {}
    if pattern:
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise PolicyError(f"pattern {pattern!r}: not a regular expression ({e})") from None
        for i in forward_ops(trace):
            scope = trace.ops[i].scope
            if not scope:
                continue
            parts = scope.split(".")
            for k in range(1, len(parts) + 1):
                prefix = ".".join(parts[:k])
                if rx.fullmatch(prefix):
                    key_of[i] = prefix
                    break
        if not key_of:
            raise PolicyError(f"pattern {pattern!r} matches no forward op's scope in trace {trace.name!r}")
        return Blocks(tuple(_runs(trace, key_of)), "pattern")
    prefixes = _block_scopes_by_structure(trace)
    if prefixes:
        wanted = set(prefixes)
        for i in forward_ops(trace):
            scope = trace.ops[i].scope
            if not scope:
                continue
            parts = tuple(scope.split("."))
            for k in range(1, len(parts) + 1):
                if parts[:k] in wanted:
                    key_of[i] = ".".join(parts[:k])
                    break
        return Blocks(tuple(_runs(trace, key_of)), "scopes")
    return sqrt_segments(trace, segments)


def sqrt_segments(trace: Trace, segments: int = 0) -> Blocks:
    """Chen et al.'s sqrt(n) segments, as ``checkpoint_sequential`` cuts them: the
    forward ops in ``segments`` chunks of ``n // segments`` ops, all but the last
    (which also takes the remainder) checkpointed.

    Raises:
        PolicyError: ``segments`` is negative.
    """
    fwd = forward_ops(trace)
    n = len(fwd)
    if segments < 0:
        raise PolicyError(f"segments must be >= 0 (0 = sqrt(n)), got {segments}")
    k = segments or max(1, round(math.sqrt(n)))
    k = min(k, n) if n else 0
    if k < 2:
        return Blocks((), "sqrt(n)")
    size = n // k
    blocks = [Block(f"segment {j}", tuple(fwd[j * size : (j + 1) * size])) for j in range(k - 1)]
    # a segment must be consecutive ops: forward ops interleaved with others split it
    out: list[Block] = []
    for b in blocks:
        run: list[int] = []
        for i in b.ops:
            if run and i != run[-1] + 1:
                out.append(Block(b.name, tuple(run)))
                run = []
            run.append(i)
        if run:
            out.append(Block(b.name, tuple(run)))
    return Blocks(tuple(out), "sqrt(n)")


# -- what a block drops, and the chain that brings it back --------------------------------


class _Uses:
    """Per tensor: its forward and backward uses (op indices)."""

    def __init__(self, trace: Trace):
        n = trace.n_tensors
        self.fwd: list[list[int]] = [[] for _ in range(n)]
        self.bwd: list[list[int]] = [[] for _ in range(n)]
        self.other: list[bool] = [False] * n
        for i, o in enumerate(trace.ops):
            for t in o.tensors:
                if o.phase == "forward":
                    self.fwd[t].append(i)
                elif o.phase == "backward":
                    self.bwd[t].append(i)
                else:
                    self.other[t] = True


def block_recompute(
    trace: Trace,
    block: Block,
    uses: _Uses,
    saved_ops: frozenset[int] = frozenset(),
    early_stop: bool = True,
) -> Recompute | None:
    """The :class:`Recompute` of one checkpointed region, or ``None`` when it drops nothing.

    Args:
        trace: the iteration.
        block: the region.
        uses: :class:`_Uses` of ``trace``.
        saved_ops: ops of the region whose outputs are kept (selective checkpointing's
            save list); they are not re-run (their outputs come from the cache).
        early_stop: the chain ends at the last op that saves something for backward
            (``torch.utils.checkpoint``'s default: it stops recomputing once every
            saved tensor is back); else every op of the region is re-run.
    """
    region = set(block.ops)
    persistent = trace.persistent
    dropped: list[int] = []
    seen: set[int] = set()
    for i in block.ops:
        if i in saved_ops:
            continue
        for t in trace.ops[i].outputs:
            if t in seen or persistent[t]:
                continue
            seen.add(t)
            f = uses.fwd[t]
            # produced here (born at this op), wanted by backward, used in forward only here
            if f and f[0] == i and uses.bwd[t] and not uses.other[t] and all(u in region for u in f):
                dropped.append(t)
    if not dropped:
        return None
    drop = set(dropped)
    before = min(uses.bwd[t][0] for t in dropped)
    chain = [i for i in block.ops if i not in saved_ops]
    if early_stop:
        # the last op that packs a tensor for backward: one that makes a dropped tensor
        # or reads a parameter its backward needs (a matmul saves its weight)
        def packs(i: int) -> bool:
            o = trace.ops[i]
            return any(t in drop for t in o.outputs) or any(
                persistent[t] and uses.bwd[t] for t in o.inputs
            )

        last = max(i for i in chain if packs(i))
        chain = [i for i in chain if i <= last]
    # torch.utils.checkpoint restores the RNG state by default (preserve_rng_state=True)
    return Recompute(tuple(sorted(dropped)), tuple(chain), before, restore_rng=True)


def block_recomputes(
    trace: Trace,
    blocks: Blocks,
    saved_ops: frozenset[int] = frozenset(),
    early_stop: bool = True,
) -> tuple[Recompute, ...]:
    """One :class:`Recompute` per region that drops something, in forward order."""
    uses = _Uses(trace)
    out = []
    for b in blocks.blocks:
        r = block_recompute(trace, b, uses, saved_ops, early_stop)
        if r is not None:
            out.append(r)
    return tuple(out)


def planned_device_bytes(trace: Trace, recomputes: tuple[Recompute, ...]) -> np.ndarray:
    """Planned device bytes per op of a plan whose only actions are ``recomputes``
    (the counting rules are in the module docstring)."""
    n = trace.n_ops
    delta = np.zeros(n + 1, dtype=np.int64)
    sizes = trace.sizes
    death, first, persistent = trace.death, trace.first_use, trace.persistent
    born = ~persistent
    births = np.bincount(trace.birth[born], weights=sizes[born], minlength=n).astype(np.int64)
    held_until: dict[int, int] = {}
    for r in recomputes:
        b = r.before_op
        drop = set(r.tensors)
        for t in r.tensors:
            u = trace.uses(t)
            last = int(u[u < b].max())
            delta[last + 1] -= sizes[t]
            delta[b] += sizes[t]
        # tensors the chain makes: born at one of its ops (an in-place op's output
        # that was born elsewhere is an input of the chain, not something it makes)
        made = {t for i in r.ops for t in trace.ops[i].outputs if int(first[t]) == i and not persistent[t]}
        for i in r.ops:
            for t in trace.ops[i].inputs:
                if t not in made and not persistent[t] and int(death[t]) < b:
                    held_until[t] = max(held_until.get(t, -1), b)
        # while the chain runs, op b's own outputs are not born yet: the chain's
        # temporaries raise the count at b only by what they exceed those by; each
        # temporary lives until the last step of the chain that reads it
        temps = max(0, _chain_temps_peak(trace, r, made, drop) - int(births[b]))
        delta[b] += temps
        delta[b + 1] -= temps
    for t, b in held_until.items():
        delta[int(death[t]) + 1] += sizes[t]
        delta[b + 1] -= sizes[t]
    return trace.live_bytes + np.cumsum(delta[:-1])


def _chain_temps_peak(trace: Trace, r: Recompute, made: set[int], drop: set[int]) -> int:
    """The most bytes chain ``r`` holds beyond the tensors it re-creates (counted whole
    from its start by the caller): at each step, the re-created ones made so far and
    the temporaries not yet past their last read, less all re-created ones."""
    sizes = trace.sizes
    n = len(r.ops)
    last: dict[int, int] = {}
    born: dict[int, int] = {}
    for k, i in enumerate(r.ops):
        for t in trace.ops[i].tensors:
            if t in made:
                born.setdefault(t, k)
                last[t] = k
    grows, frees = [0] * n, [0] * n
    for t, k in born.items():
        grows[k] += int(sizes[t])
        if t not in drop:
            frees[last[t]] += int(sizes[t])
    kept_total = sum(int(sizes[t]) for t in born if t in drop)
    live = peak = 0
    for k in range(n):
        live += grows[k]
        peak = max(peak, live)
        live -= frees[k]
    return max(0, peak - kept_total)


def recompute_seconds(trace: Trace, recomputes: tuple[Recompute, ...]) -> float:
    """Compute time the chains add to the iteration."""
    return float(sum(trace.ops[i].duration_s for r in recomputes for i in r.ops))


# -- the plan -------------------------------------------------------------------------------


def check_impure(policy: str, value: str) -> str:
    """The ``impure`` option: ``rerun`` (as PyTorch does) or ``keep``.

    Raises:
        PolicyError: another value.
    """
    if value not in IMPURE:
        raise PolicyError(f"{policy}: impure {value!r} is not one of {', '.join(IMPURE)}")
    return value


def keep_impure(trace: Trace, recomputes: tuple[Recompute, ...]) -> tuple[Recompute, ...]:
    """Re-run only pure ops: what an impure op makes stays on the device (an op of the
    chain that reads it reads the kept tensor)."""
    out = []
    for r in recomputes:
        kept = {t for i in r.ops if not trace.ops[i].pure for t in trace.ops[i].outputs}
        tensors = tuple(t for t in r.tensors if t not in kept)
        if tensors:
            ops = tuple(i for i in r.ops if trace.ops[i].pure)
            out.append(Recompute(tensors, ops, r.before_op, r.restore_rng))
    return tuple(out)


def unchanged_plan(policy: str, budget: float, blocks: Blocks) -> Plan:
    """The plan of a trace that fits as it is: nothing checkpointed."""
    return Plan(policy=policy, budget_bytes=budget,
                meta={"blocks": len(blocks.blocks), "blocks_from": blocks.found_by, "recomputes": 0,
                      "note": "fits without checkpointing"})


def recompute_plan(
    policy: str,
    trace: Trace,
    hardware: Hardware,
    budget: float,
    blocks: Blocks,
    recomputes: tuple[Recompute, ...],
    impure: str,
    meta: dict | None = None,
) -> Plan:
    """The plan of ``recomputes`` if it meets ``budget``.

    With ``impure="keep"`` only pure ops are re-run (:func:`keep_impure`); the plan
    records how many impure ops it re-runs (``meta["impure_reruns"]``, which is what
    lets the validator accept them).

    Raises:
        PlanError: the plan exceeds the budget (with the bytes).
    """
    if impure == "keep":
        recomputes = keep_impure(trace, recomputes)
    curve = planned_device_bytes(trace, recomputes)
    peak = int(curve.max()) if len(curve) else 0
    dropped = int(sum(int(trace.sizes[t]) for r in recomputes for t in r.tensors))
    if peak > budget:
        raise no_fit(
            policy, trace, hardware, budget,
            f"with {len(recomputes)} of {len(blocks.blocks)} blocks ({blocks.found_by}) recomputed, "
            f"{dropped} bytes dropped", curve,
        )
    info = {
        "blocks": len(blocks.blocks),
        "blocks_from": blocks.found_by,
        "recomputes": len(recomputes),
        "recomputed_bytes": dropped,
        "recompute_s": recompute_seconds(trace, recomputes),
        "planned_peak_bytes": peak,
        "impure": impure,
        "impure_reruns": sum(1 for r in recomputes for i in r.ops if not trace.ops[i].pure),
    }
    info.update(meta or {})
    return Plan(policy=policy, budget_bytes=budget, meta=info, recomputes=recomputes)
