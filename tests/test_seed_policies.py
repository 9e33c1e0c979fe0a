"""The seed-system policies: flashneuron, vdnn, singa, myelin, deeptm.

Each plan is checked by the independent validator (``tierflow.plan.validate``) and by the
simulator, on a small synthetic GPT trace and on the hand-made traces of helpers.py.
"""

from __future__ import annotations

import pytest

from helpers import MB, chain_trace, simple_hw
from tierflow import Plan, load_hardware, load_trace, validate
from tierflow.errors import PlanError, PolicyError
from tierflow.policies import make_plan
from tierflow.simulate import simulate
from tierflow.synthetic import gpt_trace

SEEDS = ("flashneuron", "vdnn", "singa", "myelin", "deeptm")
FAST = {"deeptm": {"episodes": 2}}


@pytest.fixture(scope="module")
def gpt():
    hw = load_hardware("a100-40g-pcie4-nvme")
    return gpt_trace(hw, layers=4, d_model=1024, batch=8, seq=512), hw


def _plan(name, trace, hw, budget, **kw):
    return make_plan(name, trace, hw, budget=budget, **{**FAST.get(name, {}), **kw})


def _check(plan: Plan, trace, hw, budget):
    res = validate(plan, trace, hw)  # raises if inconsistent or over any capacity
    assert not plan.reactive and plan.budget_bytes == budget
    assert res.tier_bytes[hw.device].max() <= budget
    r = simulate(trace, hw, plan)
    assert r.error is None and r.peak_bytes[hw.device] <= budget
    assert r.time_s >= r.ideal_s
    return r


@pytest.mark.parametrize("name", SEEDS)
def test_plan_is_valid_under_a_tight_budget(gpt, name):
    trace, hw = gpt
    budget = int(0.85 * trace.peak_live_bytes)
    plan = _plan(name, trace, hw, budget)
    r = _check(plan, trace, hw, budget)
    assert plan.moves, "a budget under the peak needs moves"
    assert r.fits


@pytest.mark.parametrize("name", SEEDS)
def test_no_moves_when_everything_fits(gpt, name):
    trace, hw = gpt
    plan = _plan(name, trace, hw, None)
    assert plan.moves == ()
    assert simulate(trace, hw, plan).time_s == trace.ideal_s


@pytest.mark.parametrize("name", SEEDS)
def test_deterministic(gpt, name):
    trace, hw = gpt
    budget = int(0.7 * trace.peak_live_bytes)  # some refuse: they must refuse every time
    try:
        a = _plan(name, trace, hw, budget)
    except PlanError:
        with pytest.raises(PlanError):
            _plan(name, trace, hw, budget)
        return
    assert a.moves == _plan(name, trace, hw, budget).moves


def test_each_policy_moves_only_its_kinds(gpt):
    trace, hw = gpt
    budget = int(0.9 * trace.peak_live_bytes)
    kinds = {n: {trace.tensors[m.tensor].kind for m in _plan(n, trace, hw, budget).moves} for n in ("flashneuron", "vdnn")}
    for n in ("flashneuron", "vdnn"):
        assert kinds[n] and kinds[n] <= {"activation", "input"}
    fn = _plan("flashneuron", trace, hw, budget)
    assert {m.tier for m in fn.moves} == {"ssd"}
    bwd = next(i for i, o in enumerate(trace.ops) if o.phase == "backward")
    for m in fn.moves:  # evicted in forward, fetched back in backward
        assert (trace.ops[m.after_op].phase == "forward") if m.kind == "evict" else m.after_op >= bwd - 1
    assert {m.tier for m in _plan("vdnn", trace, hw, budget).moves} == {"host"}
    my = _plan("myelin", trace, hw, int(0.95 * trace.peak_live_bytes))
    assert my.moves and all(trace.tensors[m.tensor].kind in ("parameter", "gradient", "optimizer_state") for m in my.moves)


def test_vdnn_prefetches_one_layer_ahead(gpt):
    trace, hw = gpt
    plan = _plan("vdnn", trace, hw, int(0.9 * trace.peak_live_bytes), mode="all")
    needs = sorted({m.needed_by for m in plan.moves if m.kind == "prefetch"})
    for m in plan.moves:
        if m.kind == "prefetch":
            k = needs.index(m.needed_by)
            if k > 0:  # issued as the previous backward layer starts
                assert m.after_op == needs[k - 1] - 1
    assert plan.meta["config"] == "all"
    with pytest.raises(PolicyError):
        _plan("vdnn", trace, hw, None, mode="bogus")


