"""The eager runtime's profiling, plan-choice, step, machine, chunking and recompute
components on their own (docs/runtime.md, "Front-ends and back-ends"): each owns its
state and is driven here without a model (or with a two-layer one), so that a wrong
record, reason or table shows here before it shows as a wrong plan.
"""

from __future__ import annotations

import torch

from tierflow.plan import Plan, Recompute
from tierflow.runtime.host_step import follow_past_host_ops
from tierflow.runtime.kernel_times import KernelTimes
from tierflow.runtime.ledger import DeviceLedger
from tierflow.runtime.machine_model import MachineModel
from tierflow.runtime.optim_chunks import ChunkedStep
from tierflow.runtime.profile_record import ProfileRecord
from tierflow.runtime.profile_schedule import ProfileSchedule
from tierflow.runtime.recompute import Recomputer
from tierflow.runtime.stats import RunStats
from tierflow.runtime.step_clock import StepNesting
from tierflow.runtime.storages import StorageTable
from tierflow.trace import Op, TensorInfo, Trace

CPU = torch.device("cpu")


def _recorded(rec: ProfileRecord, n: int) -> None:
    for j in range(n):
        rec.add(None, f"op{j}", "forward", 0.001 * (j + 1), [j, j], [j + 1], [8, 8], [8])


def test_profile_record_leaves_out_the_hook_ops_and_maps_freed_ops_to_kept_ones():
    rec = ProfileRecord(CPU)
    rec.begin(recording=True, time_kernels=False)
    _recorded(rec, 5)
    rec.add_hook_op(1)
    rec.add_hook_op(3)
    done = rec.finish()
    assert [op[0] for op in done.ops] == ["op0", "op2", "op4"]
    assert done.kept == [0, 2, 4] and done.dropped
    assert [done.last_kept(j) for j in range(5)] == [0, 0, 1, 1, 2]
    assert [s[1] for s in done.sigs] == [[0, 0], [2, 2], [4, 4]]  # (repeats kept: bound by position)
    assert done.ops[0][3] == [0]  # (the trace's ids: each once)
    assert done.timing == "measured"


def test_profile_record_takes_kernel_times_aligned_after_the_hook_ops_are_left_out():
    class Timer:
        def stop(self, n_ops):
            return KernelTimes([10.0 + j for j in range(n_ops)], kernels=n_ops, attributed=n_ops,
                               compute_stream_total_s=1.0, compute_stream_attributed_s=1.0)

        def close(self):
            pass

    rec = ProfileRecord(CPU)
    rec.begin(recording=True, time_kernels=False)
    rec._timer = Timer()  # (the CUDA profiler, faked: the CPU has none)
    _recorded(rec, 4)
    rec.add_hook_op(2)
    done = rec.finish()
    assert [op[2] for op in done.ops] == [10.0, 11.0, 13.0]
    assert done.timing == "measured: kernel time (torch profiler)"


def test_profile_record_hands_the_held_storages_over_once():
    rec = ProfileRecord(CPU)
    rec.hold(["batch"])
    assert rec.take_held() == ["batch"] and rec.take_held() == []


def test_profile_schedule_counts_each_plan_under_the_reason_its_profile_was_made_for():
    s = ProfileSchedule()
    assert s.need_profile and s.plan_made() == "first"
    assert not s.need_profile and s.take_start_state() and not s.take_start_state()
    s.profile()  # a departure: the reason stays "departure"
    assert s.need_profile and s.plan_made() == "departure"
    s.profile("held")
    s.not_planned()  # (a chunked step to profile first: the reason is kept)
    assert s.plan_made() == "held"
    s.follow_cached()
    assert not s.need_profile and s.take_start_state()


def test_step_nesting_ends_the_step_at_the_outermost_hook_only():
    s = StepNesting()
    assert s.enter() and not s.enter() and s.in_step
    assert not s.leave() and s.leave()
    s.enter()
    s.reset()  # (a step that raised left its count behind)
    assert s.enter()
    s.ended()
    assert not s.in_step


