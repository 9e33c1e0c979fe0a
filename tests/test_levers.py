"""Recompute and host steps: the validator's checks and the simulator's semantics.

Random plans come from rules in ``helpers`` (single-op or two-op chains over a tensor's
last gap, one host step per parameter), so they are valid by construction; the
validator and the simulator are then checked against each other and against sums
computed here.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import (
    chain_made,
    chain_reads,
    host_hw,
    host_steps_of,
    lever_trace,
    lever_traces,
    pick_recomputes,
    recompute_candidates,
    simple_hw,
)
from test_simulator_properties import check_invariants
from tierflow import Plan, validate
from tierflow.errors import PlanError, SimulationError
from tierflow.plan import HostStep, Recompute
from tierflow.policies import policy_names
from tierflow.simulate import simulate


def small() -> tuple:
    """Three layers of 10 MB tensors, 5 ms ops; layer 1's activation draws random numbers."""
    tr = lever_trace(3, [10] * 20, [5] * 13, frozenset({1}))
    return tr, host_hw()


def _plan(tr, hw, recomputes=(), host_steps=(), **kw) -> Plan:
    return Plan("t", budget_bytes=kw.pop("budget", hw.device_capacity), recomputes=tuple(recomputes),
                host_steps=tuple(host_steps), **kw)


def _op(tr, name: str) -> int:
    return next(i for i, o in enumerate(tr.ops) if o.name == name)


def _tensor(tr, name: str) -> int:
    return next(t.id for t in tr.tensors if t.name == name)


# -- the validator ------------------------------------------------------------------


def test_recompute_frees_the_dropped_span():
    tr, hw = small()
    h0 = _tensor(tr, "h0")
    r = Recompute((h0,), (_op(tr, "lin0"),), _op(tr, "bwd0"))
    base = validate(_plan(tr, hw), tr, hw).tier_bytes["gpu"]
    got = validate(_plan(tr, hw, [r]), tr, hw).tier_bytes["gpu"]
    last_before = _op(tr, "act0")  # h0's last use before bwd0
    diff = base - got
    assert (diff[last_before + 1 : r.before_op] == tr.sizes[h0]).all()
    assert (diff[: last_before + 1] == 0).all() and (diff[r.before_op :] == 0).all()


def test_rejects_a_chain_with_a_missing_input():
    tr, hw = small()
    # re-running act1 needs h1, which another recompute has dropped until bwd1 (later than bwd0? no:
    # bwd1 runs before bwd0): drop h1 until bwd1 and make y1 before bwd2 from h1
    h1, y1 = _tensor(tr, "h1"), _tensor(tr, "y1")
    drop_h1 = Recompute((h1,), (_op(tr, "lin1"),), _op(tr, "bwd1"))
    make_y1 = Recompute((y1,), (_op(tr, "act1"),), _op(tr, "bwd2"))
    with pytest.raises(PlanError, match=rf"recompute 1 .*reads tensor {h1}, which recompute 0 has dropped"):
        validate(_plan(tr, hw, [drop_h1, make_y1]), tr, hw)


def test_rejects_a_chain_op_that_does_not_run_before_its_op():
    tr, hw = small()
    h0 = _tensor(tr, "h0")
    late = Recompute((h0,), (_op(tr, "lin0"),), _op(tr, "lin0"))
    with pytest.raises(PlanError, match=r"recompute 0 .*does not run before op 0"):
        validate(_plan(tr, hw, [late]), tr, hw)


def test_rejects_an_rng_op_without_restore_rng():
    tr, hw = small()
    y1 = _tensor(tr, "y1")
    r = Recompute((y1,), (_op(tr, "act1"),), _op(tr, "bwd2"), restore_rng=False)
    with pytest.raises(PlanError, match=rf"recompute 0 .*op {_op(tr, 'act1')} \(act1\) draws random numbers"):
        validate(_plan(tr, hw, [r]), tr, hw)
    validate(_plan(tr, hw, [dataclasses.replace(r, restore_rng=True)]), tr, hw)


