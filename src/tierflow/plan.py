"""Plan: where each tensor lives and when it moves, in op-relative time.

A plan is a list of :class:`Move` records repeated every iteration. Time is op-relative:
an eviction or prefetch is *issued when op ``after_op`` ends*; a prefetch also names the
op that *needs* the tensor (``needed_by``), which may lie in the next iteration for a
persistent tensor whose gap wraps. The simulator turns this into seconds; the runtime
turns it into events on real streams.

Beside moves, a plan has two more actions (plan format version 2; version 1 files still
load, with neither):

* :class:`Recompute`: tensors dropped after their last use before an op and re-created
  just before it by re-running the forward ops that made them (activation
  checkpointing);
* :class:`HostStep`: a parameter's optimizer update runs on the host (ZeRO-Offload): its
  gradient goes to the host as backward produces it, its optimizer state lives there,
  and the updated parameter comes back before its next use.

Two kinds of plan:

* **planned** (``reactive=False``): the moves are a complete schedule. :func:`validate`
  checks it against the trace: nothing is prefetched that is not away, nothing is used
  while away, nothing is evicted after its last use, and planned bytes fit every tier at
  every op.
* **reactive** (``reactive=True``): the moves are hints to an on-demand pager (UVM-style
  baselines such as ``lru`` and ``deepum``); whatever they miss the simulator fetches on
  demand with LRU eviction. Only references are validated.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from .errors import PlanError
from .hardware import Hardware
from .trace import Trace

MOVE_KINDS = ("evict", "prefetch")
PLAN_FORMAT = "tierflow-plan"
PLAN_VERSION = 2
READABLE_PLAN_VERSIONS = (1, 2)


@dataclass(frozen=True, slots=True)
class Move:
    """One planned transfer.

    Attributes:
        kind: ``"evict"`` (device to ``tier``) or ``"prefetch"`` (``tier`` to device).
        tensor: tensor id.
        after_op: the transfer is issued when this op ends (index within the iteration).
        tier: destination of an eviction, source of a prefetch; ``None`` on a reactive
            prefetch means "wherever the tensor is".
        needed_by: for a prefetch, the op that uses the tensor next (may be earlier than
            ``after_op``: then it is in the next iteration).
    """

    kind: str
    tensor: int
    after_op: int
    tier: str | None = None
    needed_by: int | None = None


@dataclass(frozen=True, slots=True)
class Recompute:
    """Re-create dropped tensors by re-running the forward ops that made them.

    Each tensor in ``tensors`` is dropped (freed, no transfer) after its last use before
    ``before_op`` and re-created by running ``ops`` on the compute stream just before
    ``before_op``. Every input of a re-run op must then be on the device or an output of
    an earlier op of the chain (chains of recomputed tensors are allowed); outputs of the
    chain that are not in ``tensors`` are temporaries, each freed once the last op of the
    chain that reads it has run (as ``torch.utils.checkpoint``'s re-run forward and the
    runtime's replay let go of them): a chain's own peak is its largest sum, step by
    step, of what it has re-created so far and the temporaries still to be read.
    An input the chain reads but does not make (a checkpointed block's input, an output
    selective checkpointing saved) is read at ``before_op``: it stays live on the device
    until the chain has run, also where the trace's last use of it is earlier.

    Attributes:
        tensors: non-persistent tensor ids the chain re-creates, each used at or after
            ``before_op``.
        ops: trace op indices re-run, in order (forward ops, each ``pure``, except in a
            plan that models a system which re-runs impure ops as they are:
            ``torch.utils.checkpoint`` re-runs a block's BatchNorm, updating its running
            statistics a second time; the ``checkpoint`` and ``selective`` peer
            policies do that by default and say so in ``Plan.meta["impure_reruns"]``).
        before_op: the op the chain runs just before: at or before each tensor's first
            use after its drop (earlier where a tensor is re-made for a chain that reads
            it, as when a product of two dropped projections is re-made before either
            projection's own backward use).
        restore_rng: the executor restores the RNG state each op first ran with, as
            ``torch.utils.checkpoint`` does; required when a re-run op draws random
            numbers (``Op.rng``).
    """

    tensors: tuple[int, ...]
    ops: tuple[int, ...]
    before_op: int
    restore_rng: bool = True


@dataclass(frozen=True, slots=True)
class HostStep:
    """A parameter's optimizer update, run on the host instead of the device.

    The gradient goes device -> ``tier`` as soon as the last backward op that writes it
    ends (and is freed on the device when the copy lands); the optimizer state lives on
    ``tier`` for good (never on the device); the update runs on the host's compute (see
    :class:`tierflow.hardware.HostCompute`) once the gradient has arrived; the updated
    parameter is copied back to the device before its next use.

    Clarified (what :func:`validate` checks and the simulator does): "the last backward
    op that writes it" is the gradient's last use by an op that is not host-stepped,
    which must be a backward op, as every such use must be; the parameter has no device
    use after it. ``tier`` holds the optimizer state, a gradient buffer and the
    parameter's master copy for the whole run. A parameter the plan's moves keep off the
    device when its update ends gets no copy back: the update lands in its off-device
    copy, and its prefetch (or fault) waits for the update. Only planned plans host-step.
    A ``foreach``/fused op that updates several host-stepped parameters is listed in
    each of their host steps (it is one op: it leaves the device once).

    Clarified (what the runtime executes, :mod:`tierflow.runtime.host_step`): the host
    runs the parameter's whole update, as the optimizer's step does it for that
    parameter. Optimizer ops that touch only the parameter's optimizer state (its step
    counter, a device tensor in CPU mode) or no device tensor at all (the counter on the
    CPU, read with ``.item()``) run on the host too, even where a plan leaves them and
    their tensors out of ``ops`` and ``state`` (the ZeRO peers and tierflow's levers do
    where such ops form a unit of their own); such a plan is then predicted with them on
    the device, a difference of a few bytes and microseconds per parameter.

    Attributes:
        param: the parameter's tensor id.
        grad: its gradient's tensor id.
        state: its optimizer-state tensor ids.
        ops: the trace's optimizer ops for this parameter, which no longer run on the
            device (a ``foreach``/fused op shared by several parameters is host-stepped
            only if all of them are); also ops of its update that touch only
            temporaries (``a = sqrt(v); b = a + eps``), which must run on the host too,
            and its tensor-less ops (a step counter kept on the CPU).
        tier: where gradient, state and the updated parameter live on the host.
    """

    param: int
    grad: int
    state: tuple[int, ...] = ()
    ops: tuple[int, ...] = ()
    tier: str = "host"


@dataclass(frozen=True)
class Plan:
    """What a policy produces and the simulator and runtime consume.

    Attributes:
        policy: name of the policy that made it.
        moves: the schedule, repeated every iteration.
        budget_bytes: device bytes the plan may use; the simulator enforces it (``inf``
            for the unlimited-memory reference).
        reactive: moves are hints for an on-demand pager (see the module docstring).
        frees_dead: the memory system frees a tensor after its last use. A plain UVM
            pager does not know liveness (G10's Base UVM and DeepUM+): there a dead
            tensor's pages stay allocated and are written back when evicted, and its
            next birth faults them in again. Only reactive plans may set it False.
        refetch_dead: with ``frees_dead=False``, whether a tensor's dead contents are
            fetched back when its next birth overwrites them (a pager that faults on
            every access) or dropped (one that maps fresh memory for a write).
        headroom: for reactive plans, the share of the budget the pager keeps free by
            evicting least recently used tensors in the background after each op, so
            that faults seldom wait for an eviction (as UVM drivers do).
        meta: free-form facts the policy wants to report (planning time, choices).
        recomputes: tensors dropped and re-created by re-running ops (:class:`Recompute`).
        host_steps: parameters whose optimizer update runs on the host (:class:`HostStep`).
    """

    policy: str
    moves: tuple[Move, ...] = ()
    budget_bytes: float = math.inf
    reactive: bool = False
    frees_dead: bool = True
    refetch_dead: bool = False
    headroom: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)
    recomputes: tuple[Recompute, ...] = ()
    host_steps: tuple[HostStep, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "moves", tuple(self.moves))
        object.__setattr__(self, "recomputes", tuple(self.recomputes))
        object.__setattr__(self, "host_steps", tuple(self.host_steps))

    @cached_property
    def by_op(self) -> dict[int, tuple[Move, ...]]:
        """Moves grouped by ``after_op``, evictions before prefetches (room first)."""
        out: dict[int, list[Move]] = {}
        for m in self.moves:
            out.setdefault(m.after_op, []).append(m)
        return {k: tuple(sorted(v, key=lambda m: m.kind != "evict")) for k, v in out.items()}

    def count(self, kind: str) -> int:
        """How many moves of ``kind`` (``"evict"``, ``"prefetch"``), or ``"recomputed"``
        tensors, or ``"host_step"`` records the plan has."""
        if kind == "recomputed":
            return sum(len(r.tensors) for r in self.recomputes)
        if kind == "host_step":
            return len(self.host_steps)
        return sum(1 for m in self.moves if m.kind == kind)

    # -- (de)serialisation --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "policy": self.policy,
            "budget_bytes": None if self.budget_bytes == math.inf else int(self.budget_bytes),
            "reactive": self.reactive,
            "frees_dead": self.frees_dead,
            "refetch_dead": self.refetch_dead,
            "headroom": self.headroom,
            "meta": self.meta,
            "moves": [
                {k: getattr(m, k) for k in ("kind", "tensor", "after_op", "tier", "needed_by")}
                for m in self.moves
            ],
            "recomputes": [
                {"tensors": list(r.tensors), "ops": list(r.ops), "before_op": r.before_op,
                 "restore_rng": r.restore_rng}
                for r in self.recomputes
            ],
            "host_steps": [
                {"param": h.param, "grad": h.grad, "state": list(h.state), "ops": list(h.ops),
                 "tier": h.tier}
                for h in self.host_steps
            ],
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "<plan>") -> Plan:
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise PlanError(f"{source}: not a {PLAN_FORMAT} file (field 'format')")
        if data.get("version") not in READABLE_PLAN_VERSIONS:
            raise PlanError(
                f"{source}: unsupported plan version {data.get('version')!r} "
                f"(this tierflow reads versions {', '.join(map(str, READABLE_PLAN_VERSIONS))})"
            )
        moves = []
        for i, rec in enumerate(data.get("moves", [])):
            try:
                moves.append(
                    Move(
                        kind=str(rec["kind"]),
                        tensor=int(rec["tensor"]),
                        after_op=int(rec["after_op"]),
                        tier=rec.get("tier"),
                        needed_by=None if rec.get("needed_by") is None else int(rec["needed_by"]),
                    )
                )
            except (KeyError, TypeError, ValueError) as e:
                raise PlanError(f"{source}: move {i}: bad or missing field ({e})") from None
        recomputes = []
        for i, rec in enumerate(data.get("recomputes") or []):
            try:
                recomputes.append(
                    Recompute(
                        tensors=tuple(int(t) for t in rec["tensors"]),
                        ops=tuple(int(o) for o in rec["ops"]),
                        before_op=int(rec["before_op"]),
                        restore_rng=bool(rec.get("restore_rng", True)),
                    )
                )
            except (KeyError, TypeError, ValueError) as e:
                raise PlanError(f"{source}: recompute {i}: bad or missing field ({e})") from None
        host_steps = []
        for i, rec in enumerate(data.get("host_steps") or []):
            try:
                host_steps.append(
                    HostStep(
                        param=int(rec["param"]),
                        grad=int(rec["grad"]),
                        state=tuple(int(t) for t in rec.get("state", [])),
                        ops=tuple(int(o) for o in rec.get("ops", [])),
                        tier=str(rec.get("tier", "host")),
                    )
                )
            except (KeyError, TypeError, ValueError) as e:
                raise PlanError(f"{source}: host step {i}: bad or missing field ({e})") from None
        budget = data.get("budget_bytes")
        return cls(
            policy=str(data.get("policy", "external")),
            moves=tuple(moves),
            budget_bytes=math.inf if budget is None else float(budget),
            reactive=bool(data.get("reactive", False)),
            frees_dead=bool(data.get("frees_dead", True)),
            refetch_dead=bool(data.get("refetch_dead", False)),
            headroom=float(data.get("headroom", 0.0)),
            meta=dict(data.get("meta") or {}),
            recomputes=tuple(recomputes),
            host_steps=tuple(host_steps),
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict()), encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise PlanError(f"{path}: not a readable plan ({e})") from None
        return cls.from_dict(data, source=str(path))


# -- validation ---------------------------------------------------------------------------

# -- the levers: recompute and host steps ---------------------------------------------


@dataclass
class _Levers:
    """What a plan's recomputes and host steps change in the residency walk."""

    host_ops: frozenset[int] = frozenset()
    # tensor -> the ops that use it on the device, where that differs from the trace
    # (host-stepped ops removed, the chains' reads added as uses at their before_op)
    uses: dict[int, list[int]] = field(default_factory=dict)
    # tensor -> its last op on the device, where that differs from its death (a
    # host-stepped gradient leaves after its last backward use)
    last_op: dict[int, int] = field(default_factory=dict)
    # tensors never on the device (host-stepped optimizer state, host-only temporaries)
    off_device: set[int] = field(default_factory=set)
    start_tier: dict[int, str] = field(default_factory=dict)
    # bytes held on an off-device tier for the whole iteration
    host_bytes: dict[str, int] = field(default_factory=dict)
    # (tensor, dropped after op, re-created before op)
    drops: list[tuple[int, int, int]] = field(default_factory=list)
    # per before_op: [(recompute index, kept bytes, bytes the chain allocates)]
    chains: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)


