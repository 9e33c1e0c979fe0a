"""The simulator's prediction of a compiled step (tierflow.compiled.predict).

Graphs come from a small gated MLP compiled with ``aot_eager`` (the partition record
is the same object with inductor); the prediction runs on the CPU hardware of
``predict.cpu_hardware`` with the trace's roofline op times, so every figure is a
pure function of the graph and the plan."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import tierflow.compiled as tc
from test_compiled_frontend import GatedMLP
from tierflow.compiled.graph_trace import BYTES_PER_S
from tierflow.compiled.plan import GraphPlan, curve_with
from tierflow.compiled.predict import graph_plan_as_plan, predict_graph, predict_step
from tierflow.errors import PlanError
from tierflow.plan import validate
from tierflow.policies._rematerialize import recompute_chains


def records(budget, brk: bool = False):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GatedMLP(d=32, h=128, n=2, brk=brk)
    run = tc.compile(model, budget=budget, backend="aot_eager")
    with run:
        run.model(torch.randn(4, 32, 32)).backward()
    return run


@pytest.fixture(scope="module")
def planned():
    return records("50%")


def test_prediction_without_a_plan_is_the_sum_of_op_times():
    rec = records(None).records[0]
    pred = predict_graph(rec.facts, rec.plan)
    assert pred.step_s == pytest.approx(float(rec.facts.trace.durations.sum()), rel=1e-9)
    assert pred.stall_s == 0 and pred.recompute_s == 0
    assert pred.peak_bytes == rec.facts.peak_bytes


def test_predicted_peak_is_the_plans_own_curve(planned):
    rec = planned.records[0]
    assert rec.plan.offload, "the 50% plan offloads something"
    offloaded = [s for s in rec.facts.saved if s.name in rec.plan.offload]
    pred = predict_graph(rec.facts, rec.plan)
    # an independent count: the facts' curve less each offloaded tensor inside its gap
    assert pred.peak_bytes == int(curve_with(rec.facts, offloaded).max())


def test_offload_costs_the_copies_out_and_back_on_the_cpu(planned):
    rec = planned.records[0]
    moved = sum(s.bytes for s in rec.facts.saved if s.name in rec.plan.offload)
    pred = predict_graph(rec.facts, rec.plan)
    # a CPU copy is a memcpy on the thread that runs the ops: each way costs its bytes
    assert pred.step_s == pytest.approx(pred.ideal_s + 2 * moved / BYTES_PER_S, rel=1e-6)


def test_measured_op_times_replace_the_estimate(planned):
    rec = planned.records[0]
    n = rec.facts.trace.n_ops
    pred = predict_graph(rec.facts, GraphPlan(), op_s=[1e-3] * n)
    assert pred.step_s == pytest.approx(n * 1e-3)
    with pytest.raises(ValueError, match="op times"):
        predict_graph(rec.facts, GraphPlan(), op_s=[1e-3] * (n - 1))


def test_report_carries_the_predicted_step(planned):
    for g in planned.stats.compiled_graphs:
        assert g["predicted_step_s"] is not None and g["predicted_step_s"] > 0


@dataclass(frozen=True)
class WithRecompute:
    """A plan with a recompute set (the shape a recomputing GraphPlan has)."""

    offload: frozenset[str] = frozenset()
    recompute: frozenset[str] = frozenset()


def test_recomputed_tensors_are_simulated_as_chains():
    rec = records(None).records[0]
    facts = rec.facts
    # the saved tensors a forward op makes from other forward tensors (not a matmul's input)
    names = frozenset(s.name for s in facts.saved if s.offloadable and "mm" not in s.producer)
    assert names
    plan = WithRecompute(recompute=names)
    sim_plan = graph_plan_as_plan(facts, plan)
    validate(sim_plan, facts.trace, tc.predict.cpu_hardware())
    pred = predict_graph(facts, plan)
    rerun = [i for r in sim_plan.recomputes for i in r.ops]  # an op two chains need runs twice
    assert pred.recompute_s == pytest.approx(float(facts.trace.durations[rerun].sum()), rel=1e-9)
    assert pred.step_s == pytest.approx(pred.ideal_s + pred.recompute_s, rel=1e-9)
    kept = {s.tensor for s in facts.saved if s.name not in names and not facts.trace.tensors[s.tensor].external}
    assert pred.kept_saved_bytes == sum(facts.trace.tensors[t].bytes for t in kept)


def test_chains_re_make_each_dropped_tensor_before_its_first_backward_use():
    facts = records(None).records[0].facts
    s = next(s for s in facts.saved if s.offloadable and "mm" not in s.producer)
    (chain,) = recompute_chains(facts.trace, {s.tensor}, {x.tensor for x in facts.saved if x is not s})
    assert chain.tensors == (s.tensor,) and chain.before_op == s.first_bwd_use
    assert int(facts.trace.first_use[s.tensor]) in chain.ops


def test_a_step_of_two_graphs_adds_times_and_carries_kept_bytes():
    run = records("50%", brk=True)
    assert len(run.records) == 2
    pairs = [(r.facts, r.plan) for r in run.records]
    step = predict_step(pairs)
    g0, g1 = step.graphs
    assert step.step_s == pytest.approx(g0.step_s + g1.step_s)
    assert step.peak_bytes == max(g0.peak_bytes, g0.kept_saved_bytes + g1.peak_bytes)


def test_a_tensor_the_backward_never_reads_cannot_be_recomputed():
    trace = records(None).records[0].facts.trace
    bwd = {t for o in trace.ops if o.phase == "backward" for t in o.tensors}
    fwd_only = next(t for o in trace.ops if o.phase == "forward" for t in o.outputs if t not in bwd)
    with pytest.raises(PlanError, match="no backward use"):
        recompute_chains(trace, {fwd_only})


def _hand_graph():
    """Two forward ops, four backward ops; gradient ``g`` (4000 B) is made by the first
    backward op and returned by the graph at its last op."""
    from tierflow.compiled.graph_trace import GraphFacts, SavedTensor, live_curve
    from tierflow.trace import Op, TensorInfo, Trace

    tensors = [TensorInfo(0, 800, "input", name="x", external=True),
               TensorInfo(1, 1000, "activation", name="a"),
               TensorInfo(2, 4000, "gradient", name="g", held_until=5),
               TensorInfo(3, 6000, "temporary", name="t1"),
               TensorInfo(4, 6000, "temporary", name="t2"),
               TensorInfo(5, 100, "gradient", name="g2", held_until=5)]
    ops = [Op("f0", "forward", 1e-3, (0,), (1,)), Op("f1", "forward", 1e-3, (1,), ()),
           Op("b0", "backward", 1e-3, (1,), (2,)), Op("b1", "backward", 1e-3, (), (3,)),
           Op("b2", "backward", 1e-3, (3,), (4,)), Op("b3", "backward", 1e-3, (4,), (5,))]
    trace = Trace(ops, tensors, name="hand")
    g = SavedTensor("g", 4000, "mm", "", tensor=2, last_fwd_use=2, first_bwd_use=5, offloadable=True)
    return GraphFacts(trace, (), 2, live_curve(trace), (g,))


def test_moved_gradient_leaves_after_its_last_reader_and_is_back_for_the_return():
    facts = _hand_graph()
    # by hand: op b1 holds g + t1 = 10000, b2 g + t1 + t2 = 16000, b3 g + t2 + g2 = 10100
    assert predict_graph(facts, GraphPlan()).peak_bytes == 16000
    plan = GraphPlan(offload_grads=frozenset({"g"}))
    pred = predict_graph(facts, plan)
    # g is on the host for b1 and b2 (12000 at b2), back for b3 (10100)
    assert pred.peak_bytes == 12000
    assert pred.step_s == pytest.approx(6e-3 + 2 * 4000 / BYTES_PER_S, rel=1e-9)
    validate(graph_plan_as_plan(facts, plan), tc.predict.plan_trace(facts, plan), tc.predict.cpu_hardware())


def test_moved_gradients_of_a_compiled_graph_are_predicted_as_the_plans_curve():
    from test_compiled_frontend import planned as planned_run
    from test_compiled_frontend import train

    rec = train(planned_run("30%"), steps=1)[2].records[0]
    assert rec.plan.offload_grads
    plan = GraphPlan(offload=rec.plan.offload, offload_grads=rec.plan.offload_grads)
    moved = [s for s in rec.facts.saved if s.name in plan.offload]
    grads = [g for g in rec.facts.grads if g.name in plan.offload_grads]
    pred = predict_graph(rec.facts, plan)
    assert pred.peak_bytes == int(curve_with(rec.facts, moved + grads).max())
    nbytes = sum(s.bytes for s in {s.tensor: s for s in moved}.values()) + sum(g.bytes for g in grads)
    assert pred.step_s == pytest.approx(pred.ideal_s + 2 * nbytes / BYTES_PER_S, rel=1e-6)