def test_rejects_a_backward_op_in_a_chain_and_a_tensor_the_chain_does_not_make():
    tr, hw = small()
    h0 = _tensor(tr, "h0")
    with pytest.raises(PlanError, match="only forward ops are re-run"):
        validate(_plan(tr, hw, [Recompute((h0,), (_op(tr, "bwd1"),), _op(tr, "bwd0"))]), tr, hw)
    with pytest.raises(PlanError, match="not made"):
        validate(_plan(tr, hw, [Recompute((h0,), (_op(tr, "act0"),), _op(tr, "bwd0"))]), tr, hw)


def test_rejects_an_impure_op_unless_the_plan_says_it_reruns_them():
    tr, hw = small()
    ops = list(tr.ops)
    lin0 = _op(tr, "lin0")
    ops[lin0] = dataclasses.replace(ops[lin0], pure=False)
    tr = dataclasses.replace(tr, ops=tuple(ops))
    r = Recompute((_tensor(tr, "h0"),), (lin0,), _op(tr, "bwd0"))
    with pytest.raises(PlanError, match="not pure"):
        validate(_plan(tr, hw, [r]), tr, hw)
    validate(_plan(tr, hw, [r], meta={"impure_reruns": 1}), tr, hw)


def test_rejects_a_move_in_the_dropped_span():
    from tierflow import Move

    tr, hw = small()
    h0 = _tensor(tr, "h0")
    r = Recompute((h0,), (_op(tr, "lin0"),), _op(tr, "bwd0"))
    moves = [Move("evict", h0, _op(tr, "act0"), "host"), Move("prefetch", h0, _op(tr, "bwd1"), "host", r.before_op)]
    with pytest.raises(PlanError, match=r"move 0 .*dropped"):
        validate(_plan(tr, hw, [r], moves=moves), tr, hw)


def test_a_chain_holds_its_inputs_until_it_runs():
    tr, hw = small()
    # make y0 again (from h0) before bwd1, whose own reads do not include h0: h0 is
    # then held on the device until bwd1 instead of dying at bwd0
    y0, h0 = _tensor(tr, "y0"), _tensor(tr, "h0")
    b = _op(tr, "bwd1")
    r = Recompute((y0,), (_op(tr, "act0"),), b)
    got = validate(_plan(tr, hw, [r]), tr, hw).tier_bytes["gpu"]
    base = validate(_plan(tr, hw), tr, hw).tier_bytes["gpu"]
    assert int(tr.death[h0]) >= b  # (h0 lives until bwd0, after bwd1: nothing to hold)
    assert got[b] == base[b]


def test_rejects_a_host_step_on_a_non_parameter():
    tr, hw = small()
    hs = host_steps_of(tr)[0]
    with pytest.raises(PlanError, match=r"host step 0 .*field 'param'.*not a persistent parameter"):
        validate(_plan(tr, hw, host_steps=[dataclasses.replace(hs, param=hs.state[0])]), tr, hw)
    with pytest.raises(PlanError, match=r"host step 0 .*field 'grad'"):
        validate(_plan(tr, hw, host_steps=[dataclasses.replace(hs, grad=hs.param)]), tr, hw)
    with pytest.raises(PlanError, match=r"host step 0 .*field 'tier'"):
        validate(_plan(tr, hw, host_steps=[dataclasses.replace(hs, tier="gpu")]), tr, hw)


def test_rejects_host_step_ops_that_are_not_exactly_its_optimizer_ops():
    tr, hw = small()
    hs = host_steps_of(tr)[0]
    with pytest.raises(PlanError, match=r"field 'ops' must hold every optimizer op touching its tensors.*is missing"):
        validate(_plan(tr, hw, host_steps=[dataclasses.replace(hs, ops=())]), tr, hw)
    with pytest.raises(PlanError, match=r"field 'ops'"):
        validate(_plan(tr, hw, host_steps=[dataclasses.replace(hs, ops=hs.ops + (0,))]), tr, hw)


