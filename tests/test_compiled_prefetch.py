"""The compiled path's copy back, split in two: ``tierflow::prefetch`` starts it ahead of
the first backward use (where :func:`tierflow.compiled.prefetch.prefetch_points` puts it),
``tierflow::wait`` waits for it at the use.

The split is used on CUDA (``PlanPartitioner.prefetch_devices``); these tests turn it on
for the CPU, where the start does the copy at once, and check the graph's structure (the
start placed ahead of the wait, both surviving inductor in that order, every reader
after the wait), the placement's budget (every start counted on the curve from where it
is issued), and training bitwise equal to plain compile."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tierflow.compiled as tc
from test_compiled_frontend import GatedMLP, plain, same, train
from tierflow.compiled.hook import PlanPartitioner
from tierflow.compiled.plan import plan_graph
from tierflow.compiled.prefetch import prefetch_points
from tierflow.runtime.backend import Backend

PREFETCH = "tierflow.prefetch.default"
WAIT = "tierflow.wait.default"


def _partitioned(share: float = 0.3):
    """A small gated MLP's forward and backward graphs as the plan partitioner rewrote
    them (aot_eager), with its partition record."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GatedMLP(d=32, h=128, n=2)
    kept: dict = {}

    def decide(facts):
        return plan_graph(facts, int(share * facts.peak_bytes), allow_recompute=False)

    hook = PlanPartitioner(decide=decide, key=f"test-{share}", on_partition=lambda r: kept.setdefault("record", r))

    def partition(gm, joint_inputs, **kw):
        kept["fwd"], kept["bwd"] = hook(gm, joint_inputs, **kw)
        return kept["fwd"], kept["bwd"]

    fn = torch.compile(model, backend=aot_autograd(fw_compiler=boxed_nop, partition_fn=partition))
    fn(torch.randn(8, 32, 32)).backward()
    return kept


@pytest.fixture(scope="module")
def graphs():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PlanPartitioner, "prefetch_devices", ("cpu", "cuda"))
        return _partitioned()


@pytest.fixture
def split_on_cpu(monkeypatch):
    monkeypatch.setattr(PlanPartitioner, "prefetch_devices", ("cpu", "cuda"))


def _calls(gm, target: str):
    return [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == target]


def test_each_offload_comes_back_through_a_prefetch_placed_before_its_wait(graphs):
    bwd, rec = graphs["bwd"], graphs["record"]
    order = {n: i for i, n in enumerate(bwd.graph.nodes)}
    waits = _calls(bwd, WAIT)
    assert len(waits) == len(_calls(bwd, PREFETCH)) == len(rec.offloaded) > 0
    assert not _calls(bwd, "tierflow.reload.default")  # (no gradient moved at this budget)
    for w in waits:
        start = w.args[0]
        assert str(start.target) == PREFETCH and order[start] < order[w]
        # every reader of the copied tensor runs after the wait
        assert all(order[u] > order[w] for u in start.users if u is not w)


def test_on_the_cpu_by_default_each_offload_comes_back_in_one_reload_at_its_use():
    kept = _partitioned()
    bwd, rec = kept["bwd"], kept["record"]
    assert len(_calls(bwd, "tierflow.reload.default")) == len(rec.offloaded) > 0
    assert not _calls(bwd, PREFETCH) and not _calls(bwd, WAIT)
    assert set(rec.prefetch_ops.values()) == {0}


def test_some_prefetch_starts_ops_ahead_of_its_first_use(graphs):
    bwd, rec = graphs["bwd"], graphs["record"]
    order = {n: i for i, n in enumerate(bwd.graph.nodes)}
    ahead = {}
    for w in _calls(bwd, WAIT):
        between = [n for n in bwd.graph.nodes if order[w.args[0]] < order[n] < order[w]
                   and n.op == "call_function" and str(n.target) not in (PREFETCH, WAIT)]
        ahead[w] = len(between)
    assert max(ahead.values()) >= 1
    assert sorted(rec.prefetch_ops.values()) == sorted(ahead.values())


def test_prefetched_curve_stays_within_the_plans_target(graphs):
    rec = graphs["record"]
    assert rec.prefetch_peak_bytes <= max(rec.plan.target_bytes, rec.plan.predicted_peak_bytes)


def _recount(facts, names, start):
    """The live bytes per op with each named tensor off the device from after its last
    forward use until ``start`` (an independent recount of prefetch_points' curve)."""
    curve = [int(b) for b in facts.curve]
    for s in facts.saved:
        if s.name in names:
            for i in range(s.last_fwd_use + 1, start[s.name]):
                curve[i] -= s.bytes
    return curve