def host_step_ops(plan: Plan) -> frozenset[int]:
    """The trace ops a plan's host steps take off the device."""
    return frozenset(o for h in plan.host_steps for o in h.ops)


def _check_host_steps(plan: Plan, trace: Trace, hw: Hardware, lev: _Levers) -> None:
    n_ops, n_t = trace.n_ops, trace.n_tensors
    tensors, ops = trace.tensors, trace.ops
    offload = {t.name for t in hw.tiers if t.name != hw.device}
    owner: dict[int, int] = {}  # tensor -> index of the host step covering it
    for i, h in enumerate(plan.host_steps):
        where = f"plan {plan.policy}: host step {i} (param {h.param})"
        fields = (("param", (h.param,)), ("grad", (h.grad,)), ("state", h.state))
        for fld, ids in fields:
            for t in ids:
                if not 0 <= t < n_t:
                    raise PlanError(f"{where}: field '{fld}' names tensor {t}, which does not exist (tensors: {n_t})")
        p, g = tensors[h.param], tensors[h.grad]
        if p.kind != "parameter" or not p.persistent:
            raise PlanError(f"{where}: field 'param': tensor {h.param} is a {'persistent ' if p.persistent else ''}"
                            f"{p.kind}, not a persistent parameter")
        if g.kind != "gradient" or g.persistent:
            raise PlanError(f"{where}: field 'grad': tensor {h.grad} is a {'persistent ' if g.persistent else ''}"
                            f"{g.kind}, not a gradient born in backward")
        for s in h.state:
            if tensors[s].kind != "optimizer_state" or not tensors[s].persistent:
                raise PlanError(f"{where}: field 'state': tensor {s} is a {tensors[s].kind}, not persistent optimizer state")
        for fld, ids in fields:
            for t in ids:
                if t in owner:
                    raise PlanError(f"{where}: field '{fld}': tensor {t} is already covered by host step {owner[t]}")
                owner[t] = i
        if h.tier not in offload:
            raise PlanError(f"{where}: field 'tier' is {h.tier!r}, not an off-device tier of {hw.name}")
        if not hw.route(hw.device, h.tier) or not hw.route(h.tier, hw.device):
            raise PlanError(f"{where}: field 'tier': {hw.name} has no route between {hw.device} and {h.tier}")
        for o in h.ops:
            if not 0 <= o < n_ops:
                raise PlanError(f"{where}: field 'ops' names op {o}, outside 0..{n_ops - 1}")
            if ops[o].phase != "optimizer":
                raise PlanError(f"{where}: field 'ops': op {o} ({ops[o].name}) is a {ops[o].phase} op, not an optimizer op")
        # its ops are the optimizer ops that touch its parameter, gradient or state, and
        # any that touch only the update's temporaries (checked below)
        mine = {h.param, h.grad, *h.state}
        touching = {int(o) for t in mine for o in trace.uses(t).tolist() if ops[int(o)].phase == "optimizer"}
        missing = sorted(touching - set(h.ops))
        if missing:
            raise PlanError(f"{where}: field 'ops' must hold every optimizer op touching its tensors: "
                            f"op {missing[0]} ({ops[missing[0]].name}) is missing")
        for o in set(h.ops) - touching:
            if any(trace.tensors[t].persistent for t in trace.op_tensors[o]):
                raise PlanError(f"{where}: field 'ops': op {o} ({ops[o].name}) touches none of its tensors, "
                                f"and not only temporaries either")
    host_ops = host_step_ops(plan)
    lev.host_ops = host_ops
    # a host-stepped op touches only covered tensors and temporaries of the host step
    # (a shared foreach op is host-stepped only if all of its parameters are)
    for o in sorted(host_ops):
        for t in trace.op_tensors[o]:
            if t in owner:
                continue
            info = tensors[t]
            if info.persistent:
                raise PlanError(
                    f"plan {plan.policy}: host-stepped op {o} ({ops[o].name}) touches tensor {t} "
                    f"({info.name or info.kind}), which no host step covers: a shared optimizer op is "
                    f"host-stepped only if all of its parameters are"
                )
            elsewhere = [u for u in trace.uses(t).tolist() if u not in host_ops]
            if elsewhere:
                u = elsewhere[0]
                raise PlanError(
                    f"plan {plan.policy}: host-stepped op {o} ({ops[o].name}) touches tensor {t} "
                    f"({info.name or info.kind}), which op {u} ({ops[u].name}) also uses on the device: "
                    f"a temporary of the host's update must be used by host-stepped ops only (a shared "
                    f"optimizer op is host-stepped only if all of its parameters are)"
                )
            lev.off_device.add(t)  # a temporary of the host's update
    for i, h in enumerate(plan.host_steps):
        where = f"plan {plan.policy}: host step {i} (param {h.param})"
        p, g = tensors[h.param], tensors[h.grad]
        for s in h.state:
            lev.off_device.add(s)
            lev.start_tier[s] = h.tier
        dev_uses = [u for u in trace.uses(h.grad).tolist() if u not in host_ops]
        if not dev_uses:
            raise PlanError(f"{where}: field 'grad': tensor {h.grad} is not written by any backward op")
        for u in dev_uses:
            if ops[u].phase != "backward":
                raise PlanError(f"{where}: field 'grad': tensor {h.grad} is used on the device by op {u} "
                                f"({ops[u].name}), a {ops[u].phase} op, after it went to {h.tier}")
        if min(u for u in trace.uses(h.grad).tolist() if u in host_ops) < dev_uses[-1]:
            raise PlanError(f"{where}: field 'grad': a host-stepped op uses tensor {h.grad} before its last backward op")
        lev.uses[h.grad] = dev_uses
        lev.last_op[h.grad] = dev_uses[-1]
        lev.uses[h.param] = [u for u in trace.uses(h.param).tolist() if u not in host_ops]
        if lev.uses[h.param] and lev.uses[h.param][-1] > dev_uses[-1]:
            u = lev.uses[h.param][-1]
            raise PlanError(f"{where}: field 'param': op {u} ({ops[u].name}) uses tensor {h.param} on the device "
                            f"after its gradient's last backward op {dev_uses[-1]}, when its update has begun")
        # on the host tier for good: optimizer state, the gradient's buffer and the
        # parameter's master copy
        held = sum(tensors[s].bytes for s in h.state) + g.bytes + p.bytes
        lev.host_bytes[h.tier] = lev.host_bytes.get(h.tier, 0) + held
    for i, m in enumerate(plan.moves):
        if m.tensor in owner and m.tensor != plan.host_steps[owner[m.tensor]].param:
            h = plan.host_steps[owner[m.tensor]]
            fld = "grad" if m.tensor == h.grad else "state"
            raise PlanError(f"plan {plan.policy}: move {i} ({m.kind} tensor {m.tensor}): the tensor is the "
                            f"{fld} of host step {owner[m.tensor]}, which stays where the host step puts it")


