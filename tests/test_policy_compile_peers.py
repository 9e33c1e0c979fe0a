"""torch.compile's memory knobs as peer policies: ``compile_memory_budget``
(``activation_memory_budget``) and ``compile_offloading`` (``enable_activation_offloading``).

Plans are checked on the hand-made transformer trace of ``test_peer_policies`` (aten op
names, every tensor known) and on a trace made from a compiled graph; every plan is
checked by the validator and simulated; the knapsack against a brute force, the saved
set against an independent re-derivation of what the backward can re-make."""

from __future__ import annotations

import itertools
import math
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import MB, simple_hw
from test_peer_policies import transformer
from tierflow import validate
from tierflow.errors import PlanError, PolicyError
from tierflow.policies import make_plan, policy_names
from tierflow.policies._recompute import planned_device_bytes
from tierflow.policies.compile_memory_budget import (
    QUANT,
    SWEEP,
    budget_plan,
    choose_saved,
    dp_knapsack,
    forward_graph,
)
from tierflow.policies.compile_offloading import prefetch_points
from tierflow.policies.flashneuron import forward_to_backward_gaps
from tierflow.simulate import simulate


@pytest.fixture(scope="module")
def tiny():
    return transformer(3, 10 * MB)[0]


def _checked(plan, trace, hw, budget):
    res = validate(plan, trace, hw)
    assert res.tier_bytes[hw.device].max() <= budget
    r = simulate(trace, hw, plan)
    assert r.error is None and r.fits and r.time_s >= trace.ideal_s
    return r


def test_both_are_registered():
    assert {"compile_memory_budget", "compile_offloading"} <= set(policy_names())


# -- compile_memory_budget ------------------------------------------------------------------


def test_budget_one_is_the_traces_saved_set(tiny):
    plan = make_plan("compile_memory_budget", tiny, simple_hw(), memory_budget=1.0)
    assert not plan.recomputes and plan.meta["chosen_by"] == "trace" and plan.meta["memory_ratio"] == 1.0


def test_budget_zero_re_makes_everything_the_backward_reads(tiny):
    hw = simple_hw()
    plan = make_plan("compile_memory_budget", tiny, hw, memory_budget=0.0)
    re_made = {t for r in plan.recomputes for t in r.tensors}
    assert re_made == set(forward_graph(tiny).wanted)  # pure graph: nothing saved but the inputs
    assert plan.meta["saved_bytes"] == 0
    _checked(plan, tiny, hw, plan.budget_bytes)


@pytest.mark.parametrize("layers,act_mb,dropout,batchnorm", [(3, 10, False, False), (2, 5, True, True)])
def test_lower_budget_never_saves_more(layers, act_mb, dropout, batchnorm):
    """The knob bounds the saved activations; the step's peak need not follow it step by
    step (torch's own measured peak does not: BENCHMARKS.md, "Compiled peers"), only
    from end to end."""
    trace, _ = transformer(layers, act_mb * MB, dropout, batchnorm)
    g = forward_graph(trace)
    hw = simple_hw()
    saved, peaks = [], []
    for b in SWEEP:  # 1.0 down to 0.0
        plan, peak = budget_plan(trace, math.inf, b, "dp", g)
        _checked(plan, trace, hw, math.inf)
        saved.append(plan.meta["saved_bytes"])
        peaks.append(peak)
    assert saved == sorted(saved, reverse=True) and saved[0] > saved[-1]
    assert max(peaks) == peaks[0] and min(peaks) == peaks[-1] < peaks[0]


def test_sweep_takes_the_largest_budget_that_fits(tiny):
    g = forward_graph(tiny)
    peaks = {b: budget_plan(tiny, math.inf, b, "dp", g)[1] for b in SWEEP}
    device = (peaks[0.5] + peaks[1.0]) // 2
    plan = make_plan("compile_memory_budget", tiny, simple_hw(), budget=device)
    want = max(b for b, p in peaks.items() if p <= device)
    assert plan.meta["memory_budget"] == want and plan.meta["swept"]


def test_refuses_with_bytes_when_even_recomputing_everything_is_too_big(tiny):
    g = forward_graph(tiny)
    floor = budget_plan(tiny, math.inf, 0.0, "dp", g)[1]
    with pytest.raises(PlanError, match=r"compile_memory_budget: no plan fits in .* \(\d+ bytes\)"):
        make_plan("compile_memory_budget", tiny, simple_hw(), budget=floor - 1)


