"""The plan follower on its own (``Follower``, runtime/follow.py): a per-op move table
fired against storages bound to trace ids, with the mover, the ledger and a budget, and
no model, dispatch mode or plan."""

from __future__ import annotations

import torch

from tierflow.runtime.collectives import InFlight
from tierflow.runtime.follow import Follower
from tierflow.runtime.ledger import DeviceLedger
from tierflow.runtime.moves import HomeTier, Mover
from tierflow.runtime.stats import RunStats
from tierflow.runtime.storages import AWAY, RESIDENT, StorageTable
from tierflow.runtime.tier_set import Tiers
from tierflow.runtime.tiers import HostPool

EVICT_0 = ((True, 0, None, "host", None),)  # after this op: tensor 0 to the host
FETCH_0 = ((False, 0, None, "host", None),)  # after this op: tensor 0 back


class _Setup:
    """A follower over one bound activation of 4 KiB, under a budget the test sets."""

    def __init__(self) -> None:
        self.tiers = Tiers(torch.device("cpu"), HostPool(1 << 20, pin=False), None)
        self.ledger, self.stats, self.budget = DeviceLedger(), RunStats(), float("inf")
        self.table = StorageTable(self.ledger, "is_cpu", gone_away=lambda e: None, op_now=lambda: 0)
        home = HomeTier(evict=lambda e: False, wait=lambda e: None, read=lambda e, ev: None)
        self.mover = Mover(self.tiers, self.ledger, self.table, InFlight(), self.stats, home)
        self.made_room: list[int] = []
        self.follower = Follower(self.table, self.mover, self.ledger, self.stats, room=lambda: self.budget,
                                 make_room=lambda need, keep: self.made_room.append(need),
                                 evict_beyond_plan=lambda e: self.mover.evict(e, "host"),
                                 retire_leaving=lambda *a, **k: None)
        self.x = torch.ones(1024)
        self.e = self.table.entry(self.x)
        self.table.label(self.e, "activation", "saved:0", "saved0")
        self.table.begin_iteration(recording=False, n_tensors=1)
        self.table.bind(0, self.e)


def test_the_move_table_evicts_and_prefetches_the_bound_tensor():
    s = _Setup()
    try:
        s.follower.fire([EVICT_0, FETCH_0], 0)
        assert s.e.state == AWAY and s.ledger.used == 0
        s.follower.fire([EVICT_0, FETCH_0], 1)
        assert s.e.state == RESIDENT and bool(s.x.eq(1).all())
        assert (s.stats.planned_moves, s.stats.skipped_moves, s.stats.departures) == (2, 0, {})
    finally:
        s.tiers.close()


def test_a_planned_prefetch_waits_for_room_and_never_evicts():
    s = _Setup()
    try:
        s.follower.fire([EVICT_0, FETCH_0], 0)
        s.budget = 1000.0  # (less than the tensor's 4096 bytes)
        s.follower.fire([EVICT_0, FETCH_0], 1)
        assert list(s.follower.pending) == [s.e] and s.e.state == AWAY and s.made_room == []
        s.budget = float("inf")
        s.follower.issue_pending(hints=False)
        assert not s.follower.pending and s.e.state == RESIDENT and s.stats.planned_moves == 2
    finally:
        s.tiers.close()


def test_a_hint_makes_room_like_a_fault():
    s = _Setup()
    try:
        s.follower.fire([EVICT_0, FETCH_0], 0)
        s.budget = 1000.0
        s.follower.fire([EVICT_0, FETCH_0], 1, hints=True)  # (queued: room waits for the next op)
        s.follower.issue_pending(hints=True)
        assert s.made_room == [4096] and s.e.state == RESIDENT
    finally:
        s.tiers.close()


def test_a_move_of_a_tensor_it_cannot_find_is_a_departure():
    s = _Setup()
    try:
        s.follower.fire([((True, 0, "param:missing", "host", None),)], 0)
        assert s.stats.skipped_moves == 1 and s.e.state == RESIDENT
        assert s.stats.departures == {"skipped move: a tensor the runtime did not find or cannot move": 1}
    finally:
        s.tiers.close()
