"""The DeepSpeed ZeRO peers: zero_offload, zero_offload+checkpoint, zero_infinity.

Each plan is checked against an independent per-op walk written here (where every
tensor is at every op, from the plan's moves and host steps, by the rules of
:class:`tierflow.plan.HostStep`), on the synthetic GPT trace (AdamW: one op per
parameter), on a captured zoo model (PyTorch's single-tensor AdamW: ten ops per
parameter, keys) and on hand-made traces (a ``foreach`` op shared by parameters).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import MB
from tierflow import Op, TensorInfo, Trace, load_hardware, validate
from tierflow.errors import PlanError, PolicyError
from tierflow.policies import make_plan, policy_options
from tierflow.simulate import simulate
from tierflow.synthetic import gpt_trace

ZERO = ("zero_offload", "zero_offload+checkpoint", "zero_infinity")
SMALL_BUCKET = {"reduce_bucket_size": 1000}
# every parameter released after every call and fetched only for its own call
EVERY_USE = {"max_reuse_distance": 0, "prefetch_bucket_size": 0, "param_persistence_threshold": 0}


@pytest.fixture(scope="module")
def hw():
    return load_hardware("rtx4090-24g")


@pytest.fixture(scope="module")
def gpt(hw):
    return gpt_trace(hw, layers=2, d_model=256, batch=2, seq=128)


@pytest.fixture(scope="module")
def flat(gpt):
    """The GPT trace without scopes (as an imported trace): every op is a module call."""
    import dataclasses

    return Trace([dataclasses.replace(o, scope=None) for o in gpt.ops], gpt.tensors, gpt.name, gpt.meta)


@pytest.fixture(scope="module")
def captured():
    from tierflow.capture import zoo_trace

    return zoo_trace("gpt-tiny")


def _updated_params(trace: Trace) -> set[int]:
    return {t for o in trace.ops if o.phase == "optimizer" for t in o.outputs
            if trace.tensors[t].kind == "parameter" and trace.tensors[t].persistent}


def residency(plan, trace: Trace) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Device bytes per op and, per tensor, a bool per op (on the device), by brute
    force: live tensors, minus host-stepped state, gradients after their last backward
    use, tensors only host-stepped ops use, and parameters between an eviction and the
    prefetch that follows it. Asserts that no op outside the host steps uses a tensor
    while it is away."""
    n = trace.n_ops
    gone = {i for h in plan.host_steps for i in h.ops}
    on = {}
    for t in range(trace.n_tensors):
        row = np.zeros(n, dtype=bool)
        row[int(trace.birth[t]) : int(trace.death[t]) + 1] = True
        on[t] = row
    for h in plan.host_steps:
        for s in h.state:
            on[s][:] = False
        last = max(i for i in trace.uses(h.grad).tolist() if i not in gone)
        on[h.grad][last + 1 :] = False
    for t in range(trace.n_tensors):
        if not trace.tensors[t].persistent and all(i in gone for i in trace.uses(t).tolist()):
            on[t][:] = False
    by_tensor: dict[int, list] = {}
    for m in plan.moves:
        by_tensor.setdefault(m.tensor, []).append(m)
    for t, ms in by_tensor.items():
        ms.sort(key=lambda m: (m.after_op, m.kind != "evict"))
        state = ms[-1].kind == "evict"  # away when the iteration starts?
        row = np.zeros(n, dtype=bool)
        k = 0
        for op in range(n):
            row[op] = not state
            while k < len(ms) and ms[k].after_op == op:
                state = ms[k].kind == "evict"
                k += 1
        on[t] = on[t] & row
    for i, o in enumerate(trace.ops):
        if i in gone:
            continue
        for t in o.tensors:
            assert on[t][i], f"op {i} ({o.name}) uses tensor {t} ({trace.tensors[t].name}) while it is away"
    sizes = trace.sizes
    curve = sum(np.where(on[t], int(sizes[t]), 0) for t in range(trace.n_tensors))
    return curve, on


# -- every policy -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ZERO)
def test_every_updated_parameter_is_host_stepped_with_its_grad_and_state(gpt, hw, name):
    plan = make_plan(name, gpt, hw, **SMALL_BUCKET)
    assert {h.param for h in plan.host_steps} == _updated_params(gpt)
    names = {t.id: t.name for t in gpt.tensors}
    for h in plan.host_steps:
        assert names[h.grad] == names[h.param] + ".grad"
        assert sorted(names[s] for s in h.state) == [names[h.param] + ".exp_avg", names[h.param] + ".exp_avg_sq"]
        assert h.tier == "host" and h.ops and all(gpt.ops[i].phase == "optimizer" for i in h.ops)