def test_bad_options_are_refused(tiny):
    with pytest.raises(PolicyError, match="memory_budget"):
        make_plan("compile_memory_budget", tiny, simple_hw(), memory_budget=1.5)
    with pytest.raises(PolicyError, match="solver"):
        make_plan("compile_memory_budget", tiny, simple_hw(), solver="ilp")


def _re_makeable(trace, g, saved, unbanned) -> set[int]:
    """Independently: the wanted tensors the backward can have from ``saved`` and the
    inputs by re-running forward ops that are not banned (or were un-banned)."""
    have: set[int] = set(saved)
    for i, o in enumerate(trace.ops):  # trace order is a topological order
        if o.phase != "forward":
            continue
        outs = [t for t in o.outputs if g.maker[t] == i]
        if not outs or (i in g.banned and i not in unbanned):
            continue
        if all(g.maker[a] < 0 or a in have or a in outs for a in o.inputs):
            have.update(outs)
    return have


@pytest.mark.parametrize("budget", [0.7, 0.4, 0.1])
def test_saved_set_is_a_cut_the_backward_can_re_make_from(tiny, budget):
    g = forward_graph(tiny)
    choice = choose_saved(tiny, budget, "dp", g)
    # what each option set lets be re-made: none of the banned ops (more aggressive),
    # those outside the allowlist (aggressive), and the knapsack's un-kept items
    unbanned: set[int] = set()
    if choice.how != "more aggressive":
        unbanned = {i for i, why in g.banned.items() if why == "allowlist"}
    if choice.how == "knapsack":
        unbanned |= {i for i, why in g.banned.items()
                     if why == "always" and tiny.ops[i].pure and i not in choice.knapsack_kept}
    assert g.wanted <= _re_makeable(tiny, g, choice.saved, unbanned)


@settings(max_examples=40, deadline=None)
@given(
    items=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 1000)), min_size=1, max_size=8),
    cap=st.integers(0, 120),
)
def test_dp_knapsack_is_optimal_against_brute_force(items, cap):
    memory = [w / QUANT * 1000 for w, _ in items]  # quantised exactly: w * 1000 units
    runtime = [float(v) for _, v in items]
    capacity = cap / QUANT * 1000
    kept = dp_knapsack(memory, runtime, capacity)
    assert sum(items[k][0] for k in kept) <= cap
    best = max(sum(items[k][1] for k in c) for n in range(len(items) + 1)
               for c in itertools.combinations(range(len(items)), n) if sum(items[k][0] for k in c) <= cap)
    assert sum(items[k][1] for k in kept) == best


@settings(max_examples=15, deadline=None)
@given(layers=st.integers(1, 3), act_mb=st.integers(1, 20), dropout=st.booleans(), batchnorm=st.booleans(),
       budget=st.sampled_from(SWEEP), solver=st.sampled_from(["dp", "greedy"]))
def test_every_budget_gives_a_valid_plan(layers, act_mb, dropout, batchnorm, budget, solver):
    trace, _ = transformer(layers, act_mb * MB, dropout, batchnorm)
    plan, peak = budget_plan(trace, math.inf, budget, solver)
    assert planned_device_bytes(trace, plan.recomputes).max() == peak
    _checked(plan, trace, simple_hw(), math.inf)


# -- compile_offloading -----------------------------------------------------------------------


def _budget(trace, share):
    return max(int(share * trace.peak_live_bytes), int(trace.working_set_bytes.max()))


def test_marks_all_offloads_every_saved_activation_after_its_last_forward_use(tiny):
    hw = simple_hw()
    budget = _budget(tiny, 0.8)
    plan = make_plan("compile_offloading", tiny, hw, budget=budget)
    gaps = {g.tensor: g for g in forward_to_backward_gaps(tiny) if g.before_op - g.after_op > 1}
    evicts = {m.tensor: m for m in plan.moves if m.kind == "evict"}
    fetches = {m.tensor: m for m in plan.moves if m.kind == "prefetch"}
    assert set(evicts) == set(gaps)
    for t, g in gaps.items():
        assert evicts[t].after_op == g.after_op  # right after the last forward use
        assert fetches[t].after_op == g.before_op - 1  # on the compute stream, just before the use
    assert plan.meta["uncharged_pack_s"] > 0
    _checked(plan, tiny, hw, budget)


