"""Following a plan: after op ``k`` of a planned iteration, issue the plan's moves "after
op ``k``"; queue planned prefetches until they fit the budget (as simulated); choose
victims when the budget forces more (Belady on the trace's next use while a plan is
followed, least recently used otherwise); lay out the host pool and SSD file ahead of
time with the pool planner; and record why an iteration departed from the trace.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import TierflowError
from ..trace import Trace
from ..units import fmt_bytes
from . import tiers
from .errors import OffloadError
from .moves import left_as_it_was
from .storages import AWAY, OWNED, RESIDENT, _Entry


def _uncapped(hw: Any) -> Any:
    """``hw`` with its off-device tiers unbounded: what a plan keeps there is measured,
    not checked (the runtime's tiers say what they can hold)."""
    for t in hw.tiers:
        if t.name != hw.device:
            hw = hw.with_tier(t.name, capacity=float(1 << 62))
    return hw


def _runtime_tier(hw: Any, name: str | None) -> str:
    """The runtime tier (``host`` or ``ssd``) for tier ``name`` of machine model ``hw``
    (None, or a name ``hw`` has not: ``host``)."""
    if name is None or hw is None or not hw.has_tier(name):
        return "host"
    return "ssd" if hw.tier(name).kind == "ssd" else "host"


def _next_uses(uses: list[list[int]], n_ops: int, tids: list[int], persistent: list[bool],
               now: int) -> list[float]:
    """For each trace tensor id in ``tids`` (-1: not in the trace), the first op after
    ``now`` that uses it (``uses``: each tensor's ops, sorted), as a float: a persistent
    tensor unused for the rest of the iteration, its first use in the next one (``+
    n_ops``); a tensor with no use ahead or no id, infinity."""
    known, out = len(uses), []
    for t, p in zip(tids, persistent):
        u = uses[t] if 0 <= t < known else ()
        j = bisect_right(u, now)
        out.append(float(u[j]) if j < len(u) else float(u[0] + n_ops) if p and u else math.inf)
    return out


class Follower:
    """The plan follower: issues a plan's moves "after op ``k``" from its per-op table,
    queues planned prefetches until they fit the budget (as simulated), evicts gradients
    held past their last use when a prefetch needs their room, and counts how an
    iteration departed from its plan. The one writer of its queues (``pending``,
    ``dead_held``) and of ``RunStats.planned_moves``, ``skipped_moves`` and
    ``departures``.

    The per-op table is the plan's (``Run._actions``, made by
    :meth:`PlanFollowing._move_table`, a field of the followed plan's record,
    runtime/followed_plan.py): it is an argument of :meth:`fire`, not the follower's state.

    Args:
        storages: the storage records (``StorageTable``): tensors are found by key or by
            the trace id they were bound to.
        mover: the back-end's ``Mover`` (evictions and prefetches).
        ledger: the device bytes accounted (``DeviceLedger``).
        stats: the run's counters (``RunStats``).
        room: the budget now (it is set when a share budget is resolved at the first plan).
        make_room: the pager: evict until ``need`` more bytes fit (a reactive plan's
            prefetch hint makes room, like a fault).
        evict_beyond_plan: evict one storage the plan did not say to (counted).
        retire_leaving: stop counting copies out that have landed.

    NOTE: ``make_room``, ``evict_beyond_plan`` and ``retire_leaving`` are the eager
    front-end's pager (``Moves``), handed in as callables: it picks victims by the
    plan's next use, from the executor's iteration state. (Driven on its own, with a
    mover and a storage table and no model: tests/test_runtime_follower.py.)
    """

    def __init__(self, storages: Any, mover: Any, ledger: Any, stats: Any, *, room: Callable[[], float],
                 make_room: Callable[[int, list], None], evict_beyond_plan: Callable[[_Entry], bool],
                 retire_leaving: Callable[..., None]) -> None:
        self._storages, self._mover, self._ledger, self._stats = storages, mover, ledger, stats
        self._room, self._make_room = room, make_room
        self._evict_beyond_plan, self._retire_leaving = evict_beyond_plan, retire_leaving
        self.pending: deque[_Entry] = deque()  # planned prefetches waiting for room
        self.dead_held: deque[_Entry] = deque()  # gradients past their last use, still resident

    def fire(self, actions: list[tuple], op: int, hints: bool = False) -> None:
        """Issue the moves "after op ``op``" of the plan's per-op table ``actions`` (see
        :meth:`PlanFollowing._move_table`); ``hints``: a reactive plan's, prefetches that
        make room."""
        entries, by_key, stats = self._storages.iter_entries, self._storages.by_key, self._stats
        for evict, tid, key, tier, slot in actions[op]:
            if evict is None:  # a gradient past its last use, held until zero_grad (see _move_table)
                e = entries[tid]
                if e is not None and e.state is RESIDENT and e.ref() is not None:
                    self.dead_held.append(e)
                continue
            e = by_key.get(key) if key is not None else entries[tid]
            # (a temporary the plan moves is found by the trace id it was bound to: made by
            # an op of the iteration, nobody's but autograd's, safe to move)
            if e is None or e.ref() is None or not e.resizable or (
                    e.kind not in OWNED and not (key is None and e.kind == "temporary")):
                stats.skipped_moves += 1
                if not hints:
                    self.depart("skipped move: a tensor the runtime did not find or cannot move"
                                 if e is None or e.ref() is None else f"skipped move: a {e.kind} it cannot move")
                continue
            if evict:
                done = self._mover.evict(e, tier, slot)
            elif e.state is RESIDENT or e in self.pending:
                done = False
            elif hints and self._ledger.used + e.nbytes <= self._room():
                done = self._mover.prefetch(e)
            elif hints:
                # NOTE: a UVM-style prefetch hint makes room, like a fault, but not yet:
                # what op ``op`` read for the last time is freed only after it returns
                # (autograd releases a node's inputs after its kernel), so room made now
                # would evict what the plan keeps. It waits for the next op's start.
                self.pending.append(e)
                continue
            else:  # a planned prefetch never evicts: it waits for room (as simulated)
                self.pending.append(e)
                continue
            if done:
                stats.planned_moves += 1
            else:
                stats.skipped_moves += 1
                if not hints:
                    self.depart("skipped move: already where the plan sends it" if not evict or e.state != RESIDENT
                                 else "skipped move: eviction refused (pinned by a collective, or resized)")
        if self.pending and not hints:
            self.issue_pending(False)

    def issue_pending(self, hints: bool) -> None:
        """Start queued prefetches, in order: a planned one when it fits the budget, a
        reactive plan's hint (``hints``) at the first op after the one it follows (making
        room)."""
        ledger = self._ledger
        room = self._room()
        while self.pending:
            e = self.pending[0]
            if e.ref() is None or e.state != AWAY:
                self.pending.popleft()
                continue
            if ledger.used + e.nbytes > room and ledger.leaving:
                self._retire_leaving()  # (copies out that landed since give their room)
            if ledger.used + e.nbytes > room and self.dead_held and not hints:
                self.evict_dead_held(e.nbytes)
            if ledger.used + e.nbytes > room:
                if not hints:
                    return  # a planned prefetch waits for room (as simulated)
                self._make_room(e.nbytes, [])  # a hint makes room, like a fault
            self.pending.popleft()
            if self._mover.prefetch(e):
                self._stats.planned_moves += 1

    def evict_dead_held(self, need: int) -> None:
        """Evict gradients past their last use (oldest first) until ``need`` more bytes
        fit the budget: memory the plan counted free."""
        held, ledger = self.dead_held, self._ledger
        while held and ledger.used - ledger.leaving_bytes + need > self._room():
            e = held.popleft()
            if e.ref() is not None and e.state is RESIDENT and self._evict_beyond_plan(e):
                self.depart("eviction: a gradient held past its last use, for a planned prefetch")
        if ledger.leaving:
            self._retire_leaving(need)

    def depart(self, reason: str) -> None:
        """Count one way a planned iteration departed from its plan (``stats.departures``)."""
        d = self._stats.departures
        d[reason] = d.get(reason, 0) + 1

    def leave_start_away(self, start_away: dict[str, str]) -> None:
        """A planned iteration begins: the persistent tensors its plan starts without
        (``start_away``: key -> runtime tier) leave the device (where they are still on it)."""
        for key, tier in start_away.items():
            e = self._storages.by_key.get(key)
            if e is not None and e.state == RESIDENT and self._mover.evict(e, tier):
                self._stats.planned_moves += 1

    def enter_start_state(self, start_away: dict[str, str]) -> None:
        """Before the first planned iteration after a profile: bring back the parameters
        and optimizer state the plan has on the device when an iteration starts. The
        profiled iteration's pager left its own residency (least recently used evicted),
        while the plan, as simulated, starts from its steady state; unaligned, the first
        planned iteration fetched them on demand one op at a time (unet-mini at 50%:
        about 20 on-demand fetches in its first forward)."""
        away = start_away
        for key, e in self._storages.by_key.items():
            if e.state != AWAY or key in away or e.tier == "home" or e.ref() is None:
                continue
            if self._ledger.used + e.nbytes > self._room():
                break  # (what does not fit comes back when used)
            if self._mover.prefetch(e):
                self._stats.planned_moves += 1

    def begin_iteration(self) -> None:
        """An iteration begins: no gradient is held past its last use yet."""
        self.dead_held.clear()

    def forget_pending(self) -> None:
        """A new plan: prefetches the previous one queued are forgotten."""
        self.pending.clear()

class PlanFollowing:
    """The plan's tables and the tiers' layout for it, made at planning, and the move
    probe (a mixin of :class:`~tierflow.runtime.executor.Run`); following the plan op by
    op is :class:`Follower`'s (``self._follower``)."""

    def _depart(self, reason: str) -> None:
        """:meth:`Follower.depart` (for the mixins that reach it through ``self``)."""
        self._follower.depart(reason)


    def _probe_move_s(self, rounds: int = 16, nbytes: int = 4096, tensors: int = 4) -> float:
        """Seconds of this thread one planned move costs, measured: ``rounds`` times,
        ``tensors`` scratch storages of ``nbytes`` are evicted and prefetched back through
        the code a planned move takes on the lean path: the per-op move table fired after
        an op (:meth:`Follower.fire`), the pool slot, the copy, the resize, the bookkeeping, and
        for a prefetch the queue of prefetches waiting for room (:meth:`Follower.issue_pending`).
        The CPU-mode hardware model charges it per transfer (``Hardware.move_issue_s``),
        so that the planner weighs many small moves against a few large ones. The run's
        stats, tables and queues are left as they were.

        NOTE: it still runs warm, in a tight loop: on the 2-core VM it gives 5-9 us at
        the first plan (3.5-4 us when run again later), about what ``_evict`` and
        ``_fetch`` cost per call in a followed iteration (less their bytes), while each
        planned move there adds more to the step (the move table's loop, the queue, the
        pager's unplanned work, caches the copies evict): BENCHMARKS.md, "CPU-mode
        prediction"."""
        # (a scratch follower of its own, with no budget: the run's queues and tables are
        # not touched; the trace ids are the storage table's to lend, the stats are put
        # back whole)
        scratch = Follower(self._storages, self._mover, self._ledger, self.stats, room=lambda: math.inf,
                           make_room=self._make_room, evict_beyond_plan=self._evict_beyond_plan,
                           retire_leaving=self._retire_leaving)
        with left_as_it_was(self, ()):
            planned_before = self.stats.planned_moves
            with torch._C._DisableTorchDispatch():
                ts = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(tensors)]
            sts = [t.untyped_storage() for t in ts]
            # (never in the storage table; each eviction takes its bytes off the device count
            # and each fetch puts them back, so the count ends where it began)
            es = [_Entry(-1 - k, nbytes, (lambda st=st: st), kind="activation", name="<move probe>")
                  for k, st in enumerate(sts)]
            # after op k: evict scratch tensor k; after op tensors + k: prefetch it (one move
            # an op, about what a planned iteration fires: 1.3 on gpt-tiny at 30%)
            actions = ([((True, k, None, "host", None),) for k in range(tensors)]
                       + [((False, k, None, "host", None),) for k in range(tensors)])
            fire, ops = scratch.fire, range(2 * tensors)
            with self._storages.borrowed_ids(es):
                try:
                    # (below the dispatch mode, as a move made while an op is dispatched runs)
                    with torch._C._DisableTorchDispatch():
                        t0 = time.perf_counter()
                        for _ in range(rounds):
                            for op in ops:
                                fire(actions, op)
                            self._mover.reap()
                        elapsed = time.perf_counter() - t0
                    moved = self.stats.planned_moves - planned_before
                finally:
                    for e in es:
                        if e.state != RESIDENT:
                            self._mover.fetch(e)
                        self._storages.left_device(e)  # (a fetched activation joins the LRU order: not a scratch one)
                    self._mover.reap(wait=True)
        if moved != 2 * rounds * tensors:
            return 0.0  # (a move was refused, the host pool full: nothing measured)
        return elapsed / moved

    def _move_table(self, trace: Trace, plan: Any, hw: Any, layout: dict[tuple[int, int, str], int]
                    ) -> list[tuple]:
        """Per op, the moves after it as ``(evict?, tensor id, key, runtime tier, planned
        slot)``: persistent tensors are found by key, the rest by their bound id; the
        tier (by ``hw``, the plan's machine model) and the offset in ``layout`` (the
        plan's, :meth:`_lay_out`) are looked up once, not per move."""
        table: list[tuple] = [()] * trace.n_ops
        for op, moves in plan.by_op.items():
            if not 0 <= op < trace.n_ops:
                continue
            acts = []
            for m in moves:
                info = trace.tensors[m.tensor]
                rt = _runtime_tier(hw, m.tier)
                acts.append((m.kind == "evict", m.tensor, (info.key or "") if info.persistent else None, rt,
                             layout.get((m.tensor, op + 1, rt)) if m.kind == "evict" else None))
            table[op] = tuple(acts)
        if not plan.reactive:
            # NOTE: a gradient lives until zero_grad, past its last use, which the trace
            # does not count (see Profiling._build_trace): from its last use it is the
            # first thing to leave when a planned prefetch waits for room that the plan
            # had counted free (vit-tiny at 30%: an Adam moment fetched on demand every
            # step, its prefetch waiting behind dead gradients). Nothing fetches it back.
            for t in trace.tensors:
                if t.kind == "gradient" and not t.persistent and t.held_until is None:
                    d = int(trace.death[t.id])
                    table[d] = tuple(table[d]) + ((None, t.id, None, None, None),)
        return table

    def _victims(self, pinned: set[int]) -> list[_Entry]:
        """Owned resident tensors in eviction order: following a plan, the one the trace
        uses furthest in the future first (Belady; ties in least recently used order);
        otherwise least recently used first."""
        cands = [e for c, e in self._lru.items() if c not in pinned]
        if not (self._in_iter and self._planned and not self._stale) or not cands:
            return cands
        # NOTE: the trace's uses as Python lists, searched with bisect: the pager picks
        # victims from every resident tensor (70-100 on the tiny models), and a numpy
        # search per candidate cost 0.2-0.3 ms a call (about 1 ms a step on gpt-tiny at
        # 30%), work the simulator does not see
        key_tid, iter_tid = self._key_tid, self._iter_tid
        tids = [key_tid.get(e.key, -1) if e.persistent else iter_tid.get(e.cdata, -1) for e in cands]
        nxt = _next_uses(self._use_lists(), self.trace.n_ops, tids, [e.persistent for e in cands], self._op)
        # (sorted is stable with reverse=True too: equal next uses stay in LRU order)
        return [cands[k] for k in sorted(range(len(cands)), key=nxt.__getitem__, reverse=True)]

    def _use_lists(self) -> list[list[int]]:
        """Each trace tensor's uses (sorted op indices) as a Python list, built once per
        trace."""
        trace = self.trace
        cached = getattr(self, "_use_lists_of", None)
        if cached is not None and cached[0] is trace:
            return cached[1]
        lists = [trace.uses(t).tolist() for t in range(trace.n_tensors)]
        self._use_lists_of = (trace, lists)
        return lists

    def _lay_out(self, trace: Trace, plan: Any, hw: Any) -> dict[tuple[int, int, str], int]:
        """Offsets in the host pool and the SSD file for every stay a planned plan puts
        there, laid out ahead of time by the pool planner (``tierflow.pool``, greedy: it
        is fast and deterministic) so that the pool's layout follows the plan's
        lifetimes instead of the order moves happen to arrive in. Keyed by (tensor, first
        op of the stay, runtime tier). A reactive plan has no planned residency. Sets the
        span each tier needs (``_layout_need``, read by :meth:`_fit_tiers`)."""
        if plan.reactive:
            return {}
        from ..pool import from_trace, solve

        arenas = {"host": self._tiers.host.arena}
        if self._tiers.ssd is not None:
            arenas["ssd"] = self._tiers.ssd.arena
        layout: dict[tuple[int, int, str], int] = {}
        self._layout_need = {}  # runtime tier -> (bytes the layout spans, its largest slot)
        free = _uncapped(hw)  # (a plan over a tier's capacity is laid out too: _fit_tiers says so)
        for tier in hw.offload_tiers:
            rt = _runtime_tier(hw, tier)
            if rt not in arenas:
                continue
            try:
                problem = from_trace(trace, plan, free, tier=tier, alignment=arenas[rt].align)
            except TierflowError:
                continue  # a plan the walk rejects: its moves take first-fit slots
            if not problem.buffers:
                continue
            sol = solve(problem, "greedy")
            span, largest = self._layout_need.get(rt, (0, 0))
            for b, off in zip(problem.buffers, sol.offsets.tolist()):
                layout[(int(b.id.split(".")[0]), b.lower, rt)] = int(off)
                span, largest = max(span, int(off) + b.size), max(largest, b.size)
            self._layout_need[rt] = (span, largest)
        return layout

    def _fit_tiers(self, trace: Trace, plan: Any, hw: Any, layout: dict[tuple[int, int, str], int]
                   ) -> dict[tuple[int, int, str], int]:
        """Make the tiers hold what the plan needs there before the first iteration that
        follows it: a planned plan, its layout's span in the host pool and the SSD file
        (grown to now); a reactive one, at least what must leave the device at the
        iteration's peak (the pool grows as it evicts). A need above what the tiers may
        grow to raises :class:`OffloadError` here, at planning, with the model and
        optimizer whole (planning runs after the profiled step has finished). Returns the
        plan's ``layout`` (from :meth:`_lay_out`) placed in the pool's chunk that holds it.

        Raises:
            OffloadError: the host pool (and the SSD file, where there is one) cannot hold
                what the plan needs.
        """
        pool, ssd = self._tiers.host, self._tiers.ssd
        need_of = getattr(self, "_layout_need", {})
        if plan.reactive:
            room = plan.budget_bytes if math.isfinite(plan.budget_bytes) else self.budget  # (less what the loop holds)
            need = int(trace.peak_live_bytes - room) if math.isfinite(room) else 0
            largest, ssd_need = 0, 0
            fits = need <= pool.limit + (ssd.limit if ssd is not None else 0)
        else:
            need, largest = need_of.get("host", (0, 0))
            need = max(need, self._planned_host_bytes(trace, plan, hw))
            ssd_need = need_of.get("ssd", (0, 0))[0]
            # (what the host cannot hold spills to an SSD tier, where there is one)
            fits = need <= pool.limit or ssd is not None
        if fits:
            if need <= pool.limit and not pool.fixed:
                pool.reserve(need, largest)
            span = need_of.get("host", (0, 0))[0] if not plan.reactive else 0
            base = pool.chunk_holding(span) if span and span <= pool.limit else None
            if base:
                # the pool planner lays the plan's stays out from offset 0 of one arena;
                # the pool is chunks, and a slot cannot straddle two: the layout goes
                # where one chunk holds all of it
                layout = {k: off + base if k[2] == "host" else off for k, off in layout.items()}
            if ssd is not None and ssd_need > ssd.capacity and not ssd.reserve(ssd_need):
                raise OffloadError(
                    f"offload: {plan.policy}'s plan needs {fmt_bytes(ssd_need)} ({ssd_need} bytes) in the SSD file, "
                    f"but it may grow to {fmt_bytes(ssd.limit)} in {ssd.dir}: free space there, pass a larger "
                    "budget, or a larger ssd_bytes")
            self._mover.tiers_sized()
            return layout
        what = "to keep" if not plan.reactive else "at least"
        where = "in the host pool" if not plan.reactive else "off the device"
        if pool.fixed:
            room = f"the host pool is fixed at {fmt_bytes(pool.limit)} ({pool.limit} bytes, host_bytes)"
        else:
            room = (f"the host has {fmt_bytes(pool.limit)} ({pool.limit} bytes) for it (its available "
                    f"memory less {tiers.HOST_MARGIN:.0%})")
        fixes = ["ssd_dir= for an SSD tier"] if ssd is None else []
        if ssd is not None:
            room += f" and the SSD file may grow to {fmt_bytes(ssd.limit)}"
            fixes.append("a larger ssd_bytes" if ssd.fixed else f"more free space in {self._ssd_dir}")
        if pool.fixed:
            fixes.append("a larger host_bytes")
        fixes.append("a larger budget")
        raise OffloadError(
            f"offload: {plan.policy}'s plan needs {what} {fmt_bytes(need)} ({need} bytes) {where}, "
            f"but {room}: pass {', '.join(fixes[:-1])}, or {fixes[-1]}"
        )

    def _tier_limits(self) -> tuple[int, int]:
        """The most the host pool and the SSD file may hold: the capacities the planner
        is told. Under several ranks, the smallest any rank has (every rank keeps to it):
        the ranks plan for one machine, and each measured its free memory at its own
        moment."""
        return self._tiers.agree_limits(self._sync.min if self._sync is not None else None)

    def _planned_host_bytes(self, trace: Trace, plan: Any, hw: Any) -> int:
        """The most bytes a planned plan keeps on its host tiers at once, by the
        validator's residency, less its host steps' buffers (those live beside the
        pool: runtime/host_step.py). 0 where the plan does not validate."""
        from ..plan import validate

        try:
            residency = validate(plan, trace, _uncapped(hw))
        except TierflowError:
            return 0
        hosts = [t.name for t in hw.tiers if t.name != hw.device
                 and _runtime_tier(hw, t.name) == "host" and t.name in residency.tier_bytes]
        if not hosts:
            return 0
        held = sum(sum(trace.tensors[s].bytes for s in h.state) + trace.tensors[h.grad].bytes
                   + trace.tensors[h.param].bytes for h in plan.host_steps if h.tier in hosts)
        peak = int(np.sum([residency.tier_bytes[t] for t in hosts], axis=0).max()) if trace.n_ops else 0
        return max(peak - held, 0)