def _check_recomputes(plan: Plan, trace: Trace, lev: _Levers) -> None:
    n_ops, n_t = trace.n_ops, trace.n_tensors
    ops = trace.ops
    sizes = trace.sizes
    persistent = trace.persistent
    birth, death, first = trace.birth, trace.death, trace.first_use
    impure_ok = bool(plan.meta.get("impure_reruns"))
    host_grads = set(lev.last_op)  # (only host steps have set last_op so far)
    # per tensor, its dropped spans (drop after op d, re-created before op b), in order
    spans: dict[int, list[tuple[int, int, int]]] = {}
    for i, r in enumerate(plan.recomputes):
        where = f"plan {plan.policy}: recompute {i} (before op {r.before_op})"
        b = r.before_op
        if not 0 <= b < n_ops:
            raise PlanError(f"{where}: field 'before_op' is outside 0..{n_ops - 1}")
        if not r.tensors:
            raise PlanError(f"{where}: field 'tensors' is empty")
        if not r.ops:
            raise PlanError(f"{where}: field 'ops' is empty")
        for o in r.ops:
            if not 0 <= o < n_ops:
                raise PlanError(f"{where}: field 'ops' names op {o}, outside 0..{n_ops - 1}")
            op = ops[o]
            if op.phase != "forward":
                raise PlanError(f"{where}: field 'ops': op {o} ({op.name}) is a {op.phase} op; only forward ops are re-run")
            if not op.pure and not impure_ok:
                raise PlanError(f"{where}: field 'ops': op {o} ({op.name}) is not pure (safe to re-run), "
                                f"and the plan does not say it re-runs impure ops (meta 'impure_reruns')")
            if op.rng and not r.restore_rng:
                raise PlanError(f"{where}: field 'ops': op {o} ({op.name}) draws random numbers, "
                                f"so the recompute needs restore_rng")
            if o >= b:
                raise PlanError(f"{where}: field 'ops': op {o} ({op.name}) does not run before op {b}")
        # what the chain makes: the tensors born at its ops (an output born elsewhere,
        # such as an in-place update's, is written where it already is)
        produced = {t for o in r.ops for t in ops[o].outputs if not persistent[t] and int(first[t]) == o}
        seen: set[int] = set()
        for t in r.tensors:
            if not 0 <= t < n_t:
                raise PlanError(f"{where}: field 'tensors' names tensor {t}, which does not exist (tensors: {n_t})")
            if persistent[t]:
                raise PlanError(f"{where}: field 'tensors': tensor {t} is persistent; only non-persistent tensors are recomputed")
            if t in lev.off_device or t in host_grads:
                raise PlanError(f"{where}: field 'tensors': tensor {t} is host-stepped")
            if t not in produced:
                raise PlanError(f"{where}: field 'tensors': tensor {t} is not made (born) by any op of the chain")
            uses = trace.uses(t)
            before = uses[uses < b]
            if before.size == 0:
                raise PlanError(f"{where}: field 'tensors': tensor {t} is not born before op {b}")
            if int(death[t]) < b:
                raise PlanError(f"{where}: field 'tensors': tensor {t} is not used at or after op {b} "
                                f"(its last use is op {int(death[t])})")
            if t in seen:
                raise PlanError(f"{where}: field 'tensors' names tensor {t} twice")
            seen.add(t)
            spans.setdefault(t, []).append((int(before[-1]), b, i))
    for t, ss in spans.items():
        ss.sort(key=lambda s: s[1])
        for (_, b0, i0), (d1, b1, i1) in zip(ss, ss[1:]):
            if d1 < b0:
                raise PlanError(
                    f"plan {plan.policy}: recompute {i1} (before op {b1}): tensor {t} is not used between "
                    f"its re-creation by recompute {i0} before op {b0} and op {b1}"
                )
        for d, b, _ in ss:
            lev.drops.append((t, d, b))

    def absent(x: int, b: int) -> int | None:
        """The recompute whose dropped span hides ``x`` at the instant before op ``b``."""
        # (re-created before op b itself: by a chain later in the list, or by this one
        # before it made it; one earlier in the list was found in ``earlier``)
        for d, bb, j in spans.get(x, ()):
            if d < b <= bb:
                return j
        return None

    extra_uses: dict[int, set[int]] = {}
    kept_at: dict[int, set[int]] = {}  # before_op -> tensors re-created there so far
    for i, r in enumerate(plan.recomputes):
        where = f"plan {plan.policy}: recompute {i} (before op {r.before_op})"
        b = r.before_op
        made: set[int] = set()
        earlier = kept_at.setdefault(b, set())
        born_at: list[list[int]] = [[] for _ in r.ops]  # per step: what it makes
        for k, o in enumerate(r.ops):
            op = ops[o]
            outputs = op.outputs
            for x in op.tensors:
                if x in made or x in earlier:
                    continue
                if not persistent[x] and int(first[x]) == o and x in outputs:
                    made.add(x)  # born here
                    born_at[k].append(x)
                    continue
                # read (or updated in place) from outside the chain: it must be there
                if x in lev.off_device or x in host_grads:
                    raise PlanError(f"{where}: op {o} ({op.name}) reads tensor {x}, which a host step keeps off the device")
                lo = int(birth[x])
                if not persistent[x] and not lo < b:
                    raise PlanError(
                        f"{where}: op {o} ({op.name}) reads tensor {x}, which is not born before op {b} "
                        f"and is not made earlier in the chain"
                    )
                j = absent(x, b)
                if j is not None:
                    raise PlanError(
                        f"{where}: op {o} ({op.name}) reads tensor {x}, which recompute {j} has dropped "
                        f"at that point and the chain does not make"
                    )
                if not persistent[x]:
                    extra_uses.setdefault(x, set()).add(b)
        kept = sum(int(sizes[t]) for t in r.tensors)
        lev.chains.setdefault(b, []).append((i, kept, _chain_peak(r, ops, sizes, born_at)))
        earlier.update(r.tensors)
    # an input the chain reads stays live on the device until the chain has run: its
    # life is held to op b (the walk sees a use there)
    for x, bs in extra_uses.items():
        lev.uses[x] = sorted(set(trace.uses(x).tolist()) | bs)
        if max(bs) > int(death[x]):
            lev.last_op[x] = max(bs)