@pytest.mark.parametrize("name", ZERO)
def test_no_optimizer_state_on_the_device(gpt, hw, name):
    plan = make_plan(name, gpt, hw, **SMALL_BUCKET)
    _, on = residency(plan, gpt)
    states = [t.id for t in gpt.tensors if t.kind == "optimizer_state"]
    assert states and not any(on[s].any() for s in states)


@pytest.mark.parametrize("name", ("zero_offload", "zero_infinity"))
def test_planned_peak_is_what_the_plan_holds_plus_the_bucket(gpt, hw, name):
    opts = {**SMALL_BUCKET, **(EVERY_USE if name == "zero_infinity" else {})}
    plan = make_plan(name, gpt, hw, **opts)
    curve, _ = residency(plan, gpt)
    bucket = 1000 * gpt.meta["dtype_bytes"]
    assert plan.meta["bucket_bytes"] == bucket
    if name == "zero_offload":  # held through backward only
        bwd = np.array([o.phase == "backward" for o in gpt.ops])
        curve = curve + np.where(bwd, bucket, 0)
    else:  # allocated once
        curve = curve + bucket
    assert plan.meta["planned_peak_bytes"] == int(curve.max())
    assert curve.max() < gpt.peak_live_bytes


@pytest.mark.parametrize("name", ZERO)
def test_refuses_with_bytes_below_its_peak(gpt, hw, name):
    opts = {**SMALL_BUCKET, "always": True} if name.endswith("checkpoint") else dict(SMALL_BUCKET)
    peak = make_plan(name, gpt, hw, **opts).meta["planned_peak_bytes"]
    assert make_plan(name, gpt, hw, budget=peak, **opts).budget_bytes == peak
    with pytest.raises(PlanError, match=rf"{re.escape(name)}: no plan fits in .* \({peak - 1} bytes\).* bytes"):
        make_plan(name, gpt, hw, budget=peak - 1, **opts)


@pytest.mark.parametrize("name", ZERO)
def test_refuses_a_trace_without_an_optimizer_step(hw, name):
    ts = [TensorInfo(0, 10 * MB, "parameter", True, "W"), TensorInfo(1, 5 * MB, "activation", False, "A"),
          TensorInfo(2, 10 * MB, "gradient", False, "G")]
    ops = [Op("f", "forward", 1e-3, (0,), (1,)), Op("b", "backward", 1e-3, (1, 0), (2,))]
    with pytest.raises(PlanError, match="no optimizer step to offload"):
        make_plan(name, Trace(ops, ts, "g10-like"), hw)


@pytest.mark.parametrize("name", ZERO)
def test_host_memory_too_small_is_refused_with_bytes(gpt, hw, name):
    import dataclasses

    host = dataclasses.replace(hw.tier("host"), capacity=10 * MB)
    small = dataclasses.replace(hw, tiers=tuple(host if t.name == "host" else t for t in hw.tiers))
    with pytest.raises(PlanError, match=r"bytes\) of parameters, gradients and optimizer state to keep on host"):
        make_plan(name, gpt, small, **SMALL_BUCKET)


@pytest.mark.parametrize("name", ZERO)
def test_deterministic(gpt, hw, name):
    a, b = (make_plan(name, gpt, hw, **SMALL_BUCKET) for _ in range(2))
    assert a.moves == b.moves and a.host_steps == b.host_steps and a.recomputes == b.recomputes


@pytest.mark.parametrize("name", ZERO)
def test_options_are_declared(name):
    declared = {o.name for o in policy_options(name)}
    assert "reduce_bucket_size" in declared
    if name == "zero_infinity":
        assert {"device", "optimizer_device", "prefetch_bucket_size", "max_live_parameters", "max_reuse_distance",
                "param_persistence_threshold", "model_persistence_threshold"} <= declared
    if name == "zero_offload+checkpoint":
        assert {"pattern", "segments", "early_stop", "impure", "always", "overlap_comm"} <= declared


# -- zero_offload -----------------------------------------------------------------------


