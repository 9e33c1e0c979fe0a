"""The runtime's components on their own: the device ledger, the tiers (and the compiled
front-end's back-end over them), the collectives in flight, the op facts.

Each owns its state (docs/runtime.md, "Front-ends and back-ends"); these tests drive them
without a model, so a wrong count shows here before it shows as a budget overshoot.
"""

from __future__ import annotations

import pytest
import torch

from tierflow.runtime.backend import Backend
from tierflow.runtime.collectives import InFlight
from tierflow.runtime.errors import OffloadError
from tierflow.runtime.ledger import DeviceLedger
from tierflow.runtime.opfacts import OpFacts
from tierflow.runtime.storages import _Entry
from tierflow.runtime.tier_set import Tiers
from tierflow.runtime.tiers import HostPool

MiB = 1 << 20


class _Event:
    """A copy's event (CUDA's ``torch.cuda.Event``) that completes when told to."""

    def __init__(self) -> None:
        self.done = False
        self.synchronized = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized = self.done = True


def test_ledger_counts_bytes_leaving_until_their_copy_completes():
    led = DeviceLedger()
    led.add(300)
    first, second = _Event(), _Event()
    led.leave(first, 100)
    led.leave(second, 50)
    assert (led.used, led.leaving_bytes) == (300, 150)
    first.done = True
    led.retire_leaving()  # (only what completed: the second still runs)
    assert (led.used, led.leaving_bytes, len(led.leaving)) == (200, 50, 1)
    assert not second.synchronized


def test_ledger_waits_for_copies_out_only_until_the_room_fits():
    led = DeviceLedger()
    led.add(300)
    events = [_Event() for _ in range(3)]
    for ev in events:
        led.leave(ev, 100)
    waits = []
    led.retire_leaving(need=50, budget=250, on_wait=lambda: waits.append(1))
    # 300 + 50 > 250: one wait (300 - 100 + 50 fits); the other two copies still run
    assert led.used == 200 and len(waits) == 1
    assert [ev.synchronized for ev in events] == [True, False, False]


def test_ledger_leave_without_an_event_frees_at_once_and_the_peak_holds():
    led = DeviceLedger()
    led.add(100)
    led.note_peak(extra=40)  # (a replay's temporaries beside what is resident)
    led.leave(None, 60)
    assert (led.used, led.peak, led.leaving_bytes) == (40, 140, 0)
    with led.peak_kept():
        led.add(500)
        led.note_peak()
    assert led.peak == 140
    led.start_peak()
    assert led.peak == 540
    led.clear_peak()
    assert led.peak == 0


def test_tiers_release_a_slot_only_after_its_copy_has_read_it():
    tiers = Tiers(torch.device("cpu"), HostPool(4 * MiB, pin=False), None)
    try:
        assert tiers.grow_host(4096)
        off = tiers.host.arena.alloc(4096)
        ev = _Event()
        tiers.release_after(ev, tiers.host.arena, off, 4096)
        tiers.reap_frees()
        assert tiers.usage()["host"] == 4096  # (the copy still reads it)
        ev.done = True
        tiers.reap_frees()
        assert tiers.usage()["host"] == 0 and not tiers.frees
    finally:
        tiers.close()


def test_tiers_sizes_follow_the_pool_as_it_grows():
    tiers = Tiers(torch.device("cpu"), HostPool(8 * MiB, pin=False), None)
    try:
        assert tiers.sizes().host_pool_bytes == 0
        assert tiers.grow_host(MiB)
        s = tiers.sizes()
        assert s.host_pool_bytes >= MiB and s.pinned_bytes == 0 and s.ssd_file_bytes == s.ssd_bounce_bytes == 0
    finally:
        tiers.close()


def test_tiers_agree_limits_takes_the_smallest_rank_s():
    tiers = Tiers(torch.device("cpu"), HostPool(8 * MiB, pin=False), None)
    try:
        assert tiers.agree_limits(None) == (8 * MiB, 0)
        assert tiers.agree_limits(lambda x: min(x, 2 * MiB)) == (2 * MiB, 0)
        assert tiers.host.limit == 2 * MiB
    finally:
        tiers.close()


class _RecordingCopier:
    """The copier's calling convention, copying at once and handing out an event per
    copy; it notes each copy's ``after``."""

    def __init__(self) -> None:
        self.afters: list = []
        self.waited: list = []

    def copy(self, dst, src, dev_tensor, after=None):
        dst.copy_(src)
        self.afters.append(after)
        return _Event()

    def wait(self, event) -> None:
        self.waited.append(event)


