"""The runtime's storage records on their own (``StorageTable``, runtime/storages.py).

The table is the one writer of which storages exist, what each is and how many device
bytes they hold; these tests drive it without a model or a dispatch mode, so a wrong
count shows here before it shows as a budget overshoot.
"""

from __future__ import annotations

import gc

import torch

from tierflow.runtime.ledger import DeviceLedger
from tierflow.runtime.storages import AWAY, StorageTable


def _table(gone: list | None = None, op: list | None = None) -> tuple[StorageTable, DeviceLedger]:
    ledger = DeviceLedger()
    table = StorageTable(ledger, "is_cpu", gone_away=(gone if gone is not None else []).append,
                         op_now=lambda: (op or [0])[0])
    return table, ledger


def test_a_storage_is_one_record_for_all_its_views_and_counted_once():
    table, ledger = _table()
    w = torch.zeros(8)
    e = table.entry(w, "w")
    assert table.entry(w.view(2, 4)) is e and table.entry(w[3:]) is e
    assert ledger.used == 32 and list(table.entries) == [e.cdata]


def test_an_input_first_seen_is_not_the_budgets():
    table, ledger = _table()
    e = table.entry(torch.zeros(8), counted=False)
    assert not e.counted and ledger.used == 0
    table.make_counted(e)  # (the block resized it: its bytes are the budget's now)
    assert ledger.used == 32


def test_labels_keep_the_higher_rank_and_index_persistent_state_by_key():
    table, _ = _table()
    w = torch.zeros(4)
    e = table.entry(w)
    table.label(e, "parameter", "param:w", "w")
    table.label(e, "activation", "saved:0", "saved0")  # (autograd saved the parameter)
    assert (e.kind, e.key) == ("parameter", "param:w")
    assert table.by_key == {"param:w": e} and list(table.lru) == [e.cdata]


def test_a_dead_resident_storage_gives_its_bytes_back_once_retired():
    table, ledger = _table()
    t = torch.zeros(16)
    table.label(table.entry(t), "parameter", "param:t", "t")
    del t
    gc.collect()
    assert len(table.dead) == 1 and ledger.used == 64  # (reported, not yet forgotten)
    table.retire_dead()
    assert (table.entries, table.by_key, dict(table.lru), ledger.used) == ({}, {}, {}, 0)


def test_a_storage_dead_while_away_goes_to_whoever_holds_its_bytes():
    gone: list = []
    table, ledger = _table(gone)
    t = torch.zeros(16)
    e = table.entry(t)
    e.state = AWAY  # (as an eviction leaves it: its bytes in a tier, not on the device)
    ledger.remove(e.nbytes)
    del t
    gc.collect()
    table.retire_dead()
    assert gone == [e] and ledger.used == 0


def test_a_profiled_iteration_numbers_storages_by_first_use_and_notes_deaths():
    op = [5]
    table, _ = _table(op=op)
    table.begin_iteration(recording=True, n_tensors=0)
    a, b = torch.zeros(2), torch.zeros(3)
    ea, eb = table.entry(a), table.entry(b)
    assert [table.tid(eb), table.tid(ea), table.tid(eb)] == [0, 1, 0]
    del b
    gc.collect()
    table.retire_dead()
    assert table.freed_at == {0: 4}  # (found dead before op 5: alive through op 4)
    table.end_iteration()
    assert table.iter_entries == [eb, ea]  # (kept for the trace until forgotten)
    table.forget_iteration()
    assert table.iter_entries == [] and table.iter_tid == {}


def test_the_iteration_containers_are_changed_in_place_never_replaced():
    table, _ = _table()
    entries, tids = table.iter_entries, table.iter_tid
    table.begin_iteration(recording=False, n_tensors=3)
    e = table.entry(torch.zeros(1))
    table.bind(2, e)
    assert entries is table.iter_entries and entries == [None, None, e] and tids == {e.cdata: 2}
    with table.borrowed_ids([e]):
        assert table.iter_entries == [e]
    assert entries == [None, None, e]


def test_a_foreign_storage_is_accounted_at_the_size_its_owner_left():
    table, ledger = _table()
    t = torch.zeros(16)
    e = table.entry(t)
    table.label(e, "parameter", "param:t", "t")
    table.make_foreign(e)
    assert e.foreign and not e.resizable and e.cdata not in table.lru
    t.untyped_storage().resize_(0)  # (FSDP frees it)
    table.sync_foreign()
    assert (e.nbytes, e.top, ledger.used) == (0, 64, 0)