def test_zero_offload_moves_nothing(gpt, hw):
    plan = make_plan("zero_offload", gpt, hw, **SMALL_BUCKET)
    assert plan.moves == () and plan.recomputes == ()
    _, on = residency(plan, gpt)
    for t in gpt.tensors:  # parameters and activations stay where the trace has them
        if t.kind in ("parameter", "activation"):
            assert on[t.id][int(gpt.birth[t.id]) : int(gpt.death[t.id]) + 1].all()


def test_zero_offload_gradient_leaves_after_its_last_backward_write(gpt, hw):
    plan = make_plan("zero_offload", gpt, hw, **SMALL_BUCKET)
    _, on = residency(plan, gpt)
    wte_grad = next(h.grad for h in plan.host_steps if gpt.tensors[h.param].name == "wte")
    writes = [i for i, o in enumerate(gpt.ops) if wte_grad in o.outputs and o.phase == "backward"]
    assert len(writes) == 2  # lm_head and embedding backward both accumulate into it
    assert on[wte_grad][writes[-1]] and not on[wte_grad][writes[-1] + 1 :].any()


def test_zero_offload_bucket_options_are_honoured(gpt, hw):
    one = make_plan("zero_offload", gpt, hw, reduce_bucket_size=10**6)
    two = make_plan("zero_offload", gpt, hw, reduce_bucket_size=10**6, overlap_comm=True)
    elem = gpt.meta["dtype_bytes"]
    assert one.meta["bucket_bytes"] == 10**6 * elem and two.meta["bucket_bytes"] == 2 * 10**6 * elem
    assert two.meta["planned_peak_bytes"] - one.meta["planned_peak_bytes"] == 10**6 * elem
    # DeepSpeed's default bucket, 5e8 elements, is what a plain call charges
    assert make_plan("zero_offload", gpt, hw).meta["bucket_bytes"] == 500_000_000 * elem


def test_zero_offload_with_checkpoint_adds_the_checkpoint_policys_recomputes(gpt, hw):
    plan = make_plan("zero_offload+checkpoint", gpt, hw, always=True, **SMALL_BUCKET)
    ckpt = make_plan("checkpoint", gpt, hw, always=True)
    assert plan.recomputes == ckpt.recomputes and plan.recomputes
    assert plan.host_steps == make_plan("zero_offload", gpt, hw, **SMALL_BUCKET).host_steps
    assert plan.meta["planned_peak_bytes"] < make_plan("zero_offload", gpt, hw, **SMALL_BUCKET).meta["planned_peak_bytes"]


def test_zero_offload_with_checkpoint_checkpoints_only_when_needed(gpt, hw):
    alone = make_plan("zero_offload", gpt, hw, **SMALL_BUCKET).meta["planned_peak_bytes"]
    assert make_plan("zero_offload+checkpoint", gpt, hw, budget=alone, **SMALL_BUCKET).recomputes == ()
    tight = make_plan("zero_offload+checkpoint", gpt, hw, budget=alone - 1, **SMALL_BUCKET)
    assert tight.recomputes and tight.meta["planned_peak_bytes"] <= alone - 1


# -- zero_infinity ----------------------------------------------------------------------


def _param_uses(trace: Trace, gone: set[int]) -> list[tuple[int, int]]:
    return [(i, t) for i, o in enumerate(trace.ops) if i not in gone for t in o.tensors
            if trace.tensors[t].kind == "parameter"]


def test_zero_infinity_evicts_and_prefetches_every_parameter_in_access_order(flat, hw):
    plan = make_plan("zero_infinity", flat, hw, **SMALL_BUCKET, **EVERY_USE)
    gone = {i for h in plan.host_steps for i in h.ops}
    calls = plan.meta["module_calls"]
    assert calls == flat.n_ops - len(gone)  # no scopes in this trace: one call per op
    uses = _param_uses(flat, gone)
    prefetches = sorted((m for m in plan.moves if m.kind == "prefetch"),
                        key=lambda m: (m.needed_by, m.tensor))
    # one fetch per use, needed by that use, in the order of the uses
    assert [(m.needed_by, m.tensor) for m in prefetches] == sorted(uses)
    # with no prefetch bucket each fetch is issued when the op before its use ends
    assert all(m.after_op == (m.needed_by - 1) % flat.n_ops for m in prefetches)
    evictions = sorted((m.after_op, m.tensor) for m in plan.moves if m.kind == "evict")
    assert evictions == sorted(uses)  # released after every use
    _, on = residency(plan, flat)
    for t in {t for _, t in uses}:
        assert on[t].sum() == len([1 for _, u in uses if u == t])  # on the device only when used