def _adam_like() -> tuple:
    """One weight whose update is three optimizer ops: ``sqrt(m) -> a``, ``a / 2 -> b``
    (temporaries only) and ``w -= g / b`` (in place on w and m)."""
    from tierflow import Op, TensorInfo, Trace

    mb = 1_000_000
    ts = [TensorInfo(0, mb, "parameter", True, "w"), TensorInfo(1, mb, "optimizer_state", True, "m"),
          TensorInfo(2, mb, "input"), TensorInfo(3, mb, "activation"), TensorInfo(4, mb, "gradient"),
          TensorInfo(5, mb, "temporary", name="a"), TensorInfo(6, mb, "temporary", name="b")]
    ops = [Op("fwd", "forward", 1e-3, (2, 0), (3,)), Op("bwd", "backward", 1e-3, (3, 2, 0), (4,)),
           Op("sqrt", "optimizer", 1e-3, (1,), (5,)), Op("div", "optimizer", 1e-3, (5,), (6,)),
           Op("upd", "optimizer", 1e-3, (0, 4, 6, 1), (0, 1))]
    return Trace(ops, ts, "adam-like"), host_hw()


def test_a_host_step_may_hold_the_updates_arithmetic_on_temporaries():
    tr, hw = _adam_like()
    step = HostStep(0, 4, (1,), (2, 3, 4))
    res = validate(_plan(tr, hw, host_steps=[step]), tr, hw)
    # during the optimizer ops only the weight is on the device: the gradient has gone
    # home, the state lives there, the temporaries are the host's
    assert (res.tier_bytes["gpu"][2:] == tr.sizes[0]).all()
    r = simulate(tr, hw, _plan(tr, hw, host_steps=[step]))
    assert r.error is None and math.isclose(r.host_op_s, 3e-3)
    # without the temporaries' op, tensor 5 (made on the host) would be read on the device
    with pytest.raises(PlanError, match=r"touches tensor 5 \(a\), which op 3 \(div\) also uses on the device"):
        validate(_plan(tr, hw, host_steps=[HostStep(0, 4, (1,), (2, 4))]), tr, hw)


def test_rejects_a_shared_optimizer_op_when_not_all_its_params_are_host_stepped():
    tr, hw = small()
    # one foreach op updating every weight
    opt = [i for i, o in enumerate(tr.ops) if o.phase == "optimizer"]
    ins = tuple(t for i in opt for t in tr.ops[i].inputs)
    outs = tuple(t for i in opt for t in tr.ops[i].outputs)
    fused = dataclasses.replace(tr.ops[opt[0]], name="foreach_step", inputs=ins, outputs=outs)
    tr = dataclasses.replace(tr, ops=tr.ops[: opt[0]] + (fused,))
    steps = host_steps_of(tr)  # none: each op is not one parameter's
    assert steps == []
    params = [t for t in ins if tr.tensors[t].kind == "parameter"]
    mk = []
    for p in params:
        g = next(t for t in ins if tr.tensors[t].kind == "gradient" and tr.tensors[t].name == "g" + tr.tensors[p].name[1:])
        m = next(t for t in ins if tr.tensors[t].name == "m" + tr.tensors[p].name[1:])
        mk.append(HostStep(p, g, (m,), (opt[0],)))
    validate(_plan(tr, hw, host_steps=mk), tr, hw)
    with pytest.raises(PlanError, match="host-stepped only if all of its parameters are"):
        validate(_plan(tr, hw, host_steps=mk[:1]), tr, hw)


def test_rejects_a_move_of_host_stepped_state():
    from tierflow import Move

    tr, hw = small()
    hs = host_steps_of(tr)[0]
    with pytest.raises(PlanError, match=r"move 0 .*state of host step 0"):
        validate(_plan(tr, hw, host_steps=[hs], moves=[Move("evict", hs.state[0], 0, "host")]), tr, hw)


def test_host_step_bytes_count_on_the_host_tier():
    tr, hw = small()
    steps = host_steps_of(tr)
    res = validate(_plan(tr, hw, host_steps=steps), tr, hw)
    held = sum(int(tr.sizes[h.param] + tr.sizes[h.grad] + sum(tr.sizes[list(h.state)])) for h in steps)
    assert (res.tier_bytes["host"] == held).all()
    assert res.tier_bytes["gpu"].max() < validate(_plan(tr, hw), tr, hw).tier_bytes["gpu"].max()
    tight = hw.with_tier("host", capacity=float(held - 1))
    with pytest.raises(PlanError, match="tier host over capacity"):
        validate(_plan(tr, tight, host_steps=steps), tr, tight)


