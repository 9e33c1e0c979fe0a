"""The simulator's prediction of a compiled step: time and peak per graph, and for the step.

A compiled graph's :class:`~tierflow.compiled.graph_trace.GraphFacts` is a tierflow
trace (the forward graph's ops, then the backward graph's) and its
:class:`~tierflow.compiled.plan.GraphPlan` says which saved tensors leave the device.
:func:`graph_plan_as_plan` writes that plan in the simulator's vocabulary:

* an offloaded tensor is evicted to the host tier when its last forward use ends (the
  ``tierflow::offload`` op sits right after it) and fetched back when the op before its
  first backward use ends (``tierflow::reload`` runs on the compute stream just before
  that use, so the op waits for the whole copy);
* a moved gradient (a plan's ``offload_grads``: an output of the backward graph) is
  evicted when its last reader in the backward graph ends and fetched back when the
  op before the graph's last op ends (``tierflow::reload`` waits for the graph's last
  computed tensor, so it is back only as the graph returns);
* a recomputed one (a plan's ``recompute`` names, where the plan has them) is dropped
  after its last forward use and re-made before its first backward use by the forward
  ops that make it from what stays saved (:func:`tierflow.policies._rematerialize.recompute_chains`),
  as torch's partitioner re-runs them in the backward graph.

:func:`predict_graph` simulates it (:func:`tierflow.simulate.simulate`, two iterations,
the second reported) on a :class:`~tierflow.hardware.Hardware`; the op times are the
trace's (graph_trace's roofline estimate) unless measured ones are given. The graph's
inputs (parameters, the batch) are there before the step: they are held for the whole
step and left out of the peak, as the facts' own curve leaves them out. A step runs its
graphs in sequence (:func:`predict_step`): its time is the sum, and its peak the
highest of each graph's peak plus what the graphs before it keep saved (their backward
has not run yet), as :class:`~tierflow.compiled.frontend.CompiledOffload` counts it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..hardware import Compute, Hardware, Link, Tier
from ..plan import Move, Plan
from ..trace import Trace
from .graph_trace import BYTES_PER_S, FLOPS_PER_S, GraphFacts
from .plan import GraphPlan


@dataclass(frozen=True, slots=True)
class GraphPrediction:
    """One graph's simulated step.

    Attributes:
        step_s: its forward and backward, with the plan's copies and recomputes.
        ideal_s: the same ops with no copies or recomputes (the trace's op times).
        stall_s: time the compute stream waited for copies.
        recompute_s: time re-running forward ops.
        peak_bytes: highest device bytes above the step's start (inputs left out).
        kept_saved_bytes: bytes of the saved tensors the plan keeps on the device through
            the backward, inputs left out (what a later graph of the same step runs beside).
    """

    step_s: float
    ideal_s: float
    stall_s: float
    recompute_s: float
    peak_bytes: int
    kept_saved_bytes: int


@dataclass(frozen=True, slots=True)
class StepPrediction:
    """A step of several graphs in sequence (a graph break makes several).

    Attributes:
        graphs: one :class:`GraphPrediction` per graph, in the order they run.
        step_s: the graphs' times summed.
        peak_bytes: the highest, over graphs, of a graph's peak plus the saved bytes the
            graphs before it keep.
    """

    graphs: tuple[GraphPrediction, ...]
    step_s: float
    peak_bytes: int


def cpu_hardware(device_bytes: float = float(1 << 40), copy_bytes_per_s: float = BYTES_PER_S) -> Hardware:
    """The CPU as the compiled front-end uses it: device and host tiers both RAM, a
    copy between them a ``memcpy`` on the thread that runs the ops (``host_copies``), at
    graph_trace's memory bandwidth, the compute rates graph_trace's roofline assumes.

    Args:
        device_bytes: the device tier's capacity (the simulator's budget).
        copy_bytes_per_s: the rate of a copy to and from the host tier.
    """
    tiers = (Tier("device", "device", float(device_bytes)), Tier("host", "host", float(1 << 42)))
    links = (Link("device->host", "device", "host", copy_bytes_per_s),
             Link("host->device", "host", "device", copy_bytes_per_s))
    return Hardware("cpu-compiled", "device", tiers, links, Compute(FLOPS_PER_S, FLOPS_PER_S, BYTES_PER_S),
                    description="CPU: device and host both RAM, copies on the compute thread",
                    host_copies=True)


def _recomputed(plan: GraphPlan) -> frozenset[str]:
    # (a GraphPlan without a recompute set recomputes nothing beyond torch's own choice)
    return frozenset(getattr(plan, "recompute", None) or ())


def step_trace(trace: Trace, op_s: Sequence[float] | None = None) -> Trace:
    """The trace with its inputs held for the whole step (persistent: there before and
    after it), and the op times replaced by ``op_s`` where given."""
    tensors = [dataclasses.replace(t, persistent=True, external=False) if t.external else t for t in trace.tensors]
    ops = trace.ops
    if op_s is not None:
        if len(op_s) != len(ops):
            raise ValueError(f"tierflow predict: {len(op_s)} op times for a graph of {len(ops)} ops")
        ops = [dataclasses.replace(o, duration_s=float(s)) for o, s in zip(ops, op_s, strict=True)]
    return Trace(list(ops), tensors, name=trace.name, meta=dict(trace.meta))


def _moved_grads(facts: GraphFacts, plan: GraphPlan) -> list:
    names = getattr(plan, "offload_grads", None) or ()
    return [g for g in facts.grads if g.name in names and g.first_bwd_use - g.last_fwd_use > 1]


def plan_trace(facts: GraphFacts, plan: GraphPlan, op_s: Sequence[float] | None = None) -> Trace:
    """The trace :func:`predict_graph` simulates ``plan`` on: :func:`step_trace` of the
    facts' trace, with the graph's last op reading each gradient the plan moves (the
    graph returns it there: its ``tierflow::reload`` runs just before the return, and
    the simulator fetches a tensor for an op that uses it)."""
    return _returns_read(step_trace(facts.trace, op_s), facts, plan)


def _returns_read(trace: Trace, facts: GraphFacts, plan: GraphPlan) -> Trace:
    """``trace`` with its last op reading the gradients ``plan`` moves."""
    moved = {g.tensor for g in _moved_grads(facts, plan)}
    if not moved:
        return trace
    ops = list(trace.ops)
    last = ops[-1]
    ops[-1] = dataclasses.replace(last, inputs=tuple(sorted(set(last.inputs) | moved)))
    return Trace(ops, list(trace.tensors), name=trace.name, meta=dict(trace.meta))


def graph_plan_as_plan(facts: GraphFacts, plan: GraphPlan, trace: Trace | None = None,
                       device_bytes: float = math.inf) -> Plan:
    """``plan`` in the simulator's vocabulary (see the module docstring).

    Args:
        facts: the graph as the planner saw it.
        plan: what it keeps, offloads and recomputes.
        trace: the trace to plan for (default ``facts.trace`` with its last op reading
            the moved gradients, as :func:`plan_trace` has it; same ops and tensors).
        device_bytes: the plan's budget.

    Raises:
        PlanError: a recomputed tensor cannot be re-made from the forward (no backward
            use, or not made by a forward op).
    """
    from ..policies._rematerialize import recompute_chains

    trace = trace if trace is not None else _returns_read(facts.trace, facts, plan)
    by_name = {s.name: s for s in facts.saved}
    moves: list[Move] = []
    for name in sorted(plan.offload):
        s = by_name[name]
        if s.first_bwd_use - s.last_fwd_use <= 1:
            continue  # no op in between: the copy frees nothing (the plan does not pick these)
        moves.append(Move("evict", s.tensor, s.last_fwd_use, "host"))
        moves.append(Move("prefetch", s.tensor, s.first_bwd_use - 1, "host", s.first_bwd_use))
    # (a gradient with nothing run between its last reader and the return is not moved:
    # the hook skips these too)
    for g in _moved_grads(facts, plan):
        moves.append(Move("evict", g.tensor, g.last_fwd_use, "host"))
        moves.append(Move("prefetch", g.tensor, g.first_bwd_use - 1, "host", g.first_bwd_use))
    moves.sort(key=lambda m: (m.after_op, m.kind != "evict", m.tensor))
    recompute = _recomputed(plan)
    chains = ()
    if recompute:
        dropped = {by_name[n].tensor for n in recompute}
        saved = {s.tensor for s in facts.saved if s.name not in recompute}
        chains = recompute_chains(trace, dropped, saved)
    return Plan("compiled", tuple(moves), budget_bytes=device_bytes, recomputes=chains,
                meta={"offloaded": len(plan.offload), "recomputed": len(recompute),
                      "grads_offloaded": len(getattr(plan, "offload_grads", None) or ())})


def predict_graph(facts: GraphFacts, plan: GraphPlan, hardware: Hardware | None = None,
                  op_s: Sequence[float] | None = None) -> GraphPrediction:
    """Simulate one graph's step with its plan.

    Args:
        facts: the graph (its trace: ops, tensors, estimated op times).
        plan: its plan.
        hardware: the machine (default :func:`cpu_hardware`).
        op_s: measured seconds per op of ``facts.trace``, replacing the estimate.

    Raises:
        ValueError: ``op_s`` does not have one time per op.
        SimulationError: never; a plan that cannot run gives ``step_s = inf``.

    Example:
        >>> pred = predict_graph(rec.facts, rec.plan)  # doctest: +SKIP
        >>> pred.step_s, pred.peak_bytes  # doctest: +SKIP
    """
    from ..simulate import simulate

    hw = hardware if hardware is not None else cpu_hardware()
    trace = plan_trace(facts, plan, op_s)
    held = int(sum(int(trace.sizes[t.id]) for t in trace.tensors if t.persistent))
    sim_plan = graph_plan_as_plan(facts, plan, trace, hw.device_capacity)
    res = simulate(trace, hw, sim_plan)
    gone = _recomputed(plan) | plan.offload
    # what stays for the backward: once per storage (views share their base's id), and
    # not the graph's inputs (a saved parameter is there before and after the step)
    external = facts.trace.external
    kept_ids = {s.tensor for s in facts.saved if s.name not in gone and not external[s.tensor]}
    kept = int(sum(int(facts.trace.sizes[t]) for t in kept_ids))
    peak = int(res.peak_bytes.get(hw.device, 0)) - held if res.fits else -1
    return GraphPrediction(step_s=float(res.time_s), ideal_s=float(res.ideal_s), stall_s=float(res.stall_s),
                           recompute_s=float(res.recompute_s), peak_bytes=peak, kept_saved_bytes=int(kept))


def predict_step(graphs: Sequence[tuple[GraphFacts, GraphPlan]], hardware: Hardware | None = None) -> StepPrediction:
    """A step's graphs, each simulated (:func:`predict_graph`), run in sequence.

    Args:
        graphs: (facts, plan) per graph, in the order the step runs them.
        hardware: the machine (default :func:`cpu_hardware`).
    """
    preds = tuple(predict_graph(f, p, hardware) for f, p in graphs)
    carried = peak = 0
    for p in preds:
        peak = max(peak, carried + p.peak_bytes)
        carried += p.kept_saved_bytes
    return StepPrediction(preds, float(sum(p.step_s for p in preds)), int(peak))


__all__ = ["GraphPrediction", "StepPrediction", "cpu_hardware", "graph_plan_as_plan", "plan_trace", "predict_graph", "predict_step",
           "step_trace"]