def test_backend_buffers_are_arena_slots_of_the_tiers_host_pool():
    tiers = Tiers(torch.device("cpu"), HostPool(8 * MiB, pin=False), None)
    try:
        be = Backend(torch.device("cpu"), tiers)
        x = torch.randn(100, 3)
        back = be.take(be.put(1, x))
        assert torch.equal(back, x) and tiers.usage()["host"] == 4096  # (one page: the arena's unit)
        be.take(be.put(1, x))  # the slot's buffer again: the arena gives nothing more
        assert tiers.usage()["host"] == 4096 == be.stats.host_bytes
    finally:
        tiers.close()


def test_backend_reuses_a_buffer_only_after_the_copy_back_that_read_it():
    tiers = Tiers(torch.device("cpu"), HostPool(8 * MiB, pin=False), None)
    try:
        tiers.copier = copier = _RecordingCopier()
        be = Backend(torch.device("cpu"), tiers)
        ticket = be.put(0, torch.ones(8))
        assert copier.afters == [None]  # a new buffer: nothing to wait for
        copy_out = be._tickets[ticket].event
        be.start(ticket)
        assert copy_out is not None and copier.afters[1] is copy_out  # the copy back waits for it
        read = be._arriving[ticket].event
        be.put(0, torch.zeros(8))  # the same slot's buffer, while the copy back may read it
        assert copier.afters[2] is read
        assert be.finish(ticket).sum().item() == 8.0 and copier.waited == [read]
    finally:
        tiers.close()


def test_backend_refuses_a_slot_a_full_fixed_pool_cannot_hold():
    tiers = Tiers(torch.device("cpu"), HostPool(4096, pin=False, fixed=True), None)
    try:
        be = Backend(torch.device("cpu"), tiers)
        with pytest.raises(OffloadError, match="host pool full"):
            be.put(0, torch.ones(2048))  # 8 KiB
        assert be.outstanding() == 0 and be.stats.offloads == 0
    finally:
        tiers.close()


def test_op_facts_keep_only_renumbers_the_kept_ops():
    facts = OpFacts()
    a = torch.ones(2)
    facts.note(0, "m.0", torch.ops.aten.add.Tensor, (a, a), {}, lambda t: 0)
    facts.note(1, "m.1", torch.ops.aten.add_.Tensor, (a, a), {}, lambda t: 0)  # writes tensor 0
    facts.note(2, "m.2", torch.ops.aten.mul.Tensor, (a, a), {}, lambda t: 0)
    facts.keep_only([0, 2])
    ops = [("add", "forward", 0.0, [0], [1]), ("mul", "forward", 0.0, [1], [2])]
    assert facts.ops_facts(ops, ["input", "temporary", "temporary"]) == [("m.0", False, True), ("m.2", False, True)]


class _Work:
    """A collective's ``Work`` that completes when told to."""

    def __init__(self) -> None:
        self.completed = False
        self.waited = False

    def is_completed(self) -> bool:
        return self.completed

    def wait(self) -> None:
        self.waited = self.completed = True


def _entries(n: int) -> list[_Entry]:
    return [_Entry(k, 64, lambda: None, name=f"t{k}") for k in range(n)]


def test_in_flight_unpins_when_the_collective_completes():
    flight, (a, b) = InFlight(), _entries(2)
    work = _Work()
    flight.pin([work], [a, b], [b])
    assert (a.pins, b.pins) == (1, 1)
    flight.reap()
    assert a.pins == 1 and len(flight.records) == 1
    work.completed = True
    flight.reap()
    assert (a.pins, b.pins) == (0, 0) and not flight.records and not work.waited


def test_in_flight_waits_for_a_collective_whose_result_was_used():
    flight, (a, b) = InFlight(), _entries(2)
    work = _Work()
    records = flight.records
    flight.pin([work], [a, b], [b])
    assert not flight.unpin(a)  # (not used since: the collective may still be reading it)
    a.touched = True
    assert flight.unpin(a) and work.waited
    assert flight.records is records and not records  # (changed in place: the executor holds the list)


def test_step_clock_reports_the_planned_steps_mean_once_there_is_one(monkeypatch):
    from tierflow.runtime import step_clock
    from tierflow.runtime.stats import RunStats

    now = iter([0.0, 0.0, 3.0, 10.0, 10.0, 11.0, 20.0, 20.0, 22.0])  # start, wall(), stop per step
    monkeypatch.setattr(step_clock.time, "perf_counter", lambda: next(now))
    st = RunStats()
    clock = step_clock.StepClock(torch.device("cpu"), st)
    for kind in ("other", "planned", "planned"):
        clock.start()
        clock.wall()
        clock.stop(kind)
    assert st.step_times_s == [3.0, 1.0, 2.0]
    assert st.step_time_s == 1.5  # the profiled step's 3 s is left out once planned steps exist