def test_reactive_plans_may_not_use_the_levers():
    tr, hw = small()
    with pytest.raises(PlanError, match="only a planned plan"):
        validate(_plan(tr, hw, host_steps=host_steps_of(tr), reactive=True), tr, hw)


def test_plan_round_trips_and_counts():
    tr, hw = small()
    plan = _plan(tr, hw, recompute_candidates(tr)[:1], host_steps_of(tr))
    again = Plan.from_dict(plan.to_dict())
    assert again.recomputes == plan.recomputes and again.host_steps == plan.host_steps
    assert plan.count("recomputed") == 1 and plan.count("host_step") == 3


# -- the simulator ------------------------------------------------------------------


def test_recompute_costs_its_ops_time_and_saves_its_bytes():
    tr, hw = small()
    r = Recompute((_tensor(tr, "h0"),), (_op(tr, "lin0"),), _op(tr, "bwd0"))
    res = simulate(tr, hw, _plan(tr, hw, [r]))
    assert res.recompute_s == tr.ops[r.ops[0]].duration_s and res.recompute_ops == 1
    assert math.isclose(res.time_s, tr.ideal_s + res.recompute_s)
    assert res.peak_bytes["gpu"] == tr.peak_live_bytes - tr.sizes[r.tensors[0]]
    (rec,) = res.recomputes
    assert rec.before_op == r.before_op and math.isclose(res.op_start_s[r.before_op], rec.end_s)


def test_host_steps_take_optimizer_ops_off_the_stream():
    tr, hw = small()
    steps = host_steps_of(tr)
    res = simulate(tr, hw, _plan(tr, hw, host_steps=steps))
    opt = sum(o.duration_s for o in tr.ops if o.phase == "optimizer")
    assert math.isclose(res.host_op_s, opt)
    rate = hw.host_compute.optimizer_bytes_per_s
    assert math.isclose(res.host_step_s, sum(int(tr.sizes[h.param] + tr.sizes[h.grad] + tr.sizes[h.state[0]])
                                             for h in steps) / rate)
    assert math.isclose(res.time_s, tr.ideal_s + res.stall_s - opt)
    # every host update starts after its gradient landed, one at a time
    for a, b in zip(res.host_steps, res.host_steps[1:]):
        assert b.start_s >= a.end_s - 1e-12
    kinds = {t.kind for t in res.transfers}
    assert {"host_grad", "host_param"} <= kinds
    # the state never reaches the device; the host holds state, gradient buffers and
    # master copies, as the validator counts them
    assert res.peak_bytes["gpu"] <= tr.peak_live_bytes - sum(int(tr.sizes[h.state[0]]) for h in steps)
    planned = validate(_plan(tr, hw, host_steps=steps), tr, hw).tier_bytes["host"]
    assert res.peak_bytes["host"] == planned.max() == planned.min()


def test_a_parameter_use_waits_for_its_update():
    tr, hw = small()
    slow = dataclasses.replace(hw, host_compute=dataclasses.replace(hw.host_compute, optimizer_bytes_per_s=1e8))
    steps = host_steps_of(tr)
    res = simulate(tr, slow, _plan(tr, slow, host_steps=steps))
    w0 = _tensor(tr, "w0")
    back = [t for t in res.transfers if t.kind == "host_param" and t.tensor == w0]
    assert back and res.op_start_s[_op(tr, "lin0")] >= back[0].end_s - 1e-12
    assert res.stall_s > 0.1  # 30 MB at 0.1 GB/s per update, three in a row


def test_host_steps_need_a_host_compute_model():
    tr, _ = small()
    hw = dataclasses.replace(simple_hw(), host_compute=None)
    with pytest.raises(SimulationError, match="no host compute model"):
        simulate(tr, hw, _plan(tr, hw, host_steps=host_steps_of(tr)))


