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
