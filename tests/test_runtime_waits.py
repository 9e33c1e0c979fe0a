"""The host never waits for a transfer in the steady state unless the plan must: the copy
layer counts every blocking wait by reason (``run.stats.blocking_waits``)."""

from __future__ import annotations

import time

import pytest

from tierflow.runtime import roundtrip_plan, train
from tierflow.runtime.tiers import SSDStore

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def _host_only(trace, hw, budget):
    return roundtrip_plan(trace, hw, tiers=("host",))


def _ssd_only(trace, hw, budget):
    return roundtrip_plan(trace, hw, tiers=("ssd",))


def test_no_blocking_wait_when_every_transfer_fits():
    """Every keyed tensor leaves the device in each of its gaps through a host pool with
    room for all of them: thousands of copies, and the host never blocks on one."""
    res = train("gpt-tiny", budget=None, steps=6, policy=_host_only)
    s = res.stats
    assert s.planned_steps >= 3 and s.stale_plans == 0
    assert s.moved_bytes["host"] > 0 and s.planned_moves > 100
    assert s.blocking_waits == {}


def test_an_ssd_read_that_has_not_landed_is_a_counted_wait(tmp_path, monkeypatch):
    """The same plan through the SSD with a slow disk: prefetches issued one op ahead
    cannot land in time, so the ops that need them wait, and each wait is counted."""
    real = SSDStore._pread

    def slow(self, buf, off):
        time.sleep(0.005)
        return real(self, buf, off)

    monkeypatch.setattr(SSDStore, "_pread", slow)
    res = train("mlp-tiny", budget=None, steps=4, policy=_ssd_only, ssd_dir=str(tmp_path))
    s = res.stats
    assert s.moved_bytes["ssd"] > 0
    assert s.blocking_waits.get("ssd read", 0) > 0, s.blocking_waits


def test_stats_state_the_tier_buffers(tmp_path):
    res = train("mlp-tiny", budget=None, steps=3, policy=_ssd_only, ssd_dir=str(tmp_path))
    s = res.stats
    assert s.host_pool_bytes > 0 and s.ssd_file_bytes > 0 and s.ssd_bounce_bytes > 0
    assert s.pinned_bytes == 0  # CPU mode pins nothing


def test_cpu_mode_prices_each_move_and_the_probe_leaves_no_trace():
    """The CPU-mode hardware model charges each transfer the move cost measured on this
    machine (``Hardware.move_issue_s``); measuring it moves nothing the stats count."""
    import torch

    from tierflow import offload
    from tierflow.capture import zoo

    built = zoo.build("gpt-tiny", seed=0)
    net = built.model
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=False)
    x, y = built.make_batch(zoo.spec("gpt-tiny").batch, None)
    with offload(net, opt, budget=None) as run:
        for _ in range(2):
            built.loss_fn(net(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert run.hardware is not None and 0 < run.hardware.move_issue_s < 0.01
        s = run.stats
        assert s.moved_bytes.get("host", 0) == 0 and s.transfers == {} and s.moves_by_kind == {}
        # and the device count is still the sum of the resident storages the budget counts
        # (storages that died while it measured were taken off; the batch, made before
        # the block, is not the budget's)
        run._reap()
        assert run._ledger.used == sum(e.nbytes for e in run._entries.values() if e.state == "resident" and e.counted)


def test_the_move_probe_times_the_planned_path_and_puts_everything_back(monkeypatch):
    """The move cost the CPU-mode model charges is timed through the code a planned move
    takes on the lean path: the per-op move table (``Follower.fire``) and, for a prefetch,
    the queue of prefetches waiting for room (``Follower.issue_pending``); the plan's tables, its
    queue, the budget, the LRU order, the device count and the stats are as before."""
    import copy

    import torch

    from tierflow import offload
    from tierflow.capture import zoo
    from tierflow.runtime.follow import Follower

    built = zoo.build("gpt-tiny", seed=0)
    net = built.model
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=False)
    x, y = built.make_batch(zoo.spec("gpt-tiny").batch, None)
    with offload(net, opt, budget="50%") as run:
        for _ in range(3):
            built.loss_fn(net(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert run.stats.planned_steps >= 1 and run._actions
        calls = {"fire": 0, "issue_pending": 0}
        for name in calls:
            real = getattr(Follower, name)

            def counted(self, *a, _real=real, _name=name, **k):
                calls[_name] += 1
                return _real(self, *a, **k)

            monkeypatch.setattr(Follower, name, counted)
        run._reap()
        before = (run._actions, run._iter_entries, list(run._pending), run.budget, list(run._lru),
                  run._ledger.used, copy.deepcopy(run.stats))
        cost = run._probe_move_s(rounds=4, tensors=3)
        assert 0 < cost < 0.01
        assert calls["fire"] == 4 * 6 and calls["issue_pending"] >= 4 * 3
        after = (run._actions, run._iter_entries, list(run._pending), run.budget, list(run._lru),
                 run._ledger.used, run.stats)
        assert after[0] is before[0] and after[1] is before[1] and after[2:5] == before[2:5]
        assert after[5] == before[5] and after[6] == before[6]


def test_no_budget_moves_nothing_even_where_host_steps_look_faster():
    """Without a budget the iteration fits, so tierflow's plan moves nothing. The joint
    planner, left to itself (a work budget too small for the move-only pipeline to
    compete), would step the optimizer on the host for a gain CPU mode does not have."""
    import torch

    from tierflow import offload
    from tierflow.capture import zoo

    built = zoo.build("gpt-tiny", seed=0)
    net = built.model
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=False)
    x, y = built.make_batch(zoo.spec("gpt-tiny").batch, None)
    with offload(net, opt, budget=None, policy_options={"work_ops": 500}) as run:
        for _ in range(4):
            built.loss_fn(net(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert run.plan is not None and run.stats.planned_steps >= 1
        assert not run.plan.host_steps and not run.plan.recomputes and not run.plan.moves
        assert run.stats.host_steps == 0 and sum(run.stats.moved_bytes.values()) == 0
