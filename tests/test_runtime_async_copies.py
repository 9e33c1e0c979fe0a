"""Copies that complete later, as on CUDA, exercised on CPU: a copy layer whose events
stay in flight for a while. The bytes of an eviction count against the budget until its
copy has read them, a copy back waits for the copy out, and training stays bitwise
equal to plain PyTorch."""

from __future__ import annotations

import pytest

from tierflow.runtime import executor, tier_set, train
from tierflow.runtime.streams import Copier

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


class _LateEvent:
    """Completes at its third ``query()`` or at ``synchronize()``."""

    def __init__(self, log: dict[str, int]):
        self.asked, self.done, self.log = 0, False, log

    def query(self) -> bool:
        self.asked += 1
        self.done = self.done or self.asked >= 3
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            self.log["synchronized"] += 1
        self.done = True


class _LateCopier(Copier):
    """Copies at once (the bytes are right) but says so late, as a side stream does."""

    log = {"copies": 0, "after": 0, "synchronized": 0}

    def copy(self, dst, src, dev_tensor, after=None):
        if after is not None:
            assert isinstance(after, _LateEvent)
            self.log["after"] += 1
        dst.copy_(src)
        self.log["copies"] += 1
        return _LateEvent(self.log)

    def wait(self, event) -> None:
        pass


@pytest.fixture
def late_copies(monkeypatch):
    _LateCopier.log = {"copies": 0, "after": 0, "synchronized": 0}
    monkeypatch.setattr(tier_set, "Copier", _LateCopier)
    enter = executor.Run.__enter__

    def entered(self):
        run = enter(self)
        self._tiers.memmove = False  # every host move through the copy layer, as on CUDA
        return run

    monkeypatch.setattr(executor.Run, "__enter__", entered)
    return _LateCopier.log


def test_late_copies_keep_parity_and_the_budget(late_copies):
    res = train("gpt-tiny", budget="50%", steps=5, check_parity=True)
    s = res.stats
    assert res.parity, res.parity_detail
    assert s.planned_steps >= 2 and s.stale_plans == 0
    assert late_copies["copies"] > 100 and late_copies["after"] > 0  # copies back named their copy out
    # the bytes still leaving counted: the accounted peak never passed the budget
    assert s.peak_device_bytes_planned <= s.budget_bytes


def test_room_still_being_copied_out_is_waited_for(late_copies):
    """Under a budget the pager's evictions are still in flight when the op that needed
    the room runs: the host waits for them, and says so."""
    res = train("gpt-tiny", budget="30%", steps=4, policy="lru", check_parity=True)
    s = res.stats
    assert res.parity, res.parity_detail
    assert s.blocking_waits.get("eviction in flight", 0) > 0, s.blocking_waits
    assert late_copies["synchronized"] > 0
    assert s.peak_device_bytes <= s.budget_bytes


def test_a_prefetch_still_in_flight_at_its_use_is_counted_late(late_copies):
    """A planned prefetch whose copy in has not landed when an op uses the tensor is a
    stall the GPU sees (the compute stream waits on it): counted by reason."""
    res = train("gpt-tiny", budget="30%", steps=5, check_parity=True)
    s = res.stats
    assert res.parity, res.parity_detail
    late = {k: v for k, v in s.departures.items() if k.startswith("late prefetch")}
    assert s.planned_steps >= 2 and sum(late.values()) > 0, s.departures


def test_room_that_copies_out_will_free_is_waited_for_without_a_victim_search(late_copies, monkeypatch):
    """Following a plan, when the bytes still being copied out cover the room an op
    needs, the host waits for those copies; the pager's victim search (a sort of every
    resident tensor by next use: hundreds of microseconds of Python) does not run, since
    it would evict nothing. On CUDA this happened at ops that evicted nothing, unseen."""
    searches = {"useless": 0, "all": 0}
    make_room = executor.Run._make_room

    def counted(self, need, keep):
        planned = self._in_iter and self._planned and not self._stale
        calls_before, ev_before = searches["all"], self.stats.unplanned_evictions
        make_room(self, need, keep)
        if planned and searches["all"] > calls_before and self.stats.unplanned_evictions == ev_before:
            searches["useless"] += 1

    victims = executor.Run._victims

    def counting(self, pinned):
        searches["all"] += 1
        return victims(self, pinned)

    monkeypatch.setattr(executor.Run, "_make_room", counted)
    monkeypatch.setattr(executor.Run, "_victims", counting)
    res = train("gpt-tiny", budget="30%", steps=5, check_parity=True)
    assert res.parity, res.parity_detail
    assert res.stats.planned_steps >= 2
    assert searches["useless"] == 0, searches