def test_zero_infinity_prefetch_bucket_fetches_ahead_in_order(flat, hw):
    ahead = make_plan("zero_infinity", flat, hw, **SMALL_BUCKET, **{**EVERY_USE, "prefetch_bucket_size": 10**9})
    late = make_plan("zero_infinity", flat, hw, **SMALL_BUCKET, **EVERY_USE)
    # a parameter still on the device when the prefetcher passes its next use is kept
    # for it (DeepSpeed's most_recent_step_id_param_fetched_for): fewer fetches
    assert 0 < ahead.count("prefetch") < late.count("prefetch")
    lead = [(m.needed_by - m.after_op) % flat.n_ops for m in ahead.moves if m.kind == "prefetch"]
    assert max(lead) > 1  # some fetched more than one op ahead
    # a fetch is never issued before that of a parameter needed earlier
    order = sorted(((m.after_op - (m.needed_by < m.after_op) * flat.n_ops), m.needed_by)
                   for m in ahead.moves if m.kind == "prefetch")
    needs = [b for _, b in order]
    assert needs == sorted(needs)
    assert ahead.meta["planned_peak_bytes"] > late.meta["planned_peak_bytes"]
    residency(ahead, flat)


def test_zero_infinity_max_live_parameters_stops_prefetching(flat, hw):
    base = {**SMALL_BUCKET, **EVERY_USE, "prefetch_bucket_size": 10**9}
    capped = make_plan("zero_infinity", flat, hw, max_live_parameters=0, **base)
    assert all(m.after_op == (m.needed_by - 1) % flat.n_ops for m in capped.moves if m.kind == "prefetch")


def test_zero_infinity_reuse_distance_keeps_parameters_reused_soon(flat, hw):
    # 1e9 elements, the default: this model is smaller, so each parameter is fetched once
    default = make_plan("zero_infinity", flat, hw, **SMALL_BUCKET, prefetch_bucket_size=0)
    assert default.meta["fetches"] == default.meta["offloaded_params"]
    every = make_plan("zero_infinity", flat, hw, **SMALL_BUCKET, prefetch_bucket_size=0, max_reuse_distance=0)
    assert every.meta["fetches"] > default.meta["fetches"]
    residency(default, flat)