def test_vdnn_dyn_offloads_least_that_fits(gpt):
    trace, hw = gpt
    loose = _plan("vdnn", trace, hw, None)
    assert loose.meta["config"] == "none"
    tight = _plan("vdnn", trace, hw, int(0.85 * trace.peak_live_bytes))
    assert tight.meta["config"] == "all"  # the GPT trace has no convolutions


def test_singa_modes_and_threshold(gpt):
    trace, hw = gpt
    budget = int(0.85 * trace.peak_live_bytes)
    for mode in ("stick-to-limit", "no-overhead"):
        plan = _plan("singa", trace, hw, budget, mode=mode)
        _check(plan, trace, hw, budget)
        assert all(trace.sizes[m.tensor] >= 2**20 for m in plan.moves)
    # a threshold above every tensor leaves nothing to swap
    with pytest.raises(PlanError, match="no block"):
        _plan("singa", trace, hw, budget, min_bytes=10**12)


def test_singa_no_overhead_swaps_in_on_time(gpt):
    trace, hw = gpt
    plan = _plan("singa", trace, hw, int(0.85 * trace.peak_live_bytes), mode="no-overhead")
    start = trace.op_start_s
    for m in plan.moves:
        if m.kind == "prefetch" and m.needed_by > m.after_op:
            window = start[m.needed_by] - start[m.after_op + 1]
            assert window >= hw.transfer_time(int(trace.sizes[m.tensor]), "host", hw.device) - 1e-12


def test_deeptm_learns_reproducibly_and_reports(gpt):
    trace, hw = gpt
    budget = int(0.7 * trace.peak_live_bytes)
    plan = _plan("deeptm", trace, hw, budget, episodes=3, seed=7)
    meta = plan.meta
    assert meta["episodes"] == 3 and len(meta["rewards"]) == 3
    assert meta["rewards"][meta["best_episode"]] == max(meta["rewards"])
    assert abs(sum(meta["weights"]) - 1) < 1e-3 and meta["solver"].startswith("highs")
    again = _plan("deeptm", trace, hw, budget, episodes=3, seed=7)
    assert again.moves == plan.moves and again.meta["rewards"] == meta["rewards"]
    assert simulate(trace, hw, plan).ratio == pytest.approx(max(meta["rewards"]), abs=1e-4)


def test_deeptm_aggregates_small_tensors_into_pages():
    from tierflow import Op, TensorInfo, Trace
    from tierflow.policies.deeptm import build_units

    # eight 1 MB tensors with the same gap, and one 100 MB tensor
    ts = [TensorInfo(i, 1 * MB, "activation") for i in range(8)] + [TensorInfo(8, 100 * MB, "activation")]
    ops = [
        Op("f", "forward", 0.01, (), tuple(range(9))),
        Op("mid", "forward", 0.01),
        Op("b", "backward", 0.01, tuple(range(9)), ()),
    ]
    trace = Trace(ops, ts, "pages")
    units = build_units(trace, budget=50 * MB, page_bytes=4 * MB)
    sizes = sorted(u.nbytes for u in units)
    assert sizes == [4 * MB, 4 * MB, 100 * MB]


def test_deeptm_uses_pmem_on_the_cpu_machine():
    hw = load_hardware("cpu-dram-pmem")
    trace = gpt_trace(hw, layers=2, d_model=1024, batch=8, seq=512)
    plan = _plan("deeptm", trace, hw, int(0.7 * trace.peak_live_bytes))
    assert {m.tier for m in plan.moves} == {"pmem"}
    _check(plan, trace, hw, plan.budget_bytes)


@pytest.mark.parametrize("name", SEEDS)
def test_impossible_budgets_say_so(name):
    trace = chain_trace()
    hw = simple_hw()
    # resolve_budget refuses a budget below the minimum working set (130 MB at op 3)
    with pytest.raises(PlanError, match="minimum working set"):
        _plan(name, trace, hw, 100 * MB)


def test_flashneuron_refuses_what_it_cannot_fit(gpt):
    trace, hw = gpt
    with pytest.raises(PlanError) as e:
        _plan("flashneuron", trace, hw, int(0.5 * trace.peak_live_bytes))
    msg = str(e.value)
    assert "no plan fits" in msg and "bytes" in msg and "minimum working set" in msg


