"""The tiers and the copies: evicting a storage to the host pool or the SSD file, bringing
it back (planned prefetch or on-demand fetch), and retiring what finished.

:class:`Mover` is the back-end that moves a storage's bytes and owns what is in flight;
:class:`Moves` is the eager front-end's side (a mixin of
:class:`~tierflow.runtime.executor.Run`): making room before an op within the budget,
and an op's inputs made resident (a departure from the plan counted where it was not).

An eviction copies the storage's bytes out (host pool slot, or SSD bounce slot then an
asynchronous file write) and shrinks the storage to zero bytes; a fetch grows it back
and copies the bytes in. Copies go through :class:`~tierflow.runtime.streams.Copier`
(one side stream on CUDA, at once on CPU); slots are released only when the copy that
reads them has completed (the back-end's queue, :meth:`Tiers.release_after
<tierflow.runtime.tier_set.Tiers.release_after>`), and an SSD write is retired when its future
says so (``Mover.writes``). An I/O error never loses bytes: a failed write restores the
tensor from its bounce slot, a failed read leaves it in the file.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..units import fmt_bytes
from .errors import OffloadError, SSDError
from .recompute import DROPPED
from .storages import AWAY, INCOMING, RESIDENT, _Entry, _u8
from .streams import Copier


@contextlib.contextmanager
def left_as_it_was(run: Any, names: tuple[str, ...]) -> Iterator[None]:
    """For a probe that runs scratch tensors through the run's own code: on the way out
    the attributes ``names`` are put back as they were (deleted where they did not
    exist: a plan's tables not made yet) and ``run.stats`` is restored in place (the
    user may hold it)."""
    saved_stats = copy.deepcopy(run.stats)
    kept = {k: getattr(run, k) for k in names if hasattr(run, k)}
    try:
        yield
    finally:
        for k in names:
            if k in kept:
                setattr(run, k, kept[k])
            elif hasattr(run, k):
                delattr(run, k)
        run.stats.restore(saved_stats)


@dataclass(frozen=True)
class HomeTier:
    """The host buffers of host-side optimizer steps (runtime/host_step.py) seen as one
    more tier: a host-stepped parameter's master copy, its gradient's buffer. The mover
    calls these where a storage has a home there (``_Entry.home``).

    NOTE: callbacks into the host steps, which own those buffers and their updates in
    flight; the mover never writes their state.
    """

    evict: Callable[[_Entry], bool]  # leave the device for the home (False: not synced, a real move)
    wait: Callable[[_Entry], None]  # its update in flight finished, before it comes back
    read: Callable[[_Entry, Any], None]  # the copy in from the home started (its event)


class Mover:
    """The back-end that moves storages' bytes between the device and the tiers, and the
    one writer of what it has in flight (``writes``: SSD writes not yet retired) and of
    the counters of what it moved (``RunStats``: ``transfers``, ``moved_bytes``,
    ``moves_by_kind``, ``planned_slots``, ``tier_fallbacks``, ``busy_refusals``, the
    tiers' sizes).

    It decides nothing: which storage moves, where and when is the caller's (the eager
    front-end's pager and plan follower). It changes a storage's record (``_Entry``:
    state, tier, slot, events) as the bytes go, the device bytes through the ledger, the
    LRU order through the storage table, and takes slots and copies from the tiers.

    Args:
        tiers: the host pool, the SSD file and the copier (``Tiers``).
        ledger: the device bytes accounted (``DeviceLedger``).
        storages: the storage records (``StorageTable``).
        collectives: the collectives in flight, whose pins keep a storage (``InFlight``).
        stats: the run's counters (``RunStats``).
        home: host steps' buffers as a tier (:class:`HomeTier`).

    Example:
        >>> import torch
        >>> from tierflow.runtime.collectives import InFlight
        >>> from tierflow.runtime.ledger import DeviceLedger
        >>> from tierflow.runtime.stats import RunStats
        >>> from tierflow.runtime.storages import StorageTable
        >>> from tierflow.runtime.tier_set import Tiers
        >>> from tierflow.runtime.tiers import HostPool
        >>> tiers, ledger = Tiers(torch.device("cpu"), HostPool(1 << 20, pin=False), None), DeviceLedger()
        >>> table = StorageTable(ledger, "is_cpu", gone_away=lambda e: None, op_now=lambda: 0)
        >>> home = HomeTier(evict=lambda e: False, wait=lambda e: None, read=lambda e, ev: None)
        >>> mover = Mover(tiers, ledger, table, InFlight(), RunStats(), home)
        >>> x = torch.ones(256)
        >>> e = table.entry(x)
        >>> mover.evict(e, "host"), x.untyped_storage().nbytes(), ledger.used
        (True, 0, 0)
        >>> mover.fetch(e); bool(x.eq(1).all()), ledger.used
        (True, 1024)
        >>> _peak = tiers.close()
    """

    def __init__(self, tiers: Any, ledger: Any, storages: Any, collectives: Any, stats: Any, home: HomeTier) -> None:
        self._tiers, self._ledger, self._storages = tiers, ledger, storages
        self._collectives, self._stats, self._home = collectives, stats, home
        self.writes: list[_Entry] = []  # SSD writes in flight, oldest first
        # NOTE: a failed SSD write is found when it is retired, which can be in the middle
        # of any op (the optimizer's step among them: raised there, half the parameters
        # would be updated). The tensor is back on the device by then, so the iteration
        # can finish exactly; the first failure waits here for the executor to raise it
        # where no op is half done (the iteration's end, the next forward, the block's exit).
        self.failure: SSDError | None = None

    def grow_host(self, nbytes: int) -> bool:
        """Add a chunk to the host pool for a slot of ``nbytes`` (False where the pool is
        fixed or at its limit); the stats follow the pool's size."""
        if not self._tiers.grow_host(nbytes):
            return False
        self.tiers_sized()
        return True

    def tiers_sized(self) -> None:
        """The stats of the tiers' sizes, as they are now (both may grow)."""
        sizes, st = self._tiers.sizes(), self._stats
        st.host_pool_bytes, st.ssd_file_bytes = sizes.host_pool_bytes, sizes.ssd_file_bytes
        st.pinned_bytes, st.ssd_bounce_bytes = sizes.pinned_bytes, sizes.ssd_bounce_bytes

    def evict(self, e: _Entry, tier: str, slot: int | None = None) -> bool:
        tiers = self._tiers
        st = e.ref()
        if st is None or e.state != RESIDENT or not e.resizable or e.nbytes == 0:
            return False
        if e.home is not None and self._home.evict(e):  # a host step's master copy has the bytes
            return True
        if e.pins and not self._collectives.unpin(e):
            self._stats.busy_refusals += 1
            return False
        if st.nbytes() != e.nbytes:  # resized behind our back: its owner manages it
            self._storages.make_foreign(e)
            self._storages.sync_foreign()
            return False
        n = e.nbytes
        if tier == "ssd" and tiers.ssd is None:
            tier = "host"
            self._stats.tier_fallbacks += 1
        if tier == "host":
            off = tiers.host.arena.alloc_at(slot, n) if slot is not None else None
            if off is not None:
                self._stats.planned_slots += 1
            else:
                off = tiers.host.arena.alloc(n)
            if off is None:
                self.wait_for_transfers("pool full")
                off = tiers.host.arena.alloc(n)
            if off is None and self.grow_host(n):
                off = tiers.host.arena.alloc(n)
            if off is None:
                if tiers.ssd is None:
                    pool = tiers.host
                    fix = ("pass a larger host_bytes, or an ssd_dir to spill to" if pool.fixed else
                           f"the pool may grow to {fmt_bytes(pool.limit)}, the host's available memory less "
                           "a margin: pass an ssd_dir to spill to, or a larger budget")
                    raise OffloadError(
                        f"host pool full: {e.label} needs {fmt_bytes(n)}, {fmt_bytes(pool.arena.free)} free "
                        f"of {fmt_bytes(pool.capacity)} ({fix})"
                    )
                tier = "ssd"
                self._stats.tier_fallbacks += 1
        if e.arrival is not None:  # it is still arriving: the copy out must follow the copy in
            tiers.copier.wait(e.arrival)
            e.arrival = None
        if tier == "host" and tiers.memmove:
            ctypes.memmove(tiers.host.address(off), st.data_ptr(), n)
            e.slot = off
        elif tier == "host":
            src = _u8(st, n)
            ev = e.departure = tiers.copier.copy(tiers.host.view(off, n), src, src)
            del src
            e.slot = off
        else:
            src = _u8(st, n)
            assert tiers.ssd is not None
            foff = tiers.ssd.alloc_file(n, e.label, at=slot)
            if slot is not None and foff == slot:
                self._stats.planned_slots += 1
            boff = self._bounce_alloc(n)
            ev = tiers.copier.copy(tiers.ssd.bounce_view(boff, n), src, src)
            before = (lambda ev=ev: ev.synchronize()) if ev is not None else None
            e.slot, e.bounce = foff, boff
            e.io = tiers.ssd.submit(True, boff, foff, n, before)
            self.writes.append(e)
            del src
        st.resize_(0)
        e.state, e.tier = AWAY, tier
        if tiers.memmove and tier == "host":
            self._ledger.remove(n)
        else:
            self._ledger.leave(ev, n)
        self._storages.left_device(e)
        self.count(f"device->{tier}", tier, n)
        self.count_move(e.kind, tier)
        return True

    def count_move(self, kind: str, tier: str) -> None:
        """A tensor of ``kind`` left the device for ``tier`` (``stats.moves_by_kind``)."""
        k = f"{kind}@{tier}"
        self._stats.moves_by_kind[k] = self._stats.moves_by_kind.get(k, 0) + 1

    def _bounce_alloc(self, n: int) -> int:
        tiers = self._tiers
        assert tiers.ssd is not None
        off = tiers.ssd.bounce.alloc(n)
        while off is None and self.writes:
            if not self.writes[0].io.done():
                tiers.copier.count_wait("bounce full")
            self.finish_write(self.writes[0], wait=True)
            off = tiers.ssd.bounce.alloc(n)
        if off is None:
            self.wait_for_transfers("bounce full")
            off = tiers.ssd.bounce.alloc(n)
        if off is None:
            raise OffloadError(
                f"SSD bounce buffer too small for a {fmt_bytes(n)} tensor ({fmt_bytes(tiers.ssd.bounce.capacity)}); "
                "pass a larger ssd_bytes"
            )
        return off

    def prefetch(self, e: _Entry) -> bool:
        """Start bringing ``e`` back; an SSD read proceeds in the background."""
        tiers = self._tiers
        if e.state != AWAY:
            return False
        if e.tier == "ssd" and e.bounce < 0:
            assert tiers.ssd is not None
            boff = self._bounce_alloc(e.nbytes)
            e.bounce = boff
            e.io = tiers.ssd.submit(False, boff, e.slot, e.nbytes)
            e.state = INCOMING
            return True
        self.fetch(e)
        return True

    def fetch(self, e: _Entry) -> None:
        """Bring ``e`` back to the device now (an SSD read in flight is waited for)."""
        tiers = self._tiers
        st = e.ref()
        n = e.nbytes
        if st is None:
            return
        if st.nbytes() != 0:  # its owner grew it again while it was away: the bytes are theirs now
            self._drop_away(e, st)
            return
        if e.tier == "host" and tiers.memmove:
            st.resize_(n)
            ctypes.memmove(st.data_ptr(), tiers.host.address(e.slot), n)
            tiers.host.arena.release(e.slot, n)  # (the copy is done: the slot is free now)
            ev = None
        elif e.tier == "host":
            st.resize_(n)
            dst = _u8(st, n)
            # (the copy in follows the copy out: two streams, see streams.py)
            ev = tiers.copier.copy(dst, tiers.host.view(e.slot, n), dst, after=e.departure)
            e.departure = None
            tiers.release_after(ev, tiers.host.arena, e.slot, n)
        elif e.tier == "home":  # a host step's buffer (runtime/host_step.py): its update first
            self._home.wait(e)
            st.resize_(n)
            dst = _u8(st, n)
            ev = tiers.copier.copy(dst, e.home, dst)
            self._home.read(e, ev)
            e.synced = True
        else:
            assert tiers.ssd is not None
            if e.state == AWAY and e.bounce >= 0:  # the write may be in flight: its bounce has the bytes
                if e.io is not None and not e.io.done():
                    tiers.copier.count_wait("write in flight")
                self.finish_write(e, wait=True, keep_bounce=True)
                if e.state == RESIDENT:  # the write failed: finish_write put it back on the device
                    return
            elif e.state == AWAY:
                e.bounce = self._bounce_alloc(n)
                e.io = tiers.ssd.submit(False, e.bounce, e.slot, n)
            if e.io is not None:  # a read
                if not e.io.done():
                    tiers.copier.count_wait("ssd read")
                try:
                    e.io.result()
                except OSError as err:
                    e.io = None
                    tiers.ssd.bounce.release(e.bounce, n)
                    e.bounce, e.state = -1, AWAY
                    raise SSDError(f"SSD read of {e.label} ({fmt_bytes(n)}) from {tiers.ssd.path} failed: "
                                   f"{err.strerror or err}; it stays in the file") from None
                e.io = None
            st.resize_(n)
            dst = _u8(st, n)
            ev = tiers.copier.copy(dst, tiers.ssd.bounce_view(e.bounce, n), dst)
            tiers.release_after(ev, tiers.ssd.bounce, e.bounce, n)
            tiers.ssd.arena.release(e.slot, n)
            e.bounce = -1
        e.arrival = ev
        e.state, e.slot = RESIDENT, -1
        tier, e.tier = e.tier, None
        self._ledger.add(n)
        tier = "host" if tier == "home" else tier
        self.count(f"{tier}->device", tier or "host", n)
        self._storages.back_on_device(e)

    def _drop_away(self, e: _Entry, st: torch.UntypedStorage) -> None:
        """Forget the copy of an away storage that someone else re-allocated (and will
        fill): give back its slots, account it resident, never move it again."""
        self.give_back_slots(e)
        e.state, e.tier, e.slot, e.bounce = RESIDENT, None, -1, -1
        e.nbytes = int(st.nbytes())
        self._ledger.add(e.nbytes)
        self._storages.make_foreign(e)

    def finish_write(self, e: _Entry, wait: bool = False, keep_bounce: bool = False) -> None:
        """Retire an SSD write: release its bounce slot, or on failure put the tensor back
        on the device from the bounce copy and keep the :class:`SSDError` for
        :meth:`raise_failure` (the first one)."""
        tiers = self._tiers
        assert tiers.ssd is not None
        if e.io is None or (not wait and not e.io.done()):
            return
        try:
            e.io.result()
            err = None
        except OSError as x:
            err = x
        if e in self.writes:
            self.writes.remove(e)
        e.io = None
        if err is None:
            if not keep_bounce:
                tiers.ssd.bounce.release(e.bounce, e.nbytes)
                e.bounce = -1
            return
        # the write failed: nothing is lost, the bytes are still in the bounce slot
        n = e.nbytes
        tiers.ssd.arena.release(e.slot, n)
        st = e.ref()
        if st is not None:
            st.resize_(n)
            _u8(st, n).copy_(tiers.ssd.bounce_view(e.bounce, n))
            self._ledger.add(n)
            self._storages.back_on_device(e)
        tiers.ssd.bounce.release(e.bounce, n)
        e.bounce, e.slot, e.state, e.tier = -1, -1, RESIDENT, None
        if self.failure is None:
            self.failure = SSDError(
                f"SSD write of {e.label} ({fmt_bytes(n)}) to {tiers.ssd.path} failed: {err.strerror or err}; "
                "it was restored to the device, model and optimizer state are intact"
            )

    def raise_failure(self) -> None:
        """Raise the first SSD write that failed since the last call, if any (see
        :meth:`finish_write`); the caller picks a point where no op is half done."""
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure

    def drain_writes(self) -> None:
        """Retire every SSD write in flight (a failed one waits for :meth:`raise_failure`)."""
        while self.writes:
            self.finish_write(self.writes[0], wait=True)

    def count(self, direction: str, tier: str, n: int) -> None:
        st = self._stats
        st.transfers[direction] = st.transfers.get(direction, 0) + n
        st.moved_bytes[tier] = st.moved_bytes.get(tier, 0) + n

    def reap(self, wait: bool = False) -> None:
        """Retire what finished: dead storages, completed copies (slots freed), SSD
        writes (bounce freed; a failed one kept for :meth:`raise_failure`). ``wait``: block
        on copies in flight."""
        self._storages.retire_dead()
        if self._collectives.records:
            self._collectives.reap()
        if self._tiers.frees:
            self._tiers.reap_frees(wait)
        if self._ledger.leaving:
            self._ledger.retire_leaving(every=wait)
        for e in list(self.writes):
            self.finish_write(e, wait=wait)

    def drain_copies(self) -> None:
        """Wait for every copy in flight on the copier (by design: not counted as a wait)."""
        self._tiers.copier.drain()

    def wait_for_transfers(self, reason: str) -> None:
        """Block until every copy and SSD write in flight has finished (a buffer is full
        and they hold it), counting the wait if there was one."""
        if self._tiers.frees or self.writes:
            self._tiers.copier.count_wait(reason)
        self.reap(wait=True)

    def give_back_slots(self, e: _Entry) -> None:
        """Give back what an away storage holds outside the device: its SSD write is
        waited for first (its bytes are being dropped, so an error no longer matters),
        then its bounce slot and its host or SSD slot."""
        tiers = self._tiers
        if e.io is not None:
            if not e.io.done():
                tiers.copier.count_wait("write retired")
            try:
                e.io.result()
            except OSError:
                pass
            if e in self.writes:
                self.writes.remove(e)
            e.io = None
        if e.bounce >= 0 and tiers.ssd is not None:
            tiers.ssd.bounce.release(e.bounce, e.nbytes)
        if e.tier == "host":
            tiers.host.arena.release(e.slot, e.nbytes)
        elif e.tier == "home":  # (a host step's own buffer: nothing to give back)
            pass
        elif tiers.ssd is not None:
            tiers.ssd.arena.release(e.slot, e.nbytes)

class Moves:
    """Room within the budget and inputs made resident (a mixin of
    :class:`~tierflow.runtime.executor.Run`): which storages leave to make room (least
    recently used, or by the plan's next use) and when a fetch is a departure from the
    plan. The bytes move through the back-end, :class:`Mover` (``self._mover``).
    """

    def _make_room(self, need: int, keep: list[_Entry]) -> None:
        """Evict least recently used owned tensors (not those in ``keep``) until ``need``
        more bytes fit the budget. On CUDA the bytes of an eviction count until its copy
        has read them (:meth:`_leave`): victims are chosen as if they had left, then the
        host waits for the oldest copies out until ``need`` fits."""
        if not (self._in_iter and self._planned and not self._stale):
            # NOTE: until a plan keeps it free, device memory no tracked storage explains
            # (cuBLAS's workspaces made inside the block, the caching allocator's
            # rounding) is counted as it is now, so that a byte budget holds over
            # torch.cuda.max_memory_allocated from the first forward, warm-up and
            # profiled iterations included (the plan's reserve is not counted twice)
            need += max(0, self._untracked_now() - self.stats.untracked_device_bytes)
        ledger = self._ledger
        if ledger.used + need <= self.budget:
            return
        if ledger.leaving:
            self._retire_leaving()
            if ledger.used + need <= self.budget:
                return
        if self._foreign:  # storages FSDP freed still count at their old size until looked at
            self._storages.sync_foreign()
            if ledger.used + need <= self.budget:
                return
        if self._in_step and len(self.optimizer.state) != self._storages.labelled_states:
            self._label_opt_state()  # state the optimizer created in this step is evictable too
        pinned = {e.cdata for e in keep}
        if self._in_iter and self._planned and not self._stale:
            # NOTE: where the copies out still in flight will free the room, waiting for
            # them (below) is all there is to do: the victim search sorts every resident
            # tensor by next use, and ran at such ops on CUDA to evict nothing
            if ledger.used - ledger.leaving_bytes + need > self.budget:
                for e in self._victims(pinned):  # Belady: the trace's next use, furthest first
                    if ledger.used - ledger.leaving_bytes + need <= self.budget:
                        break
                    if self._evict_beyond_plan(e):
                        e.unplanned = True
                        self._depart("eviction: room an op needed beyond the plan")
        else:
            # least recently used first, found lazily: the front of the LRU order, skipping
            # what this op needs and what cannot move now
            lru, skip = self._lru, pinned
            while ledger.used - ledger.leaving_bytes + need > self.budget:
                victim = next((e for c, e in lru.items() if c not in skip), None)
                if victim is None:
                    break
                if not self._evict_beyond_plan(victim):
                    skip = skip | {victim.cdata}
        if ledger.leaving:
            self._retire_leaving(need)

    def _untracked_now(self) -> int:
        """CUDA: device bytes in use now that no tracked storage explains, above what the
        block found when it opened (bytes still leaving are out of the allocator's count
        already). 0 on CPU, where the runtime's accounting is all there is."""
        if not self._cuda:
            return 0
        return max(0, torch.cuda.memory_allocated(self.device) - self._untracked_base
                   - self._ledger.used + self._ledger.leaving_bytes)

    def _leave(self, ev: object, n: int) -> None:
        """A storage of ``n`` device bytes was shrunk while the copy ``ev`` still reads
        them. NOTE: on CUDA the caching allocator keeps the block from reuse until the
        copy's stream has passed (``record_stream``), so the bytes are still taken on
        the device: they count against the budget until the copy completes, as the
        simulator holds an eviction's bytes until it lands. (On CPU ``ev`` is None:
        the copy is done.)"""
        self._ledger.leave(ev, n)

    def _retire_leaving(self, need: int | None = None, every: bool = False) -> None:
        """Stop counting the bytes of copies out that have completed (they complete in
        order: one stream). With ``need``: block on the oldest until ``need`` more bytes
        fit the budget (each such wait is counted); ``every``: on all of them."""
        self._ledger.retire_leaving(need, self.budget, every=every, on_wait=self._eviction_wait)

    def _eviction_wait(self) -> None:
        self._tiers.copier.count_wait("eviction in flight")

    def _evict_beyond_plan(self, e: _Entry) -> bool:
        """Evict ``e`` to the host where no plan said so (room an op or a prefetch
        needs), counted (``stats.unplanned_evictions``); False where it cannot move."""
        if not self._mover.evict(e, "host"):
            return False
        self.stats.unplanned_evictions += 1
        return True

    def _ensure_resident(self, e: _Entry) -> None:
        if e.state is DROPPED:  # dropped for recompute: its chain runs now
            self._recomputer.remake_entry(e)
            return
        if e.state != RESIDENT:
            # an SSD read that already landed in its bounce slot is a prefetch that worked
            landed = e.state == INCOMING and e.io is not None and e.io.done()
            if not landed and self._in_iter and self._planned and not self._stale:
                self._depart("on-demand fetch: " + (
                    "its planned prefetch waited for room" if e in self._pending else
                    "evicted beyond the plan" if e.unplanned else
                    "its planned read from the SSD had not landed" if e.state == INCOMING else
                    "away with no prefetch issued before this use"))
            e.unplanned = False
            t0 = time.perf_counter()
            self._mover.fetch(e)
            if not landed:
                self.stats.stalls += 1
                self.stats.stall_s += time.perf_counter() - t0
        if e.arrival is not None:
            # CUDA: the compute stream waits for the copy in (no host wait); a copy still
            # running here is a prefetch that lands late, a stall the GPU sees
            if self._in_iter and self._planned and not self._stale and not Copier.done(e.arrival):
                self._depart("late prefetch: its copy in had not landed at its use (the GPU waits)")
            self._tiers.copier.wait(e.arrival)
            e.arrival = None

    def _retire_dead(self) -> None:
        """Forget the storages that died since (:meth:`StorageTable.retire_dead`)."""
        self._storages.retire_dead()

    def _storage_gone(self, e: _Entry) -> None:
        """A storage died while not on the device (``StorageTable``'s ``gone_away``): its
        slots go back to the tiers, or, dropped for recompute, its chain forgets it."""
        if e.state == DROPPED:  # (for recompute: no bytes anywhere)
            self._recomputer.forget(e.cdata)
        else:
            self._mover.give_back_slots(e)

    # -- the mover's methods, for the mixins that still reach them through ``self`` ------

    def _evict(self, e: _Entry, tier: str, slot: int | None = None) -> bool:
        """:meth:`Mover.evict`."""
        return self._mover.evict(e, tier, slot)

    def _fetch(self, e: _Entry) -> None:
        """:meth:`Mover.fetch`."""
        self._mover.fetch(e)

    def _reap(self, wait: bool = False) -> None:
        """:meth:`Mover.reap`."""
        self._mover.reap(wait)

    def _give_back_slots(self, e: _Entry) -> None:
        """:meth:`Mover.give_back_slots`."""
        self._mover.give_back_slots(e)

    def _count(self, direction: str, tier: str, n: int) -> None:
        """:meth:`Mover.count`."""
        self._mover.count(direction, tier, n)

    def _count_move(self, kind: str, tier: str) -> None:
        """:meth:`Mover.count_move`."""
        self._mover.count_move(kind, tier)