def test_zero_infinity_small_parameters_stay_on_the_device(gpt, hw):
    elem = gpt.meta["dtype_bytes"]
    sizes = sorted({int(gpt.sizes[p]) for p in _updated_params(gpt)})
    cut = sizes[0] // elem  # the smallest parameters persist
    plan = make_plan("zero_infinity", gpt, hw, **SMALL_BUCKET, param_persistence_threshold=cut)
    kept = {p for p in _updated_params(gpt) if int(gpt.sizes[p]) // elem <= cut}
    assert kept and not kept & {m.tensor for m in plan.moves}
    assert plan.meta["persistent_params"] == len(kept)
    capped = make_plan("zero_infinity", gpt, hw, **SMALL_BUCKET, param_persistence_threshold=cut,
                       model_persistence_threshold=0)
    assert capped.meta["persistent_params"] == 0


def test_zero_infinity_nvme(gpt, hw):
    plan = make_plan("zero_infinity", gpt, hw, device="nvme", **SMALL_BUCKET)
    ssd = next(t.name for t in hw.tiers if t.kind == "ssd")
    assert {m.tier for m in plan.moves} == {ssd} and {h.tier for h in plan.host_steps} == {ssd}
    mixed = make_plan("zero_infinity", gpt, hw, device="nvme", optimizer_device="cpu", **SMALL_BUCKET)
    assert {m.tier for m in mixed.moves} == {ssd} and {h.tier for h in mixed.host_steps} == {"host"}


def test_zero_infinity_bad_options(gpt, hw):
    with pytest.raises(PolicyError, match="device 'gpu' is not one of cpu, nvme"):
        make_plan("zero_infinity", gpt, hw, device="gpu")
    with pytest.raises(PolicyError, match="prefetch_bucket_size -1 is negative"):
        make_plan("zero_infinity", gpt, hw, prefetch_bucket_size=-1)


def test_zero_infinity_module_calls_from_scopes(hw):
    scoped = gpt_trace(hw, layers=2, d_model=256, batch=2, seq=128)
    if all(o.scope is None for o in scoped.ops):
        pytest.fail("gpt_trace has no scopes")
    plan = make_plan("zero_infinity", scoped, hw, **SMALL_BUCKET, **EVERY_USE)
    gone = {i for h in plan.host_steps for i in h.ops}
    # a parameter used twice within one call is fetched once for it
    assert plan.meta["module_calls"] < scoped.n_ops - len(gone)
    residency(plan, scoped)


# -- captured traces and hand-made optimizer groups --------------------------------------


@pytest.mark.parametrize("name", ZERO)
def test_captured_single_tensor_adamw(captured, hw, name):
    plan = make_plan(name, captured, hw, **SMALL_BUCKET, **(EVERY_USE if name == "zero_infinity" else {}))
    assert {h.param for h in plan.host_steps} == _updated_params(captured)
    keys = {t.id: t.key for t in captured.tensors}
    for h in plan.host_steps:
        pname = keys[h.param].removeprefix("param:")
        assert keys[h.grad] == f"grad:{pname}"
        assert sorted(keys[s] for s in h.state) == [f"opt:{pname}:exp_avg", f"opt:{pname}:exp_avg_sq"]
    # every optimizer op, the tensor-less step counters included, leaves the device
    gone = {i for h in plan.host_steps for i in h.ops}
    assert gone == {i for i, o in enumerate(captured.ops) if o.phase == "optimizer"}
    curve, on = residency(plan, captured)
    temps = {t for i in gone for t in captured.ops[i].tensors if captured.tensors[t].kind == "temporary"}
    assert temps and not any(on[t].any() for t in temps)


def _foreach_trace(keys: bool, per_param_ops: bool) -> Trace:
    def key(k):
        return k if keys else None

    ts = [TensorInfo(0, 4 * MB, "parameter", True, "a", key("param:a")),
          TensorInfo(1, 8 * MB, "parameter", True, "b", key("param:b")),
          TensorInfo(2, 4 * MB, "gradient", False, "a.grad", key("grad:a")),
          TensorInfo(3, 8 * MB, "gradient", False, "b.grad", key("grad:b")),
          TensorInfo(4, 4 * MB, "optimizer_state", True, "a.m", key("opt:a:m")),
          TensorInfo(5, 8 * MB, "optimizer_state", True, "b.m", key("opt:b:m")),
          TensorInfo(6, 1 * MB, "activation", False, "x")]
    ops = [Op("fa", "forward", 1e-3, (0,), (6,)), Op("fb", "forward", 1e-3, (1, 6), (6,)),
           Op("bb", "backward", 1e-3, (1, 6), (3,)), Op("ba", "backward", 1e-3, (0, 6), (2,))]
    if per_param_ops:
        ops += [Op("m.a", "optimizer", 1e-4, (0, 2, 4), (4,)), Op("m.b", "optimizer", 1e-4, (1, 3, 5), (5,))]
    ops += [Op("_foreach_add_", "optimizer", 1e-4, (0, 1, 2, 3, 4, 5), (0, 1))]
    return Trace(ops, ts, "foreach")


@pytest.mark.parametrize("keys,per_param_ops", [(True, False), (False, True)])
def test_foreach_group_is_host_stepped_whole(hw, keys, per_param_ops):
    tr = _foreach_trace(keys, per_param_ops)
    plan = make_plan("zero_offload", tr, hw, **SMALL_BUCKET)
    steps = {h.param: h for h in plan.host_steps}
    assert set(steps) == {0, 1}
    assert (steps[0].grad, steps[0].state, steps[1].grad, steps[1].state) == (2, (4,), 3, (5,))
    shared = len(tr.ops) - 1
    assert shared in steps[0].ops and shared in steps[1].ops


def test_foreach_group_without_keys_or_per_parameter_ops_is_refused(hw):
    with pytest.raises(PlanError, match="parameter 0 \\(a\\) has no gradient .* cannot host-step it"):
        make_plan("zero_offload", _foreach_trace(False, False), hw, **SMALL_BUCKET)


# -- the validator and the simulator ----------------------------------------------------


@pytest.mark.parametrize("name", ZERO)
@pytest.mark.parametrize("which", ("gpt", "flat", "captured"))
def test_plan_validates_and_simulates(request, hw, name, which):
    trace = request.getfixturevalue(which)
    opts = {**SMALL_BUCKET, **({"always": True} if name.endswith("checkpoint") else {}),
            **(EVERY_USE if name == "zero_infinity" else {})}
    plan = make_plan(name, trace, hw, **opts)
    res = validate(plan, trace, hw)
    if name == "zero_offload+checkpoint":
        from tierflow.policies._recompute import planned_device_bytes

        mine = planned_device_bytes(trace, plan.recomputes) - trace.live_bytes + residency(plan, trace)[0]
    else:
        mine = residency(plan, trace)[0]
    assert np.array_equal(res.tier_bytes[hw.device], mine)  # the validator counts what the walk here counts
    r = simulate(trace, hw, plan)
    gone = {i for h in plan.host_steps for i in h.ops}
    on_device = sum(o.duration_s for i, o in enumerate(trace.ops) if i not in gone)
    assert r.error is None and np.isfinite(r.time_s) and r.time_s >= on_device * (1 - 1e-9)
    assert r.peak_bytes[hw.device] <= plan.meta["planned_peak_bytes"]


# -- the coordinator walk, on random module-call sequences ------------------------------


@st.composite
def call_sequences(draw):
    from tierflow.policies.zero_infinity import Call

    n_params = draw(st.integers(1, 5))
    calls = []
    for s in range(draw(st.integers(1, 12))):
        used = draw(st.sets(st.integers(0, n_params - 1), max_size=3))
        calls.append(Call(2 * s, 2 * s + 1, {p: 2 * s for p in used}))
    numel = {p: draw(st.integers(1, 100)) for p in range(n_params)}
    knobs = [draw(st.integers(0, 300)) for _ in range(3)]
    return calls, numel, knobs


@given(call_sequences())
def test_coordinator_walk_has_every_parameter_there_for_every_call_that_uses_it(case):
    from tierflow.policies.zero_infinity import coordinator_walk

    calls, numel, (bucket, live, reuse) = case
    events = coordinator_walk(calls, numel, bucket, live, reuse)
    for s, c in enumerate(calls):
        for p in c.params:
            evs = events[p]
            kinds = [k for k, _, _ in evs]
            assert kinds == ["fetch", "release"] * (len(evs) // 2)  # alternate, all released
            # the fetch that covers call s was issued at or before it, for a call that
            # uses p, and the release that follows it is not before s
            spans = [(evs[k][1], evs[k][2], evs[k + 1][1]) for k in range(0, len(evs), 2)]
            assert sum(at <= s <= rel for at, _, rel in spans) == 1
            assert all(at <= need <= rel and p in calls[need].params for at, need, rel in spans)
    if bucket == 0 and reuse == 0:  # fetched for every call, released after it
        for p in numel:
            assert len(events.get(p, [])) == 2 * sum(p in c.params for c in calls)


def test_budget_floor_is_the_forward_and_backward_working_set(gpt, hw):
    from tierflow.policies import min_working_set

    whole, op = min_working_set(gpt)
    assert gpt.ops[op].phase == "optimizer"  # AdamW on the embedding: weight, grad, 2 moments
    fwd_bwd, op2 = min_working_set(gpt, host_optimizer=True)
    assert fwd_bwd < whole and gpt.ops[op2].phase != "optimizer"
    peak = make_plan("zero_offload", gpt, hw, **SMALL_BUCKET).meta["planned_peak_bytes"]
    assert peak < whole  # host-stepping takes it under what the device optimizer needs
    make_plan("zero_offload", gpt, hw, budget=peak, **SMALL_BUCKET)
    with pytest.raises(PlanError, match="no plan can fit"):
        make_plan("myelin", gpt, hw, budget=peak)  # a device optimizer cannot go there
    with pytest.raises(PlanError, match=rf"minimum working set is {fwd_bwd} bytes \(op {op2}\)"):
        make_plan("zero_offload", gpt, hw, budget=peak - 1, **SMALL_BUCKET)


def test_zero_offload_with_checkpoint_checks_its_checkpoint_options(flat, hw):
    with pytest.raises(PolicyError, match="impure 'skip' is not one of rerun, keep"):
        make_plan("zero_offload+checkpoint", flat, hw, always=True, impure="skip", **SMALL_BUCKET)
    few = make_plan("zero_offload+checkpoint", flat, hw, always=True, segments=4, **SMALL_BUCKET)
    assert few.recomputes == make_plan("checkpoint", flat, hw, always=True, segments=4).recomputes
    assert few.recomputes != make_plan("zero_offload+checkpoint", flat, hw, always=True, **SMALL_BUCKET).recomputes
