"""The back-end's mover on its own (``Mover``, runtime/moves.py): a storage's bytes to the
host pool or the SSD file and back, through the storage table, the ledger and the tiers,
with no model, no dispatch mode and no plan. What it moved is counted in ``RunStats``,
and the bytes come back bitwise."""

from __future__ import annotations

import errno

import pytest
import torch

from tierflow.runtime.collectives import InFlight
from tierflow.runtime.errors import SSDError
from tierflow.runtime.ledger import DeviceLedger
from tierflow.runtime.moves import HomeTier, Mover
from tierflow.runtime.stats import RunStats
from tierflow.runtime.storages import AWAY, INCOMING, RESIDENT, StorageTable
from tierflow.runtime.tier_set import Tiers
from tierflow.runtime.tiers import HostPool, SSDStore

MiB = 1 << 20


def _no_home() -> HomeTier:
    def never(*_a):
        raise AssertionError("no storage here has a host step's home")
    return HomeTier(evict=never, wait=never, read=never)


def _mover(ssd_dir=None) -> tuple[Mover, StorageTable, DeviceLedger, RunStats, Tiers]:
    ssd = SSDStore(ssd_dir, 4 * MiB, 1 * MiB, workers=1, direct=False) if ssd_dir is not None else None
    tiers = Tiers(torch.device("cpu"), HostPool(4 * MiB, pin=False), ssd)
    ledger, stats = DeviceLedger(), RunStats()
    gone: list = []
    table = StorageTable(ledger, "is_cpu", gone_away=gone.append, op_now=lambda: 0)
    return Mover(tiers, ledger, table, InFlight(), stats, _no_home()), table, ledger, stats, tiers


def _activation(table: StorageTable, n: int = 1024) -> tuple[torch.Tensor, object]:
    t = torch.arange(n, dtype=torch.float32)
    e = table.entry(t, "x")
    table.label(e, "activation", "saved:0", "saved0")
    return t, e


def test_an_eviction_to_the_host_frees_the_device_bytes_and_a_fetch_brings_them_back_bitwise():
    mover, table, ledger, stats, tiers = _mover()
    t, e = _activation(table)
    want = t.clone()
    try:
        assert mover.evict(e, "host")
        assert (e.state, e.tier, t.untyped_storage().nbytes(), ledger.used) == (AWAY, "host", 0, 0)
        assert e.cdata not in table.lru  # (away: no victim for the pager)
        mover.fetch(e)
        assert e.state == RESIDENT and ledger.used == 4096 and e.cdata in table.lru
        assert torch.equal(t, want)
        assert stats.transfers == {"device->host": 4096, "host->device": 4096}
        assert stats.moves_by_kind == {"activation@host": 1}
    finally:
        tiers.close()


def test_an_ssd_write_stays_in_flight_until_reaped_and_the_read_brings_the_bytes_back(tmp_path):
    mover, table, ledger, stats, tiers = _mover(tmp_path)
    t, e = _activation(table)
    want = t.clone()
    try:
        assert mover.evict(e, "ssd")
        assert mover.writes == [e] and e.tier == "ssd"
        mover.reap(wait=True)
        assert mover.writes == [] and e.bounce == -1  # (written: the bounce slot is free)
        assert mover.prefetch(e) and e.state == INCOMING  # (a read in the background, landed by the fetch)
        mover.fetch(e)
        assert torch.equal(t, want) and ledger.used == 4096
        assert stats.moved_bytes["ssd"] == 8192
    finally:
        tiers.close()


@pytest.fixture
def full_ssd(tmp_path, monkeypatch):
    """A mover whose every SSD write fails (ENOSPC), with one activation on the device."""
    def enospc(self, buf, off):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SSDStore, "_pwrite", enospc)
    mover, table, ledger, _, tiers = _mover(tmp_path)
    t, e = _activation(table)
    yield mover, ledger, t, t.clone(), e
    tiers.close()


def test_a_failed_ssd_write_puts_the_bytes_back_and_waits_to_be_raised(full_ssd):
    """A write found failed while retired (in the middle of some op) is not raised there:
    the tensor is back on the device, bitwise, and the error waits for raise_failure
    (runtime/executor.py calls it where no op is half done), once."""
    mover, ledger, t, want, e = full_ssd
    assert mover.evict(e, "ssd")
    mover.reap(wait=True)  # (no raise here)
    assert e.state == RESIDENT and torch.equal(t, want) and ledger.used == 4096
    with pytest.raises(SSDError, match="No space left on device.*intact"):
        mover.raise_failure()
    mover.raise_failure()  # (raised once)


def test_a_fetch_of_a_failed_write_in_flight_takes_the_bytes_put_back(full_ssd):
    """A fetch that waits for its own write, which failed, finds the tensor back on the
    device: it is counted on the ledger once."""
    mover, ledger, t, want, e = full_ssd
    assert mover.evict(e, "ssd") and mover.writes == [e]
    mover.fetch(e)
    assert e.state == RESIDENT and torch.equal(t, want) and ledger.used == 4096
    assert mover.failure is not None


def test_an_ssd_eviction_without_an_ssd_tier_goes_to_the_host_and_is_counted():
    mover, table, _, stats, tiers = _mover()
    _t, e = _activation(table)
    try:
        assert mover.evict(e, "ssd")
        assert e.tier == "host" and stats.tier_fallbacks == 1
    finally:
        tiers.close()


def test_a_storage_that_died_away_gives_its_slot_back():
    mover, table, _, _, tiers = _mover()
    t, e = _activation(table)
    try:
        assert mover.evict(e, "host")
        used = tiers.host.arena.free
        mover.give_back_slots(e)
        assert tiers.host.arena.free > used
    finally:
        del t
        tiers.close()