# Per-tensor states in the planning walk.
_ON, _AWAY, _COMING = "on", "away", "coming"


@dataclass(frozen=True)
class Residency:
    """Planned bytes per tier during each op, and where each tensor starts an iteration."""

    tier_bytes: dict[str, np.ndarray]
    start_tier: dict[int, str]


def validate(plan: Plan, trace: Trace, hardware: Hardware) -> Residency:
    """Check a plan against its trace and hardware and return its planned residency.

    Recomputes (only in planned plans) are checked so:

    * each chain op runs before ``before_op`` and is a forward op, ``pure`` unless the
      plan says it re-runs impure ops (a true ``meta["impure_reruns"]``), and draws no
      random numbers unless ``restore_rng``;
    * the chain *makes* the tensors born at its ops (an output born elsewhere, such as an
      in-place update's, is written where it is); each kept tensor is non-persistent, not
      host-stepped, made by the chain, born before ``before_op`` and used at or after it,
      named once per chain; a tensor recomputed twice is used between the two;
    * every other tensor a chain op reads or writes is persistent or born before
      ``before_op``, is not kept off the device by a host step, and is not dropped at
      that point (by a later recompute, or by one before the same op later in the list):
      the walk treats it as used at ``before_op``, so it must be on the device there per
      the moves, and its life is held until then;
    * no move of a recomputed tensor is issued from its drop to its re-creation.

    Host steps are checked as the docstring of :class:`HostStep` says, and: each one's
    ``ops`` hold every optimizer op touching its parameter, gradient or state, and
    otherwise only optimizer ops that touch nothing persistent (the update's arithmetic
    on temporaries); every tensor a host-stepped op touches is covered by some host
    step or is a temporary only host-stepped ops use (a shared op is host-stepped only
    if all of its parameters are); no tensor is covered twice; no move of a gradient or
    state.

    The residency (bytes per tier during each op) then counts: a recomputed tensor as
    absent from the op after its drop to the op before its chain; each chain's peak
    (what the device holds before the op, less the op's own births, plus what the
    chains before it kept, plus everything the chain makes) against the budget; a
    host-stepped gradient on the device from its birth through its last backward op;
    the host tier's state, gradient buffers and master copies for the whole iteration;
    host-only temporaries nowhere.

    Raises:
        PlanError: naming the move, recompute or host step (index, tensor, op, field),
            or the op and tier at fault.
    """
    n_ops, n_t = trace.n_ops, trace.n_tensors
    tiers = {t.name for t in hardware.tiers}
    for i, m in enumerate(plan.moves):
        where = f"plan {plan.policy}: move {i} ({m.kind} tensor {m.tensor} after op {m.after_op})"
        if m.kind not in MOVE_KINDS:
            raise PlanError(f"{where}: field 'kind' is {m.kind!r}, expected one of {', '.join(MOVE_KINDS)}")
        if not 0 <= m.tensor < n_t:
            raise PlanError(f"{where}: field 'tensor' names a tensor that does not exist (tensors: {n_t})")
        if not 0 <= m.after_op < n_ops:
            raise PlanError(f"{where}: field 'after_op' is outside 0..{n_ops - 1}")
        if trace.tensors[m.tensor].external:
            raise PlanError(f"{where}: the tensor is external ({trace.tensors[m.tensor].name or 'unnamed'}: "
                            "held by the user's loop), not the executor's to move")
        if m.tier is not None and (m.tier not in tiers or m.tier == hardware.device):
            raise PlanError(f"{where}: field 'tier' is {m.tier!r}, not an off-device tier of {hardware.name}")
        if m.kind == "prefetch" and m.needed_by is not None and not 0 <= m.needed_by < n_ops:
            raise PlanError(f"{where}: field 'needed_by' is outside 0..{n_ops - 1}")
        if not plan.reactive:
            if m.tier is None:
                raise PlanError(f"{where}: a planned move must name its tier")
            if m.kind == "prefetch" and m.needed_by is None:
                raise PlanError(f"{where}: a planned prefetch must name 'needed_by'")
    if not plan.frees_dead and not plan.reactive:
        raise PlanError(f"plan {plan.policy}: only a reactive plan may keep dead tensors (frees_dead=False)")
    if not 0.0 <= plan.headroom < 1.0 or (plan.headroom and not plan.reactive):
        raise PlanError(f"plan {plan.policy}: headroom {plan.headroom} must be in [0, 1) and only on a reactive plan")
    if plan.reactive:
        if plan.recomputes or plan.host_steps:
            raise PlanError(f"plan {plan.policy}: only a planned plan may recompute or host-step "
                            f"(a reactive plan has {len(plan.recomputes)} recomputes, {len(plan.host_steps)} host steps)")
        return Residency({}, {})
    return _walk(plan, trace, hardware, levers(plan, trace, hardware))