def test_host_capacity_is_respected(gpt):
    trace, hw = gpt
    small_host = hw.with_tier("host", capacity=float(64 * MB))
    with pytest.raises(PlanError, match=r"host full"):
        _plan("vdnn", trace, small_host, int(0.85 * trace.peak_live_bytes))


def test_seed_policies_on_a_g10_case(g10_dir):
    trace = load_trace(g10_dir / "bert-256")
    hw = load_hardware("g10-a100")
    for name in ("flashneuron", "vdnn", "singa", "myelin"):
        plan = make_plan(name, trace, hw)
        r = _check(plan, trace, hw, hw.device_capacity)
        assert r.fits and 0.3 < r.ratio <= 1.0


def test_deeptm_keeps_the_solver_debug_line_out_of_stdout(capfd):
    # Random case 518 of benchmarks/robustness.py: scipy's HiGHS prints a debugging line
    # to file descriptor 1 during this MIP (ERGO-Code/HiGHS#2783); deeptm keeps it out
    # of the user's output, and what Python printed before is not lost.
    from tierflow.synthetic import toy_hardware, training_trace

    trace = training_trace(4, [34, 38, 58, 48, 30, 8, 4, 20, 13, 49, 8, 26, 6, 45, 3, 29, 21, 40],
                           [27, 18, 15, 2, 21, 9, 22, 5, 5, 18, 25, 15, 8, 15])
    hw = toy_hardware(pcie_gbps=1.0, host_gib=0.05, fault_us=45.0)
    print("ours", end="")  # still in Python's buffer when the solver starts
    make_plan("deeptm", trace, hw, budget=249_458_947)
    assert capfd.readouterr().out == "ours"


def test_deeptm_range_max_equals_the_max_over_each_circular_run():
    """The range-maximum table deeptm's greedy cover uses gives exactly the max of the
    ops each unit covers, runs that wrap past the last op and empty runs included."""
    import numpy as np

    from tierflow.policies.deeptm import _range_max

    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 64, 301):
        values = rng.normal(size=n) * 1e9
        start = rng.integers(0, n, size=200)
        span = rng.integers(0, n + 1, size=200)
        got = _range_max(values, start, span)
        want = [max((values[(s + j) % n] for j in range(L)), default=-np.inf) for s, L in zip(start, span)]
        assert got.tolist() == want


def test_deeptm_cover_queries_equal_the_cover_matrix():
    """deeptm never builds its op x unit cover matrix (each unit's gap is one circular
    run of ops); what it asks of it instead (``covered``: the matrix times a vector;
    ``_cover_rows``: some of its rows for the LP, entries in the same order; ``_ops``:
    a unit's ops; ``_units_over``: the units over some ops) equals the matrix built
    gap by gap, exactly, on a real trace's units, runs that wrap past the last op
    included."""
    import numpy as np
    from scipy.sparse import csr_matrix

    from tierflow.policies.deeptm import _Ilp, build_units
    from tierflow.synthetic import gpt_trace

    hw = load_hardware("g10-a100")
    trace = gpt_trace(hw, layers=3)
    budget = 0.6 * trace.peak_live_bytes
    units = build_units(trace, budget, 2 * 2**20)
    assert len(units) > 10
    ilp = _Ilp(trace, hw, budget, units, hw.offload_tiers, node_limit=50)
    n = trace.n_ops
    cover = np.zeros((n, len(units)))  # how many times each unit's gap covers each op
    for i, u in enumerate(units):
        for op in range(u.after_op + 1, u.end):
            cover[op % n, i] += 1
    assert any(u.end > n for u in units)  # some runs wrap
    rng = np.random.default_rng(1)
    for _ in range(5):
        x = rng.integers(0, 2, size=len(units)) * ilp.size
        assert ilp.covered(x).tolist() == (cover @ x).tolist()
        ops = np.sort(rng.choice(n, size=int(rng.integers(1, n)), replace=False))
        rows = ilp._cover_rows(ops)
        want = csr_matrix(cover)[ops]  # what the LP's rows were sliced from before
        assert rows.indptr.tolist() == want.indptr.tolist()
        assert rows.indices.tolist() == want.indices.tolist()
        assert rows.data.tolist() == want.data.tolist()
        assert ilp._units_over(ops).tolist() == np.flatnonzero(cover[ops].any(axis=0)).tolist()
    for i in range(len(units)):
        assert sorted(np.arange(n)[ilp._ops(i)].tolist()) == np.flatnonzero(cover[:, i]).tolist()
