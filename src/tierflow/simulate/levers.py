"""What a plan's recomputes and host steps ask of the simulator, as per-op tables.

:class:`LeverSchedule` turns a plan's :class:`~tierflow.plan.Recompute` and
:class:`~tierflow.plan.HostStep` records into what the simulator looks up as it walks the
ops (chains to run before an op, tensors to drop or to send to the host after one, ops
that leave the compute stream, whose deaths move). The semantics it encodes are in
:mod:`tierflow.simulate.simulator`; the records are checked by
:func:`tierflow.plan.levers` first (a :class:`~tierflow.errors.PlanError` if they are
inconsistent), also when the caller skips the plan's full validation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import SimulationError
from ..hardware import Hardware
from ..plan import HostStep, Plan, levers
from ..trace import Trace


@dataclass(frozen=True, slots=True)
class ChainStep:
    """One re-run op of a recompute chain.

    Attributes:
        op: the trace op re-run.
        duration_s: its compute time (the op's trace duration).
        reads: tensors it reads (or updates in place) from outside the chain: they must be
            on the device.
        kept: tensors it makes that the chain keeps (``Recompute.tensors``).
        temps: bytes of the other tensors it makes (the chain's temporaries).
        frees: bytes of the chain's temporaries that no later step reads: freed once
            this step has run, as a replay lets go of them (the runtime's, and
            ``torch.utils.checkpoint``'s forward under recompute).
    """

    op: int
    duration_s: float
    reads: tuple[int, ...]
    kept: tuple[int, ...]
    temps: int
    frees: int = 0


@dataclass(frozen=True, slots=True)
class Chain:
    """One :class:`~tierflow.plan.Recompute` as the simulator runs it."""

    index: int  # in plan.recomputes
    before_op: int
    steps: tuple[ChainStep, ...]
    reads: frozenset[int]  # every outside read of the chain (pinned while it runs)


@dataclass
class LeverSchedule:
    """Per-op tables of a plan's recomputes and host steps.

    Attributes:
        chains: before_op -> the chains run just before it, in plan order.
        drops: op -> tensors dropped (freed, no transfer) when it ends.
        host_ops: ops that run on the host, not the compute stream.
        grad_out: op -> host steps whose gradient leaves for the host when it ends.
        death: tensor -> the op after which it is freed, where that is not its trace
            death (an input a chain reads is held until the chain's op); ``None``: never
            freed on the device by a death (host-stepped gradients, the host's own
            temporaries, host-stepped optimizer state).
        start_tier: where host-stepped optimizer state lives.
        host_buffers: per off-device tier, bytes host steps hold there for good
            (optimizer state is placed as tensors; these are the gradient buffers and the
            parameters' master copies).
        work_bytes: per host step, the bytes its update processes (parameter, gradient
            and optimizer state).
        host_step_s: host compute seconds per iteration.
        host_op_s: compute-stream seconds the host-stepped ops no longer take.
    """

    chains: dict[int, list[Chain]] = field(default_factory=dict)
    drops: dict[int, list[int]] = field(default_factory=dict)
    host_ops: frozenset[int] = frozenset()
    grad_out: dict[int, list[HostStep]] = field(default_factory=dict)
    death: dict[int, int | None] = field(default_factory=dict)
    start_tier: dict[int, str] = field(default_factory=dict)
    host_buffers: dict[str, int] = field(default_factory=dict)
    work_bytes: dict[int, int] = field(default_factory=dict)  # param -> bytes
    host_step_s: float = 0.0
    host_op_s: float = 0.0

    @classmethod
    def of(cls, plan: Plan, trace: Trace, hw: Hardware) -> LeverSchedule:
        """Check the plan's records (:func:`tierflow.plan.levers`) and tabulate them.

        Raises:
            PlanError: inconsistent records.
            SimulationError: host steps on hardware with no host compute model.
        """
        lev = levers(plan, trace, hw)
        out = cls(host_ops=lev.host_ops, start_tier=dict(lev.start_tier))
        sizes = trace.sizes
        ops = trace.ops
        first = trace.first_use
        persistent = trace.persistent
        if plan.host_steps:
            if hw.host_compute is None:
                raise SimulationError(
                    f"hardware {hw.name} has no host compute model (Hardware.host_compute), "
                    f"which the plan's {len(plan.host_steps)} host steps need"
                )
            rate = hw.host_compute.optimizer_bytes_per_s
            if not rate > 0 or math.isinf(rate):
                raise SimulationError(f"hardware {hw.name}: host compute optimizer_bytes_per_s is {rate}")
            for h in plan.host_steps:
                last = lev.last_op[h.grad]
                out.grad_out.setdefault(last, []).append(h)
                out.death[h.grad] = None
                work = int(sizes[h.param]) + int(sizes[h.grad]) + sum(int(sizes[s]) for s in h.state)
                out.work_bytes[h.param] = work
                out.host_step_s += work / rate
                out.host_buffers[h.tier] = out.host_buffers.get(h.tier, 0) + int(sizes[h.param] + sizes[h.grad])
            for t in lev.off_device:
                out.death[t] = None
            out.host_op_s = math.fsum(ops[o].duration_s for o in lev.host_ops)
        host_grads = {h.grad for h in plan.host_steps}
        for t, last in lev.last_op.items():
            if t not in host_grads:
                out.death[t] = last
        for t, d, _ in lev.drops:
            out.drops.setdefault(d, []).append(t)
        for i, r in enumerate(plan.recomputes):
            keep = set(r.tensors)
            made: set[int] = set()
            last_step: dict[int, int] = {}  # a temporary -> the last step that makes or reads it
            rows = []
            reads: set[int] = set()
            for k, o in enumerate(r.ops):
                op = ops[o]
                step_reads, step_kept, temps = [], [], 0
                for x in op.tensors:
                    if x in made:
                        if x in last_step:
                            last_step[x] = k
                        continue
                    if not persistent[x] and int(first[x]) == o and x in op.outputs:
                        made.add(x)
                        if x in keep:
                            step_kept.append(x)
                        else:
                            temps += int(sizes[x])
                            last_step[x] = k
                    else:
                        step_reads.append(x)
                reads.update(step_reads)
                rows.append((o, op.duration_s, tuple(step_reads), tuple(step_kept), temps))
            frees = [0] * len(rows)
            for x, k in last_step.items():
                frees[k] += int(sizes[x])
            steps = [ChainStep(*row, frees=f) for row, f in zip(rows, frees)]
            out.chains.setdefault(r.before_op, []).append(Chain(i, r.before_op, tuple(steps), frozenset(reads)))
        return out