def levers(plan: Plan, trace: Trace, hardware: Hardware) -> _Levers:
    """Check a plan's recomputes and host steps and say what they change in the walk.

    Raises:
        PlanError: naming the record (index), tensor or op, and field at fault.
    """
    lev = _Levers()
    if plan.host_steps:
        _check_host_steps(plan, trace, hardware, lev)
    if plan.recomputes:
        _check_recomputes(plan, trace, lev)
        for i, r in enumerate(plan.recomputes):
            if r.before_op in lev.host_ops:
                raise PlanError(f"plan {plan.policy}: recompute {i}: field 'before_op' is op {r.before_op}, "
                                f"which a host step runs on the host")
        per_tensor: dict[int, list[tuple[int, Move]]] = {}
        for i, m in enumerate(plan.moves):
            per_tensor.setdefault(m.tensor, []).append((i, m))
        for t, d, b in lev.drops:
            for i, m in per_tensor.get(t, ()):
                if d <= m.after_op < b:
                    raise PlanError(
                        f"plan {plan.policy}: move {i} ({m.kind} tensor {t} after op {m.after_op}) lies in "
                        f"the span where a recompute has dropped the tensor (after op {d}, until op {b})"
                    )
    return lev


def _walk(plan: Plan, trace: Trace, hw: Hardware, lev: _Levers) -> Residency:
    n_ops = trace.n_ops
    per_tensor: dict[int, list[Move]] = {}
    for m in plan.moves:
        per_tensor.setdefault(m.tensor, []).append(m)
    # planned bytes per tier, as difference arrays over ops
    delta = {t.name: np.zeros(n_ops + 1, dtype=np.int64) for t in hw.tiers}
    start_tier: dict[int, str] = {}
    sizes = trace.sizes
    off_device, lev_uses, last_op = lev.off_device, lev.uses, lev.last_op
    for t in range(trace.n_tensors):
        if t in off_device:
            continue
        moves = sorted(per_tensor.get(t, []), key=lambda m: (m.after_op, m.kind != "evict"))
        uses = lev_uses[t] if t in lev_uses else trace.uses(t).tolist()
        if trace.tensors[t].persistent:
            lo, hi = 0, n_ops - 1
            start = _start_state(moves, uses)
        else:
            lo, hi = int(trace.birth[t]), last_op.get(t, int(trace.death[t]))
            start = (_ON, None, None)
            for m in moves:
                if not lo <= m.after_op < hi:
                    raise PlanError(
                        f"plan {plan.policy}: {m.kind} of tensor {t} after op {m.after_op} lies outside "
                        f"its life (ops {lo}..{hi}); nothing uses it afterwards"
                    )
        spans, end = _tensor_walk(plan.policy, t, moves, set(uses), lo, hi, start, hw.device)
        if end != start:
            raise PlanError(
                f"plan {plan.policy}: tensor {t}: its moves do not repeat "
                f"(it starts the iteration {start[0]} and ends it {end[0]})"
            )
        if trace.tensors[t].persistent:
            start_tier[t] = start[1] if start[0] != _ON else hw.device
        size = int(sizes[t])
        for a, b, tier in spans:
            delta[tier][a] += size
            delta[tier][b + 1] -= size
    dev = delta[hw.device]
    for t, d, b in lev.drops:  # absent from after its drop until its chain runs
        if d + 1 <= b - 1:
            dev[d + 1] -= int(sizes[t])
            dev[b] += int(sizes[t])
    for tier, nbytes in lev.host_bytes.items():
        delta[tier][0] += nbytes
        delta[tier][n_ops] -= nbytes
    start_tier.update(lev.start_tier)
    tier_bytes = {name: np.cumsum(d[:-1]) for name, d in delta.items()}
    if lev.chains:
        _check_chains(plan, trace, hw, lev, tier_bytes[hw.device])
    for tier in hw.tiers:
        cap = plan.budget_bytes if tier.name == hw.device else tier.capacity
        over = np.flatnonzero(tier_bytes[tier.name] > cap)
        if over.size:
            op = int(over[0])
            raise PlanError(
                f"plan {plan.policy}: tier {tier.name} over capacity at op {op} ({trace.ops[op].name}): "
                f"{int(tier_bytes[tier.name][op])} bytes planned, {cap:.0f} available"
            )
    return Residency(tier_bytes, start_tier)


