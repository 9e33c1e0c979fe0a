"""Shared machinery of the DeepSpeed ZeRO peers (``zero_offload``, ``zero_infinity``).

Both run every parameter's optimizer update on the host (DeepSpeed's
``DeepSpeedCPUAdam`` over fp32 master weights, gradients and moments kept in host
memory) and so need, from a trace, which optimizer ops update which parameter, with
which gradient and optimizer state. This module:

* finds that mapping (:func:`param_updates`): the optimizer-phase ops are grouped into
  connected groups by the tensors they share (a ``foreach``/fused op joins all the
  parameters it updates into one group; PyTorch's single-tensor Adam gives one group per
  parameter); an op that touches no tensor (a step counter kept on the CPU) joins the
  group of the next op. A group's parameters are the persistent ``parameter`` tensors
  it writes; each gets the ``gradient`` and ``optimizer_state`` tensors of its group,
  matched by runtime key (``param:NAME``, ``grad:NAME``, ``opt:NAME:KEY``) where the
  trace has keys, else by the group having one parameter, else by the ops that touch
  exactly one parameter. A trace with no optimizer phase (G10's workloads) has nothing
  to offload: :class:`~tierflow.errors.PlanError` says so;
* turns it into :class:`~tierflow.plan.HostStep` records and the device bytes they save
  (:func:`host_step_delta`), counted as :class:`~tierflow.plan.HostStep` specifies:
  optimizer state never on the device; a gradient off the device from the op after the
  last op outside the host steps that uses it (the last backward op that writes it); a
  tensor only host-stepped ops use (a temporary of the update) never on the device;
* converts DeepSpeed's sizes, which are counted in *elements*, to bytes
  (:func:`element_bytes`) and names the tier of DeepSpeed's ``device`` options
  (:func:`offload_tier`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import PlanError, PolicyError
from ..hardware import Hardware
from ..plan import HostStep
from ..trace import Trace
from ..units import fmt_bytes
from ._common import pick_tier

#: DeepSpeed's ``OffloadDeviceEnum`` values that offload (``none`` does not).
DEVICES = ("cpu", "nvme")

_DTYPE_BYTES = {"fp32": 4, "float32": 4, "float": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2}


@dataclass(frozen=True, slots=True)
class ParamUpdate:
    """One parameter's optimizer update as the trace records it.

    Attributes:
        param: the parameter's tensor id.
        grad: its gradient's tensor id.
        state: its optimizer-state tensor ids.
        ops: the optimizer ops of its group (shared with the other parameters of a
            ``foreach``/fused group).
    """

    param: int
    grad: int
    state: tuple[int, ...]
    ops: tuple[int, ...]


def _groups(trace: Trace, opt_ops: list[int]) -> list[list[int]]:
    """Optimizer ops in connected groups (sharing a tensor), each sorted, in op order."""
    # an op that touches no tensor (the step counter Adam keeps on the CPU, a
    # ``_local_scalar_dense``) belongs to the update it sits in: the next op's group
    with_tensors = [i for i in opt_ops if trace.op_tensors[i]]
    if not with_tensors:
        return []
    links = []
    nxt: int | None = None
    for i in reversed(opt_ops):
        if trace.op_tensors[i]:
            nxt = i
        else:
            links.append((i, nxt if nxt is not None else with_tensors[-1]))
    return trace.op_groups(opt_ops, links)


def _name_of_key(key: str | None, prefix: str) -> str | None:
    if key is None or not key.startswith(prefix):
        return None
    rest = key[len(prefix):]
    return rest.rsplit(":", 1)[0] if prefix == "opt:" else rest


def param_updates(trace: Trace, policy: str) -> list[ParamUpdate]:
    """Every parameter the trace's optimizer updates, with its gradient, state and ops.

    Args:
        trace: the iteration.
        policy: the policy's name, for messages.

    Raises:
        PlanError: the trace has no optimizer step, or a parameter's gradient cannot be
            told apart from another's (naming the parameter and the ops).
    """
    opt_ops = [i for i, o in enumerate(trace.ops) if o.phase == "optimizer"]
    if not opt_ops:
        raise PlanError(
            f"{policy}: trace {trace.name or '<unnamed>'} has no optimizer step to offload "
            f"(no op of phase 'optimizer'; G10's workloads record forward and backward only)"
        )
    tensors = trace.tensors
    out: list[ParamUpdate] = []
    for group in _groups(trace, opt_ops):
        touched = sorted({t for i in group for t in trace.op_tensors[i]})
        written = {t for i in group for t in trace.ops[i].outputs}
        params = [t for t in touched if tensors[t].kind == "parameter" and tensors[t].persistent and t in written]
        grads = [t for t in touched if tensors[t].kind == "gradient"]
        states = [t for t in touched if tensors[t].kind == "optimizer_state"]
        if not params:
            continue
        owner = _owners(trace, group, params, grads + states, policy)
        for p in params:
            mine = [t for t in grads if owner.get(t) == p]
            if len(mine) != 1:
                ops = f"ops {group[0]}..{group[-1]}"
                raise PlanError(
                    f"{policy}: parameter {p} ({tensors[p].name or 'unnamed'}) has "
                    f"{'no' if not mine else len(mine)} gradient{'s' if len(mine) > 1 else ''} "
                    f"among the optimizer {ops} that update it; cannot host-step it"
                )
            out.append(ParamUpdate(p, mine[0], tuple(t for t in states if owner.get(t) == p), tuple(group)))
    if not out:
        raise PlanError(
            f"{policy}: trace {trace.name or '<unnamed>'} has optimizer ops but none updates a "
            f"parameter (no persistent 'parameter' tensor written in phase 'optimizer')"
        )
    return out


def _owners(trace: Trace, group: list[int], params: list[int], others: list[int], policy: str) -> dict[int, int]:
    """Which parameter each gradient / state tensor of ``group`` belongs to."""
    if len(params) == 1:
        return {t: params[0] for t in others}
    tensors = trace.tensors
    by_name = {_name_of_key(tensors[p].key, "param:"): p for p in params}
    owner: dict[int, int] = {}
    for t in others:
        name = _name_of_key(tensors[t].key, "grad:") or _name_of_key(tensors[t].key, "opt:")
        if name is not None and name in by_name:
            owner[t] = by_name[name]
    if len(owner) == len(others):
        return owner
    # no keys (a hand-made or imported trace): an op that touches one parameter only
    # says which gradient and state are that parameter's
    pset = set(params)
    for i in group:
        ts = trace.op_tensors[i]
        ps = [t for t in ts if t in pset]
        if len(ps) != 1:
            continue
        for t in ts:
            if t in owner or t in pset or tensors[t].kind not in ("gradient", "optimizer_state"):
                continue
            owner[t] = ps[0]
    return owner


def host_steps(updates: list[ParamUpdate], tier: str) -> tuple[HostStep, ...]:
    return tuple(HostStep(u.param, u.grad, u.state, u.ops, tier) for u in updates)


def host_stepped_ops(updates: list[ParamUpdate]) -> set[int]:
    return {i for u in updates for i in u.ops}


def host_step_delta(trace: Trace, updates: list[ParamUpdate], policy: str) -> np.ndarray:
    """Device bytes per op that host-stepping ``updates`` removes (<= 0 everywhere).

    Raises:
        PlanError: a gradient that no op outside the optimizer writes.
    """
    n = trace.n_ops
    sizes = trace.sizes
    gone = host_stepped_ops(updates)
    delta = np.zeros(n + 1, dtype=np.int64)
    for u in updates:
        for s in u.state:
            delta[0] -= sizes[s]
            delta[n] += sizes[s]
        uses = [int(i) for i in trace.uses(u.grad) if int(i) not in gone]
        if not uses:
            raise PlanError(
                f"{policy}: gradient {u.grad} ({trace.tensors[u.grad].name or 'unnamed'}) is used only "
                f"by optimizer ops; no backward op writes it"
            )
        # it leaves the device from the op after its last backward write (the copy
        # to the host is issued when that op ends), as an eviction would
        last, death = uses[-1], int(trace.death[u.grad])
        if last < death:
            delta[last + 1] -= sizes[u.grad]
            delta[death + 1] += sizes[u.grad]
    counted = {t for u in updates for t in (u.grad, *u.state)}
    for t in {t for i in gone for t in trace.op_tensors[i]}:
        if t in counted or trace.tensors[t].persistent:
            continue
        if all(int(i) in gone for i in trace.uses(t)):
            delta[int(trace.birth[t])] -= sizes[t]
            delta[int(trace.death[t]) + 1] += sizes[t]
    return np.cumsum(delta[:-1])


def element_bytes(trace: Trace) -> tuple[int, str]:
    """Bytes per element of the model's parameters (DeepSpeed counts its bucket and
    prefetch sizes in elements), and where the figure comes from."""
    meta = trace.meta or {}
    if isinstance(meta.get("dtype_bytes"), int) and meta["dtype_bytes"] > 0:
        return int(meta["dtype_bytes"]), "trace meta dtype_bytes"
    dtype = str(meta.get("dtype", "")).lower().replace("torch.", "")
    if dtype in _DTYPE_BYTES:
        return _DTYPE_BYTES[dtype], f"trace meta dtype {dtype}"
    return 4, "assumed fp32 (the trace does not say its dtype)"


def offload_tier(hardware: Hardware, device: str, what: str, policy: str) -> str:
    """The tier DeepSpeed's ``device`` option names on ``hardware``: ``cpu`` is host
    memory (the fastest offload tier without one), ``nvme`` the SSD tier.

    Raises:
        PolicyError: ``device`` is not ``cpu`` or ``nvme``, or the machine has no SSD.
    """
    if device not in DEVICES:
        raise PolicyError(f"{policy}: {what} {device!r} is not one of {', '.join(DEVICES)}")
    if device == "cpu":
        return pick_tier(hardware, ("host",))
    for t in hardware.offload_tiers:
        if hardware.tier(t).kind == "ssd":
            return t
    raise PolicyError(f"{policy}: {what} 'nvme' but hardware {hardware.name} has no SSD tier the device reaches")


def check_host_room(hardware: Hardware, need: dict[str, int], policy: str) -> None:
    """Raise :class:`PlanError` where DeepSpeed's host-side buffers exceed a tier."""
    for tier, nbytes in need.items():
        cap = hardware.tier(tier).capacity
        if nbytes > cap:
            raise PlanError(
                f"{policy}: {fmt_bytes(nbytes)} ({nbytes} bytes) of parameters, gradients and optimizer "
                f"state to keep on {tier}, which holds {fmt_bytes(cap)} ({int(cap)} bytes) on {hardware.name}"
            )