def test_pooled_and_parallel_refuse_the_levers():
    from tierflow.simulate.parallel import DataParallel, rank_trace, simulate_parallel
    from tierflow.simulate.pooled import simulate_pooled

    tr, hw = small()
    plan = _plan(tr, hw, recompute_candidates(tr)[:1])
    with pytest.raises(SimulationError, match="pool"):
        simulate_pooled(tr, hw, plan, pool="greedy")
    dp = DataParallel.on(hw, 2)
    with pytest.raises(SimulationError, match="data-parallel"):
        simulate_parallel(rank_trace(tr, dp), hw, plan, dp)


def test_a_chain_that_cannot_fit_fails_clearly():
    from tierflow import Op, TensorInfo, Trace

    mb = 1_000_000
    ts = [TensorInfo(0, 10 * mb, "input"), TensorInfo(1, 300 * mb, "temporary"),
          TensorInfo(2, 10 * mb, "activation"), TensorInfo(3, 10 * mb, "activation")]
    ops = [Op("f1", "forward", 1e-3, (0,), (1,)), Op("f2", "forward", 1e-3, (1,), (2,)),
           Op("gap", "forward", 1e-3, (0,), (3,)), Op("bwd", "backward", 1e-3, (2, 3, 0), ())]
    tr = Trace(ops, ts, "wide-chain")
    hw = simple_hw()
    # re-making tensor 2 needs its input, the 300 MB temporary and itself at once (320
    # MB), beside tensor 3, live there: 330 MB planned
    r = Recompute((2,), (0, 1), 3)
    assert simulate(tr, hw, _plan(tr, hw, [r], budget=330 * mb)).fits
    with pytest.raises(PlanError, match=r"recompute 0 \(before op 3\): tier gpu over capacity while the chain runs"):
        validate(_plan(tr, hw, [r], budget=325 * mb), tr, hw)
    # unvalidated, the simulator evicts tensor 3 to make room, but cannot go below 320 MB
    assert simulate(tr, hw, _plan(tr, hw, [r], budget=325 * mb), check_plan=False).fits
    res = simulate(tr, hw, _plan(tr, hw, [r], budget=315 * mb), check_plan=False)
    assert not res.fits and "recompute 0 (before op 3)" in res.error and math.isinf(res.time_s)


def test_a_chain_lets_go_of_a_temporary_after_its_last_read():
    from tierflow import Op, TensorInfo, Trace

    mb = 1_000_000
    # the chain re-makes k1 and k2 (kept, 100 MB each) through a 300 MB temporary that
    # only its second step reads, as a block's wide intermediate: while it runs it holds
    # at most 310 MB (big and small at step 1), not all it makes (510 MB)
    ts = [TensorInfo(0, 10 * mb, "input"), TensorInfo(1, 300 * mb, "temporary"),
          TensorInfo(2, 10 * mb, "temporary"), TensorInfo(3, 100 * mb, "activation"),
          TensorInfo(4, 100 * mb, "activation"), TensorInfo(5, 10 * mb, "activation")]
    ops = [Op("f1", "forward", 1e-3, (0,), (1,)), Op("f2", "forward", 1e-3, (1,), (2,)),
           Op("f3", "forward", 1e-3, (2,), (3,)), Op("f4", "forward", 1e-3, (3,), (4,)),
           Op("gap", "forward", 1e-3, (0,), (5,)), Op("bwd", "backward", 1e-3, (3, 4, 5, 0), ())]
    tr = Trace(ops, ts, "narrowing-chain")
    hw = simple_hw()
    r = Recompute((3, 4), (0, 1, 2, 3), 5)
    # before op 5: the input and the gap's output (20 MB) beside the chain's 310 MB
    validate(_plan(tr, hw, [r], budget=330 * mb), tr, hw)
    res = simulate(tr, hw, _plan(tr, hw, [r], budget=330 * mb))
    assert res.fits and res.peak_bytes["gpu"] == 330 * mb
    with pytest.raises(PlanError, match=r"recompute 0 \(before op 5\): tier gpu over capacity while the chain runs: "
                                        r"330000000 bytes planned"):
        validate(_plan(tr, hw, [r], budget=329 * mb), tr, hw)
    from tierflow.policies._recompute import planned_device_bytes

    assert int(planned_device_bytes(tr, (r,)).max()) == 330 * mb