def _chain_peak(r: Recompute, ops: Any, sizes: np.ndarray, born_at: list[list[int]]) -> int:
    """The most bytes chain ``r`` holds at once while it runs: at each step, what it has
    re-created so far plus its temporaries not yet past their last read in the chain
    (``born_at``: per step, the tensors it makes)."""
    keep = set(r.tensors)
    last: dict[int, int] = {}
    for k, o in enumerate(r.ops):
        for x in ops[o].tensors:
            last[x] = k
    frees = [0] * len(born_at)  # per step: the temporaries no later step reads
    for made in born_at:
        for x in made:
            if x not in keep:
                frees[last[x]] += int(sizes[x])
    live = peak = 0
    for made, freed in zip(born_at, frees):
        live += sum(int(sizes[x]) for x in made)
        peak = max(peak, live)
        live -= freed
    return peak


def _check_chains(plan: Plan, trace: Trace, hw: Hardware, lev: _Levers, dev_bytes: np.ndarray) -> None:
    """The device holds each chain's outputs while it runs, before its op's own births."""
    born = ~trace.persistent
    if lev.off_device:
        born[list(lev.off_device)] = False
    births = np.bincount(trace.birth[born], weights=trace.sizes[born], minlength=trace.n_ops)
    for b, chains in lev.chains.items():
        base = int(dev_bytes[b]) - int(births[b]) - sum(kept for _, kept, _ in chains)
        for i, kept, alloc in chains:  # in plan order: each keeps what it re-creates
            if base + alloc > plan.budget_bytes:
                raise PlanError(
                    f"plan {plan.policy}: recompute {i} (before op {b}): tier {hw.device} over capacity while "
                    f"the chain runs: {base + alloc} bytes planned, {plan.budget_bytes:.0f} available"
                )
            base += kept