def test_marks_largest_marks_a_prefix_of_the_largest(tiny):
    hw = simple_hw()
    budget = _budget(tiny, 0.8)
    every = make_plan("compile_offloading", tiny, hw, budget=budget)
    some = make_plan("compile_offloading", tiny, hw, budget=budget, marks="largest")
    chosen = {m.tensor for m in some.moves if m.kind == "evict"}
    assert 0 < len(chosen) < len({m.tensor for m in every.moves if m.kind == "evict"})
    rest = [g.tensor for g in forward_to_backward_gaps(tiny) if g.tensor not in chosen and g.before_op - g.after_op > 1]
    assert min(tiny.sizes[t] for t in chosen) >= max(tiny.sizes[t] for t in rest)
    _checked(some, tiny, hw, budget)


def test_marks_largest_offloads_more_as_the_budget_falls(tiny):
    hw = simple_hw()
    chosen = []
    for share in (0.95, 0.9, 0.85, 0.8, 0.75):
        plan = make_plan("compile_offloading", tiny, hw, budget=_budget(tiny, share), marks="largest")
        chosen.append({m.tensor for m in plan.moves if m.kind == "evict"})
    assert all(a <= b for a, b in zip(chosen, chosen[1:])) and chosen[0] != chosen[-1]


def test_prefetch_walk_covers_each_copy_with_compute(tiny):
    gaps = [g for g in forward_to_backward_gaps(tiny) if g.before_op - g.after_op > 1]
    copy_s = {g.tensor: 1.5e-3 for g in gaps}  # one and a half ops of 1 ms
    where = prefetch_points(tiny, gaps, copy_s)
    bwd_start = next(i for i, o in enumerate(tiny.ops) if o.phase == "backward")
    compute = {"mm", "_scaled_dot_product_flash_attention_backward"}
    for g in gaps:
        after = where[g.tensor]
        assert bwd_start - 1 <= after < g.before_op
        if after > bwd_start - 1:  # placed early enough: compute ops in between cover the copy
            between = [i for i in range(after + 1, g.before_op) if tiny.ops[i].name.split("::")[-1] in compute]
            assert sum(tiny.ops[i].duration_s for i in between) >= copy_s[g.tensor] - 1e-12


def test_prefetch_plan_is_valid_and_needs_the_side_stream(tiny):
    hw = simple_hw()
    # (reloads issued earlier hold more at the backward's peak: a roomy budget)
    plan = make_plan("compile_offloading", tiny, hw, separate_stream=True, prefetch=True, always=True)
    assert plan.meta["uncharged_pack_s"] == 0
    sync = make_plan("compile_offloading", tiny, hw, always=True)
    budget = plan.budget_bytes
    assert _checked(plan, tiny, hw, budget).time_s < _checked(sync, tiny, hw, budget).time_s
    with pytest.raises(PolicyError, match="separate_stream"):
        make_plan("compile_offloading", tiny, hw, prefetch=True)


def test_offloading_refuses_with_bytes(tiny):
    with pytest.raises(PlanError, match=r"compile_offloading: no plan fits in .* \(\d+ bytes\)"):
        make_plan("compile_offloading", tiny, simple_hw(), budget=_budget(tiny, 0.2))


# -- on a compiled graph, and from the command line ----------------------------------------------


@pytest.fixture(scope="module")
def compiled_trace():
    import torch

    import tierflow.compiled as tc

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 128),
                                torch.nn.GELU(), torch.nn.Linear(128, 1))
    run = tc.compile(model, budget=None, backend="aot_eager")
    with run:
        run.model(torch.randn(256, 32)).pow(2).mean().backward()
    return run.records[0].facts.trace


@pytest.mark.parametrize("name,opts", [("compile_memory_budget", {"memory_budget": 0.3}),
                                       ("compile_offloading", {"always": True})])
def test_runs_on_a_compiled_graphs_trace(compiled_trace, name, opts):
    from tierflow.compiled.predict import cpu_hardware

    hw = cpu_hardware()
    plan = make_plan(name, compiled_trace, hw, **opts)
    assert plan.recomputes or plan.moves
    _checked(plan, compiled_trace, hw, plan.budget_bytes)


def test_compare_runs_both(compiled_trace, tmp_path):
    path = compiled_trace.save(tmp_path / "graph.json")
    out = subprocess.run([sys.executable, "-m", "tierflow", "compare", str(path), "--hardware", "rtx4090-24g",
                          "--set", "compile_offloading.always=true", "--set", "compile_memory_budget.memory_budget=0.3",
                          "--policies", "compile_memory_budget,compile_offloading"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if re.search(r"compile_(memory_budget|offloading) ", line)]
    assert len(rows) == 2 and all("yes" in r and "no plan" not in r for r in rows)