# -- properties ---------------------------------------------------------------------


@st.composite
def lever_cases(draw):
    tr = draw(lever_traces())
    hw = host_hw(pcie_gbps=draw(st.sampled_from([1.0, 10.0])), host_gbps=draw(st.sampled_from([0.5, 5.0, 50.0])))
    recomputes = pick_recomputes(draw, tr)
    params = {h.param for h in host_steps_of(tr) if draw(st.booleans())}
    steps = host_steps_of(tr, params)
    return tr, hw, Plan("random", recomputes=tuple(recomputes), host_steps=tuple(steps))


def _fit_budget(tr, hw, plan) -> Plan:
    """The plan with the least budget it validates at: its planned peak plus the most
    any chain adds while it runs (temporaries and what it re-creates)."""
    res = validate(plan, tr, hw)
    extra = max((int(sum(tr.sizes[list(chain_made(tr, r))])) for r in plan.recomputes), default=0)
    return dataclasses.replace(plan, budget_bytes=float(res.tier_bytes["gpu"].max() + extra))


@given(lever_cases())
def test_random_lever_plans_validate_and_recompute_only_what_is_there(case):
    tr, hw, plan = case
    plan = _fit_budget(tr, hw, plan)
    validate(plan, tr, hw)
    # every outside input of every chain is live at its op, and no recompute drops it then
    dropped = {}
    for r in plan.recomputes:
        for t in r.tensors:
            u = tr.uses(t)
            dropped[t] = (int(u[u < r.before_op].max()), r.before_op)
    for r in plan.recomputes:
        for x in chain_reads(tr, r):
            assert tr.tensors[x].persistent or int(tr.birth[x]) < r.before_op
            if x in dropped:
                d, b = dropped[x]
                assert not d < r.before_op <= b


@given(lever_cases())
def test_simulated_lever_plans_keep_invariants_and_are_deterministic(case):
    tr, hw, plan = case
    plan = _fit_budget(tr, hw, plan)
    r = simulate(tr, hw, plan)
    assert r.fits, r.error
    check_invariants(tr, hw, plan, r, levers=True)
    host_ops = {o for h in plan.host_steps for o in h.ops}
    host_op_s = math.fsum(tr.ops[o].duration_s for o in host_ops)
    recompute_s = math.fsum(tr.ops[o].duration_s for c in plan.recomputes for o in c.ops)
    assert math.isclose(r.recompute_s, recompute_s, abs_tol=1e-12)
    assert r.time_s >= tr.ideal_s + recompute_s - host_op_s - 1e-9
    again = simulate(tr, hw, plan)
    # (repr: a copy still in flight when the simulation ends has end_s nan, != itself)
    assert repr(again.to_dict()) == repr(r.to_dict()) and repr(again.transfers) == repr(r.transfers)
    assert repr(again.recomputes) == repr(r.recomputes) and repr(again.host_steps) == repr(r.host_steps)


@given(lever_cases(), st.floats(0.3, 1.0))
def test_squeezed_lever_plans_never_exceed_the_budget(case, share):
    """Below the planned peak the simulator evicts on demand; it never goes over."""
    from tierflow.policies import min_working_set

    tr, hw, plan = case
    need, _ = min_working_set(tr)
    fitted = _fit_budget(tr, hw, plan).budget_bytes
    plan = dataclasses.replace(plan, budget_bytes=float(max(need, int(fitted * share))))
    r = simulate(tr, hw, plan, check_plan=False)
    check_invariants(tr, hw, plan, r, levers=True)