def _start_state(moves: list[Move], uses: list[int]) -> tuple:
    """Where a persistent tensor is when an iteration starts: the state its last move
    leaves it in, unless a use later in the iteration brings it back first."""
    if not moves:
        return (_ON, None, None)
    last = moves[-1]
    if last.kind == "evict":
        return (_AWAY, last.tier, None)
    if any(u > last.after_op for u in uses):
        return (_ON, None, None)
    return (_COMING, last.tier, last.needed_by)


def _tensor_walk(policy, t, moves, uses, lo, hi, state, device):
    """Walk one tensor through ops lo..hi from ``state``. Returns the spans
    ``(first_op, last_op, tier)`` in which it occupies each tier, and its final state.
    A prefetched tensor occupies the device from the op after the prefetch is issued; an
    evicted one occupies its destination from the op after the eviction is issued."""
    where = f"plan {policy}: tensor {t}"
    kind, tier, needed = state
    spans: list[tuple[int, int, str]] = []
    span_start, span_tier = lo, (tier if kind == _AWAY else device)
    i = 0
    # only ops that use the tensor or move it change anything: visit just those, in
    # order (walking every op of a long trace for every tensor is slow)
    for op in sorted({u for u in uses if lo <= u <= hi} | {m.after_op for m in moves if lo <= m.after_op <= hi}):
        if op in uses:
            if kind == _AWAY:
                raise PlanError(f"{where} is used by op {op} while planned to be on {tier}, with no prefetch before it")
            if kind == _COMING:
                if needed is not None and needed > op:
                    raise PlanError(f"{where} is used by op {op} before op {needed}, which its prefetch is needed by")
                kind, tier, needed = _ON, None, None
        while i < len(moves) and moves[i].after_op == op:
            m = moves[i]
            i += 1
            if m.kind == "evict":
                if kind != _ON:
                    raise PlanError(f"{where}: evicted after op {op} while not on the device")
                kind, tier, needed = _AWAY, m.tier, None
            else:
                if kind != _AWAY:
                    raise PlanError(f"{where}: prefetched after op {op} but it is not away from the device")
                if m.tier != tier:
                    raise PlanError(f"{where}: prefetched from {m.tier} after op {op} but it was evicted to {tier}")
                if m.needed_by not in uses:
                    raise PlanError(f"{where}: prefetch after op {op} is needed by op {m.needed_by}, which does not use it")
                kind, needed = _COMING, m.needed_by
            if op >= span_start:
                spans.append((span_start, op, span_tier))
            span_start, span_tier = op + 1, (tier if kind == _AWAY else device)
    if span_start <= hi:
        spans.append((span_start, hi, span_tier))
    return spans, (kind, tier, needed)