def test_follow_past_host_ops_moves_their_moves_to_the_device_op_before():
    actions = [(), ("a",), ("b",), ("c",), ()]
    nxt, moved = follow_past_host_ops(5, frozenset({1, 2}), actions)
    assert nxt == [3, 3, 3, 4, 5]
    assert moved == [("a", "b"), (), (), ("c",), ()]
    assert actions == [(), ("a",), ("b",), ("c",), ()]  # (a new table: the given one is unchanged)


def test_machine_model_measures_the_runtime_s_costs_once():
    calls = []

    def measure():
        calls.append(1)
        return "costs"

    m = MachineModel(CPU, RunStats(), preset="h100-80g-pcie5-nvme", sync=None, tier_limits=lambda: (1 << 30, 0),
                     has_ssd=False, probe_move_s=lambda: 1e-5, measure_costs=measure)
    assert m.costs is None
    assert m.hardware(budget=1e9).name == "h100-80g-pcie5-nvme"  # (a preset: nothing measured)
    assert m.measured_costs() == "costs" and m.measured_costs() == "costs" and len(calls) == 1
    assert m.costs == "costs"


def test_chunked_step_fits_the_first_budget_only_and_only_when_installed():
    ps = [torch.nn.Parameter(torch.zeros(256)) for _ in range(4)]
    opt = torch.optim.SGD(ps, lr=0.1, foreach=True)
    ch = ChunkedStep(opt, cuda=False)
    assert not ch.fit(1000.0)  # not installed: the step is the optimizer's own
    ch.install()
    try:
        assert ch.fit(1000.0) and ch.cap == 250.0
        assert not ch.fit(10.0) and ch.cap == 250.0  # (the first budget known keeps its chunks)
        ch.leave_out({id(ps[0])})
        assert ch.skip == {id(ps[0])}
    finally:
        ch.uninstall()


def _chain_trace() -> Trace:
    # op 0 makes t1 from t0, op 1 reads t1 (its last forward use), op 2 (backward) reads t1
    tensors = (TensorInfo(0, 64, "parameter", True, "w", "param:w"), TensorInfo(1, 64, "activation", False, "a"))
    ops = (Op("mm", "forward", 1e-3, (0,), (1,)), Op("relu", "forward", 1e-3, (1,), ()),
           Op("mm_bwd", "backward", 1e-3, (1,), ()))
    return Trace(ops, tensors)


def test_recomputer_tables_drop_after_the_last_forward_use_and_remake_before_backward():
    table = StorageTable(DeviceLedger(), "is_cpu", gone_away=lambda e: None, op_now=lambda: 0)
    idle = Recomputer(table, DeviceLedger(), None, RunStats(), CPU, make_room=lambda n, keep: None,
                      ensure_resident=lambda e: None)
    plan = Plan(policy="test", budget_bytes=1e9, recomputes=(Recompute(tensors=(1,), ops=(0,), before_op=2),))
    rc = idle.for_plan(_chain_trace(), plan)
    assert rc is not idle and idle.levers_at == []  # (one per plan; the idle one keeps none)
    assert rc.chain_ops == [(0,), (), ()]
    assert rc.drops == [(), ((0, 1),), ()]
    assert rc.remakes == [(), (), (0,)]
    assert rc.levers_at == [True, True, True]


def test_plan_cache_refreshes_the_current_plan_and_keeps_its_follow_count():
    from tierflow.runtime.signatures import CachedPlan, PlanCache

    cache = PlanCache(2)
    cache.switch("a")
    cache.store("a", CachedPlan({"plan": 1}, {}))
    cache.followed("a")
    cache.refresh_current(CachedPlan({"plan": 2}, {"policy": "x"}))
    assert cache.plans["a"].state == {"plan": 2} and cache.plans["a"].followed == 1
    cache.discard_current()
    assert "a" not in cache.plans
    cache.store("b", CachedPlan({}, {}))
    cache.restart("c")
    assert not cache.plans and cache.current == "c"