def test_the_timeline_shows_recompute_and_host_work_in_their_own_colours():
    from tierflow.report.figures import HOST_COLOR, KIND_COLORS, RECOMPUTE_COLOR, timeline_figure

    tr, hw = small()
    plan = _plan(tr, hw, recompute_candidates(tr)[:1], host_steps_of(tr))
    res = simulate(tr, hw, plan)
    fig = timeline_figure(tr, hw, res)
    gantt = fig.axes[1]
    labels = [t.get_text() for t in gantt.get_legend().get_texts()]
    assert any(lb.startswith("recompute") for lb in labels)
    assert "optimizer update on the host" in labels
    assert "gradient to the host (host step)" in labels
    colours = {tuple(round(c, 3) for c in coll.get_facecolor()[0][:3]) for coll in gantt.collections}

    def rgb(hex_: str) -> tuple:
        return tuple(round(int(hex_[i : i + 2], 16) / 255, 3) for i in (1, 3, 5))

    assert {rgb(RECOMPUTE_COLOR), rgb(HOST_COLOR), rgb(KIND_COLORS["host_grad"])} <= colours


def test_cli_simulates_a_lever_plan_file(tmp_path, capsys):
    from tierflow.cli import main
    from tierflow.hardware import load_hardware

    tr, _ = small()
    hw = load_hardware("rtx4090-24g")
    tpath = tr.save(tmp_path / "t.json")
    both = _plan(tr, hw, recompute_candidates(tr)[:1], host_steps_of(tr)).save(tmp_path / "both.json")
    assert main(["simulate", str(tpath), "--hardware", "rtx4090-24g", "--plan-file", str(both)]) == 0
    out = capsys.readouterr().out
    assert "recompute" in out and "host steps" in out
    # a machine without a host compute model: one line, exit 2
    toml = hw.to_toml().split("[host_compute]")[0]
    lines = toml.splitlines()
    (tmp_path / "nohost.toml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["simulate", str(tpath), "--hardware", str(tmp_path / "nohost.toml"), "--plan-file", str(both)]) == 2
    assert "no host compute model" in capsys.readouterr().err


@pytest.mark.parametrize("name", policy_names())
@given(lever_traces(max_layers=3), st.floats(0.4, 1.0))
def test_every_plan_of_every_policy_validates_and_keeps_the_invariants(name, tr, share):
    """Every policy's plan (the move planners, and those that recompute or host-step,
    once present) on a trace with optimizer state and random numbers: it validates, and
    its simulation keeps the invariants."""
    from tierflow.policies import make_plan, min_working_set

    hw = host_hw()
    need, _ = min_working_set(tr)
    budget = max(need, int(tr.peak_live_bytes * share))
    try:
        plan = make_plan(name, tr, hw, budget=budget)
    except PlanError:
        return  # no plan fits: allowed
    validate(plan, tr, hw)
    r = simulate(tr, hw, plan)
    check_invariants(tr, hw, plan, r, levers=True)


def test_rejects_a_chain_before_a_host_stepped_op():
    from tierflow import Op, TensorInfo, Trace

    mb = 1_000_000
    ts = [TensorInfo(0, mb, "parameter", True, "w"), TensorInfo(1, mb, "optimizer_state", True, "m"),
          TensorInfo(2, mb, "activation"), TensorInfo(3, mb, "activation"), TensorInfo(4, mb, "gradient")]
    ops = [Op("f0", "forward", 1e-3, (0,), (2,)), Op("f1", "forward", 1e-3, (2,), (3,)),
           Op("bwd", "backward", 1e-3, (3, 0), (4,)), Op("step", "optimizer", 1e-3, (0, 4, 1), (0, 1)),
           Op("late", "backward", 1e-3, (2,), ())]
    tr = Trace(ops, ts, "interleaved")
    hw = host_hw()
    step = HostStep(0, 4, (1,), (3,))
    validate(_plan(tr, hw, [Recompute((2,), (0,), 4)], [step]), tr, hw)
    with pytest.raises(PlanError, match=r"recompute 0: field 'before_op' is op 3, which a host step runs"):
        validate(_plan(tr, hw, [Recompute((2,), (0,), 3)], [step]), tr, hw)


def _brute_force_peak(tr, recomputes) -> tuple[int, int]:
    """(most device bytes during an op, most during a chain) of a recompute-only plan
    without moves, tensor by tensor from the contract: a tensor is on the device from
    its birth to its death (held to the op of a chain that reads it), except from the op
    after its drop to the op before its chain; a chain holds, beside what is there, what
    earlier chains before the same op re-created and everything it makes."""
    sizes = tr.sizes
    death = {t: int(tr.death[t]) for t in range(tr.n_tensors)}
    for r in recomputes:
        for x in chain_reads(tr, r):
            if not tr.tensors[x].persistent:
                death[x] = max(death[x], r.before_op)
    spans = []
    for r in recomputes:
        for t in r.tensors:
            u = tr.uses(t)
            spans.append((t, int(u[u < r.before_op].max()), r.before_op))

    def on(t, i, before: bool) -> bool:  # during op i, or at the instant before it
        lo = int(tr.birth[t])
        if not (lo < i if before else lo <= i) or death[t] < i:
            return False
        return not any(tt == t and d < i and (i <= b if before else i < b) for tt, d, b in spans)

    ops_peak = max(sum(int(sizes[t]) for t in range(tr.n_tensors) if on(t, i, False)) for i in range(tr.n_ops))
    chain_peak = 0
    for b in {r.before_op for r in recomputes}:
        held = sum(int(sizes[t]) for t in range(tr.n_tensors) if on(t, b, True))
        for r in [r for r in recomputes if r.before_op == b]:
            chain_peak = max(chain_peak, held + int(sum(sizes[list(chain_made(tr, r))])))
            held += int(sum(sizes[list(r.tensors)]))
    return ops_peak, chain_peak


@given(lever_traces())
def test_validator_and_simulator_agree_with_the_contract_on_device_bytes(tr):
    """With no budget to enforce, the simulator's device peak and the validator's
    planned peak are what the contract says, computed here tensor by tensor."""
    recomputes = recompute_candidates(tr)
    dropped, read, chosen = set(), set(), []
    for r in recomputes:  # the non-conflicting ones, in order
        if set(r.tensors) & (dropped | read) or chain_reads(tr, r) & dropped:
            continue
        chosen.append(r)
        dropped.update(r.tensors)
        read |= chain_reads(tr, r)
    hw = simple_hw()
    plan = Plan("rc", recomputes=tuple(chosen))
    ops_peak, chain_peak = _brute_force_peak(tr, chosen)
    assert int(validate(plan, tr, hw).tier_bytes["gpu"].max()) == ops_peak
    assert simulate(tr, hw, plan).peak_bytes["gpu"] == max(ops_peak, chain_peak)


def test_the_html_report_names_recompute_and_host_work():
    from tierflow.report import build_report

    tr, hw = small()
    plain = simulate(tr, hw, _plan(tr, hw))
    levers = simulate(tr, hw, dataclasses.replace(_plan(tr, hw, recompute_candidates(tr)[:1], host_steps_of(tr)),
                                                  policy="levers"))
    page = build_report(tr, hw, [plain, levers])
    assert "optimizer on the host" in page and "ops re-run" in page


def test_an_away_parameter_is_fetched_after_its_update_with_no_copy_back():
    from tierflow import Move

    tr, hw = small()
    steps = host_steps_of(tr)
    w0 = _tensor(tr, "w0")
    last_bwd, first_fwd = _op(tr, "bwd0"), _op(tr, "lin0")
    # w0 leaves after its last backward use and is prefetched (for the next iteration's
    # first forward) right away: the prefetch must wait for w0's host update
    moves = [Move("evict", w0, last_bwd, "host"), Move("prefetch", w0, last_bwd + 1, "host", first_fwd)]
    plan = _plan(tr, hw, host_steps=steps, moves=moves)
    validate(plan, tr, hw)
    res = simulate(tr, hw, plan)
    assert res.error is None
    (update,) = [h for h in res.host_steps if h.param == w0]
    # (here the first forward op is already waiting when the update ends: the deferred
    # prefetch becomes a fault, as any prefetch still deferred when its op needs it)
    fetches = [t for t in res.transfers if t.tensor == w0 and t.kind in ("prefetch", "fault")]
    assert fetches and all(t.start_s >= update.end_s - 1e-12 for t in fetches)
    assert not [t for t in res.transfers if t.tensor == w0 and t.kind == "host_param"]
