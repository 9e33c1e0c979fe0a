"""The simulator's data-parallel model (tierflow.simulate.parallel)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from helpers import MB, chain_trace, simple_hw
from tierflow.errors import HardwareError
from tierflow.hardware import Interconnect, hardware_from_toml, load_hardware
from tierflow.policies import make_plan
from tierflow.simulate import simulate
from tierflow.simulate.parallel import (
    GATHER,
    SEND,
    DataParallel,
    rank_trace,
    ring_factor,
    ring_time,
    simulate_parallel,
)
from tierflow.synthetic import gpt_trace

A100 = "a100-40g-pcie4-nvme"


@pytest.fixture(scope="module")
def a100():
    return load_hardware(A100)


@pytest.fixture(scope="module")
def gpt(a100):
    return gpt_trace(a100)


def test_ring_formula_hand_case():
    # 4 ranks, 4 MB, 1 GB/s, 5 us a hop: all-reduce sends 2*3/4*4 MB = 6 MB over 6 hops
    assert ring_time("all_reduce", 4e6, 4, 1e9, 5e-6) == pytest.approx(6e-3 + 6 * 5e-6, rel=1e-12)
    assert ring_time("reduce_scatter", 4e6, 4, 1e9, 5e-6) == pytest.approx(3e-3 + 3 * 5e-6, rel=1e-12)
    assert ring_time("all_gather", 4e6, 4, 1e9, 5e-6) == pytest.approx(3e-3 + 3 * 5e-6, rel=1e-12)
    assert ring_time("all_reduce", 4e6, 1, 1e9, 5e-6) == 0.0


def test_simulated_all_reduce_takes_the_ring_time():
    """The one gradient's all-reduce, alone on the interconnect, lasts exactly the ring
    time, and the optimizer waits for it."""
    hw = dataclasses.replace(simple_hw(), interconnect=Interconnect("test", 1e9, 5e-6))
    dp = DataParallel.on(hw, 4, "ddp")
    tr = rank_trace(chain_trace(), dp)
    (c,) = tr.meta["collectives"]
    assert c["kind"] == "all_reduce" and c["bytes"] == 30 * MB and c["issue"] == [2, "after"]
    plan = make_plan("ideal", tr, hw)
    res = simulate_parallel(tr, hw, plan, dp)
    ((kind, nbytes, issue, _start, end),) = res.collectives
    expect = ring_time("all_reduce", 30 * MB, 4, 1e9, 5e-6)
    assert (kind, nbytes) == ("all_reduce", 30 * MB)
    assert end - issue == pytest.approx(expect, rel=1e-9)
    # nothing else to overlap with: the optimizer (op 3) stalls for the whole collective
    assert res.comm_wait_s == pytest.approx(expect, rel=1e-9)
    assert res.sim.op_stall_s[3] == pytest.approx(expect, rel=1e-9)
    assert res.time_s == pytest.approx(tr.ideal_s + expect, rel=1e-9)
    assert res.interconnect_bytes == round(1.5 * 30 * MB)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("policy", ["lru", "deepum"])
def test_one_gpu_is_the_plain_simulation(gpt, a100, strategy, policy):
    dp = DataParallel.on(a100, 1, strategy)
    tr = rank_trace(gpt, dp)
    assert tr.ops == gpt.ops and tr.tensors == gpt.tensors and tr.meta["collectives"] == []
    plain = simulate(gpt, a100, make_plan(policy, gpt, a100, budget="50%"))
    par = simulate_parallel(tr, a100, make_plan(policy, tr, a100, budget="50%"), dp)
    assert par.sim.time_s == plain.time_s and par.sim.stall_s == plain.stall_s
    assert par.sim.peak_bytes == plain.peak_bytes
    assert {k: v for k, v in par.sim.traffic_bytes.items() if k not in (SEND, GATHER)} == plain.traffic_bytes
    assert repr(par.sim.transfers) == repr(plain.transfers)  # repr: NaN for unfinished ones
    assert par.interconnect_bytes == 0 and par.collectives == [] and par.comm_wait_s == 0


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_more_gpus_never_less_interconnect_traffic(gpt, a100, strategy):
    sent, step = [], []
    for n in (1, 2, 4, 8):
        dp = DataParallel.on(a100, n, strategy)
        tr = rank_trace(gpt, dp)
        res = simulate_parallel(tr, a100, make_plan("ideal", tr, a100), dp)
        # every byte a collective of the iteration sends is on the interconnect
        expect = sum(ring_factor(c["kind"], n)[0] * c["bytes"] for c in tr.meta["collectives"])
        assert res.interconnect_bytes == pytest.approx(expect, rel=1e-6)
        sent.append(res.interconnect_bytes)
        step.append(res.time_s)
    assert sent[0] == 0 and all(a < b for a, b in zip(sent, sent[1:], strict=False))
    assert all(s >= gpt.ideal_s for s in step)


def test_fsdp_shards_state_and_gathers_parameters(gpt, a100):
    n = 4
    tr = rank_trace(gpt, DataParallel.on(a100, n, "fsdp"))
    for old in gpt.tensors:
        if old.kind in ("parameter", "optimizer_state"):
            assert tr.tensors[old.id].bytes == math.ceil(old.bytes / n)
    kinds = [c["kind"] for c in tr.meta["collectives"]]
    assert {"all_gather", "reduce_scatter"} == set(kinds)
    # every gradient is reduce-scattered once, every parameter gathered for fwd and bwd
    grad_bytes = sum(t.bytes for t in gpt.tensors if t.kind == "gradient")
    rs = sum(c["bytes"] for c in tr.meta["collectives"] if c["kind"] == "reduce_scatter")
    assert rs == grad_bytes
    # the optimizer only ever reads sharded tensors
    for o in tr.ops:
        if o.phase == "optimizer":
            for t in o.tensors:
                info = tr.tensors[t]
                if info.kind == "gradient":
                    assert info.name.endswith(".shard")
                if info.kind == "parameter":
                    assert info.bytes == math.ceil(gpt.tensors[t].bytes / n)
    # sharding lowers what the rank must hold
    assert tr.working_set_bytes.max() <= gpt.working_set_bytes.max()


def test_gradient_is_not_evicted_under_its_all_reduce():
    """A plan that evicts the gradient right after backward: the eviction waits for the
    all-reduce reading it to finish."""
    from tierflow.plan import Move

    hw = dataclasses.replace(simple_hw(), interconnect=Interconnect("test", 1e9, 0.0))
    dp = DataParallel.on(hw, 2, "ddp")
    tr = rank_trace(chain_trace(), dp)
    base = make_plan("ideal", tr, hw)
    plan = dataclasses.replace(base, moves=(Move("evict", 2, 2, "host"), Move("prefetch", 2, 2, "host", 3)))
    res = simulate_parallel(tr, hw, plan, dp)
    ((_, _, _, _, ar_end),) = res.collectives
    evicts = [r for r in res.sim.transfers if r.kind == "evict" and r.tensor == 2]
    assert evicts and all(r.issue_s >= ar_end - 1e-12 for r in evicts)


def test_interconnect_toml_round_trip_and_required_for_many_gpus():
    hw = load_hardware(A100)
    assert hw.interconnect is not None and hw.interconnect.bandwidth == 300e9
    assert hardware_from_toml(hw.to_toml()).interconnect == hw.interconnect
    bare = load_hardware("g10-a100")
    assert bare.interconnect is None
    with pytest.raises(HardwareError, match="interconnect"):
        DataParallel.on(bare, 2)
    assert DataParallel.on(bare, 1).gpus == 1
    with pytest.raises(HardwareError, match="gbps"):
        hardware_from_toml(hw.to_toml().replace("gbps = 300.0", "gbps = 0"))


def test_cli_compare_with_gpus(capsys):
    from tierflow.cli import main

    assert main(["compare", "--model", "gpt-tiny", "--batch", "2", "--hardware", A100, "--gpus", "2", "--strategy", "fsdp",
                 "--policies", "ideal", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"interconnect:send"' in out and '"interconnect:gather"' in out