@settings(max_examples=40, deadline=None)
@given(slack=st.floats(0.0, 1.0), rate_log=st.floats(6.0, 12.0), pick=st.integers(1, 1 << 16))
def test_prefetch_points_hold_the_limit_and_go_as_early_as_it_allows(graphs, slack, rate_log, pick):
    facts = graphs["record"].facts
    movable = sorted(s.name for s in facts.saved if s.offloadable and s.first_bwd_use - s.last_fwd_use > 1)
    names = [n for i, n in enumerate(movable) if pick >> (i % 16) & 1] or movable[:1]
    rate = 10.0 ** rate_log
    base = _recount(facts, names, {s.name: s.first_bwd_use for s in facts.saved})
    limit = int(max(base) * (1.0 + slack))
    p = prefetch_points(facts, names, limit, bytes_per_s=rate)
    by_name = {s.name: s for s in facts.saved}
    recount = _recount(facts, names, p.start)
    assert recount == [int(b) for b in p.curve]
    assert max(recount) <= p.limit == max(limit, max(base))
    for name in names:
        s = by_name[name]
        lowest = max(s.last_fwd_use + 1, facts.n_fwd)
        assert lowest <= p.start[name] <= s.first_bwd_use or p.start[name] == s.first_bwd_use
        covered = sum(facts.trace.ops[i].duration_s for i in range(p.start[name], s.first_bwd_use))
        if p.start[name] > lowest and covered < s.bytes / rate:
            # stopped early: one op earlier would have lifted some op above the limit
            # (the curve then still held the tensors placed after this one: a bound)
            assert recount[p.start[name] - 1] + s.bytes > p.limit


def test_prefetch_points_never_start_before_the_backward(graphs):
    facts = graphs["record"].facts
    names = [s.name for s in facts.saved if s.offloadable and s.first_bwd_use - s.last_fwd_use > 1]
    p = prefetch_points(facts, names, limit=1 << 40, bytes_per_s=1.0)  # a copy no op covers
    assert all(p.start[n] == max(facts.n_fwd, s.last_fwd_use + 1) for s in facts.saved if (n := s.name) in names)


def test_prefetch_points_refuse_an_unknown_name(graphs):
    with pytest.raises(KeyError):
        prefetch_points(graphs["record"].facts, ["no_such_tensor"], None)


def test_backend_start_then_finish_gives_the_tensor_back_with_its_strides():
    be = Backend(torch.device("cpu"))
    x = torch.randn(4, 6, 5).transpose(0, 2)
    ticket = be.start(be.put(7, x))
    assert be.outstanding() == 1 and be.stats.prefetch_starts == 1 and be.stats.reloads == 0
    back = be.finish(ticket)
    assert torch.equal(back, x) and back.stride() == x.stride()
    assert be.outstanding() == 0 and be.stats.reloads == 1


def test_backend_finish_of_a_ticket_never_started_is_refused():
    be = Backend(torch.device("cpu"))
    ticket = be.put(0, torch.ones(3))
    with pytest.raises(KeyError):
        be.finish(ticket)
    assert be.take(ticket).sum().item() == 3.0  # the ticket is still whole


def test_backend_drop_outstanding_forgets_started_copies():
    be = Backend(torch.device("cpu"))
    be.start(be.put(0, torch.ones(3)))
    be.drop_outstanding()
    assert be.outstanding() == 0


def test_prefetched_compiled_training_is_bitwise_equal_to_plain_compile(split_on_cpu):
    ref, got = train(plain()), train(_planned_small())
    assert max(got[2].records[0].prefetch_ops.values()) >= 1 and got[2].stats.compiled_offloads > 0
    assert same(ref, got)
    # the reported planned peak counts the bytes an early copy back holds from its start:
    # prefetch_points' own curve on the real partition, less the gradients moved
    for rec, g in zip(got[2].records, got[2].stats.compiled_graphs, strict=True):
        assert not any(s.group for s in rec.real.saved)
        curve = prefetch_points(rec.real, rec.offloaded, rec.plan.target_bytes).curve
        for gr in rec.real.grads:
            if gr.name in rec.grads_offloaded:
                curve[gr.last_fwd_use + 1 : gr.first_bwd_use] -= gr.bytes
        assert g["predicted_peak_bytes_planned"] == int(curve.max())


def _planned_small():
    def make(m):
        run = tc.compile(m, budget="30%", backend="aot_eager")
        return run.model, run

    return make


def test_inductor_keeps_each_prefetch_ahead_of_its_wait_and_its_readers_after(split_on_cpu):
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    def step():
        torch._dynamo.reset()
        torch.manual_seed(0)
        run = tc.compile(GatedMLP(d=32, h=128, n=2), budget="30%", backend="inductor")
        run.model(torch.randn(8, 32, 32)).backward()
        return run

    with inductor_config.patch(fx_graph_cache=False):
        run, codes = run_and_get_code(step)
    (rec,) = run.records
    bwd = next(c for c in codes if "tierflow.wait" in c)
    lines = [ln.strip() for ln in bwd[bwd.index("def call("):].splitlines()]
    made = {}  # the buffer names a prefetch's result is known by -> the line it is made on
    for i, ln in enumerate(lines):
        if m := re.match(r"(buf\d+) = torch\.ops\.tierflow\.prefetch\.default\(", ln):
            made[m.group(1)] = i
        elif (m := re.match(r"(buf\d+) = (buf\d+)$", ln)) and m.group(2) in made:
            made[m.group(1)] = made[m.group(2)]
    waits = {re.match(r"torch\.ops\.tierflow\.wait\.default\((buf\d+)", ln).group(1): i
             for i, ln in enumerate(lines) if ln.startswith("torch.ops.tierflow.wait.default(")}
    assert len(waits) == len(rec.offloaded) > 0
    for buf, i in waits.items():
        assert buf in made and made[buf] < i
        readers = [j for j, ln in enumerate(lines) if j != i and re.search(rf"\b{buf}\b", ln)
                   and not ln.startswith(("del ", "#", "assert_")) and "prefetch.default" not in ln
                   and not re.match(rf"{buf} = buf\d+$", ln)]
        assert readers and all(j > i for j in readers)
