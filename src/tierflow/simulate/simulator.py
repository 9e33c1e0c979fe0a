"""The discrete-event simulator: one compute stream, copy engines, capacity per tier.

Semantics, in the order things happen:

* Ops run in trace order on one compute stream. Before op ``i`` starts, every tensor it
  touches must be on the device: a tensor being born is allocated there; one that is
  away and not already coming is fetched **on demand** (a fault: the hardware's fault
  latency, then its bytes); the op stalls until all have arrived.
* Room on the device comes from the plan's budget. When a demand needs room that is not
  free, the least recently used unpinned tensors are evicted (to host, or the next tier
  with room) and the demand waits for their bytes to leave.
* When op ``i`` ends, non-persistent tensors whose last use it was are freed, then the
  plan's moves issued "after op ``i``" start: evictions at once; prefetches once the
  device has room for them (a planned prefetch never evicts; a reactive plan's prefetch
  hint may evict least recently used tensors, as a UVM prefetch does).
* Transfers move data (they do not copy it): an eviction holds its device bytes until it
  completes, a fetch reserves device bytes when it is issued and releases its source
  when it completes.

Two iterations are simulated and the second (steady state) is reported, as G10 does.
"""

from __future__ import annotations

import gc
import math
import operator
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from ..errors import SimulationError
from ..hardware import Hardware
from ..plan import Move, Plan, validate
from ..trace import Trace
from .engine import CopyEngines, Flow
from .result import SimResult, TransferRecord

UNBORN, RESIDENT, AWAY, INCOMING, OUTGOING = range(5)

ProgressFn = Callable[[int, int], None]

_NOTHING: frozenset[int] = frozenset()
_BY_ISSUE_THEN_TENSOR = operator.attrgetter("issue_s", "tensor")  # sort key of the transfers


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the block.

    A simulation allocates tens of thousands of small objects that live to its end
    (every transfer is kept for the result), and the collector would rescan them again
    and again: a sixth of the run's time. The simulation makes no garbage cycles worth
    collecting meanwhile, so the collector waits until it is over."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def simulate(
    trace: Trace,
    hardware: Hardware,
    plan: Plan,
    *,
    iterations: int = 2,
    progress: ProgressFn | None = None,
    check_plan: bool = True,
) -> SimResult:
    """Simulate ``plan`` for ``trace`` on ``hardware`` and report the last iteration.

    Args:
        trace: the training iteration.
        hardware: the machine (tiers, links, fault latency).
        plan: where tensors live and when they move; its ``budget_bytes`` is the device
            capacity the simulator enforces.
        iterations: how many iterations to run; the last is reported (2 = one warm-up).
        progress: called as ``progress(ops_done, ops_total)`` now and then.
        check_plan: validate the plan first (a :class:`PlanError` if inconsistent).

    Returns:
        A :class:`SimResult`; if some op cannot run at all within the budget (its own
        tensors exceed it) the result has ``fits=False``, ``time_s=inf`` and ``error``.
    """
    residency = validate(plan, trace, hardware) if check_plan else None
    sim = _Simulator(trace, hardware, plan, residency.start_tier if residency else {})
    try:
        sim.run(iterations, progress)
    except SimulationError as e:
        return sim.failed(str(e))
    return sim.result()


class _Simulator:
    def __init__(self, trace: Trace, hw: Hardware, plan: Plan, start_tier: dict[int, str]):
        self.trace, self.hw, self.plan = trace, hw, plan
        self.dev = hw.device
        self.engines = CopyEngines(hw)
        self.size = trace.sizes.tolist()
        self.op_tensors = trace.op_tensors
        n = trace.n_tensors
        self.state = [UNBORN] * n
        self.where: list[str | None] = [None] * n
        self.cap = {t.name: t.capacity for t in hw.tiers}
        self.cap[self.dev] = plan.budget_bytes
        self.used = {t.name: 0.0 for t in hw.tiers}
        self.peak = {t.name: 0.0 for t in hw.tiers}
        self.outgoing = 0.0  # device bytes being evicted (room on its way)
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.pinned: set[int] = set()
        # tensors another stream is reading (a collective): never chosen as eviction
        # victims; subclasses (simulate.parallel) fill and empty it
        self.held: dict[int, int] = {}
        self.deferred: deque[int] = deque()
        self.demand_waiting = False
        self.window = math.inf
        self.mem_log: dict[str, list[tuple[float, float]]] = {t.name: [] for t in hw.tiers}
        self.faults = self.fault_bytes = self.skipped = 0
        self.offload = [t for t in hw.offload_tiers if self.engines.reachable(self.dev, t)]
        self.start_tier = start_tier
        self.headroom = plan.budget_bytes * plan.headroom if plan.reactive else 0.0
        self.moves = plan.by_op
        persistent = trace.persistent.tolist()
        dies: dict[int, list[int]] = {}
        if plan.frees_dead:
            for t, op in enumerate(trace.death.tolist()):
                if not persistent[t]:
                    dies.setdefault(op, []).append(t)
        self.dies = dies
        # Without liveness, a tensor is not freed but its next birth (first use, as an
        # output only) overwrites it, so the dead contents are never fetched back.
        self.overwrites: dict[int, set[int]] = {}
        if not plan.frees_dead and not plan.refetch_dead:
            for t, b in enumerate(trace.first_use.tolist()):
                if not persistent[t]:
                    if t not in trace.ops[b].inputs:
                        self.overwrites.setdefault(b, set()).add(t)
        n_ops = trace.n_ops
        self.op_start = np.zeros(n_ops)
        self.op_end = np.zeros(n_ops)
        self.op_stall = np.zeros(n_ops)

    # -- memory bookkeeping -------------------------------------------------------------
    def _alloc(self, tier: str, nbytes: float) -> None:
        self.used[tier] += nbytes
        if self.engines.now >= self.window:
            if self.used[tier] > self.peak[tier]:
                self.peak[tier] = self.used[tier]
            self.mem_log[tier].append((self.engines.now, self.used[tier]))

    def _free(self, tier: str, nbytes: float) -> None:
        self.used[tier] -= nbytes
        if self.engines.now >= self.window:
            self.mem_log[tier].append((self.engines.now, self.used[tier]))
        if tier == self.dev:
            self._pump()

    def _room(self) -> float:
        return self.cap[self.dev] - self.used[self.dev]

    def _dest(self, nbytes: int, preferred: str | None = None) -> str | None:
        """The first offload tier with room: ``preferred`` if it is one, then the others
        in order."""
        used, cap = self.used, self.cap
        if preferred and preferred in self.offload and used[preferred] + nbytes <= cap[preferred]:
            return preferred
        for tier in self.offload:
            if tier != preferred and used[tier] + nbytes <= cap[tier]:
                return tier
        return None

    # -- moves --------------------------------------------------------------------------
    def _evict(self, t: int, dst: str, kind: str) -> None:
        size = self.size[t]
        self.state[t] = OUTGOING
        self.lru.pop(t, None)
        self._alloc(dst, size)
        self.outgoing += size
        self.engines.submit(t, size, self.dev, dst, kind, self._evicted)

    def _evicted(self, f: Flow) -> None:
        t = f.tensor
        self.outgoing -= f.nbytes
        self.state[t], self.where[t] = AWAY, f.dst
        self._free(self.dev, f.nbytes)

    def _fetch(self, t: int, kind: str) -> None:
        """Bring ``t`` to the device; the caller has checked there is room."""
        size = self.size[t]
        self.state[t] = INCOMING
        self._alloc(self.dev, size)
        extra = self.hw.fault_latency_s if kind == "fault" else 0.0
        if kind == "fault" and self.engines.now >= self.window:
            self.faults += 1
            self.fault_bytes += size
        self.engines.submit(t, size, self.where[t], self.dev, kind, self._fetched, extra)

    def _fetched(self, f: Flow) -> None:
        t = f.tensor
        self.state[t] = RESIDENT
        self.where[t] = None
        self.lru[t] = None
        self._free(f.src, f.nbytes)

    def _make_room(self, need: float, protect: set[int] | frozenset[int]) -> bool:
        """Start evicting least recently used tensors until ``need`` bytes are free or on
        their way out. False if not enough can be evicted."""
        short = need - self._room() - self.outgoing
        if short <= 0:
            return True
        victims = []
        pinned, held, size = self.pinned, self.held, self.size
        for t in self.lru:
            if t in pinned or t in protect or t in held:
                continue
            victims.append(t)
            short -= size[t]
            if short <= 0:
                break
        for t in victims:
            dst = self._dest(self.size[t])
            if dst is None:
                raise SimulationError(
                    f"every tier is full: cannot evict tensor {t} ({self.size[t]} bytes) from {self.dev}"
                )
            self._evict(t, dst, "evict")
        return short <= 0

    def _wait_room(self, need: float) -> None:
        """Block the compute stream until ``need`` device bytes are free (demand path)."""
        self.demand_waiting = True
        while self._room() < need:
            self._make_room(need, _NOTHING)
            if self._room() >= need:
                break
            if not self.engines.busy():
                raise SimulationError(
                    f"op {self.current_op} ({self.trace.ops[self.current_op].name}) needs "
                    f"{self.trace.working_set_bytes[self.current_op]} bytes on {self.dev}, more than the "
                    f"budget of {self.cap[self.dev]:.0f} bytes allows"
                )
            self.engines.step()

    def _pump(self) -> None:
        """Start deferred prefetches, in order, as room allows."""
        if self.demand_waiting or not self.deferred:
            return
        keep: deque[int] = deque()
        blocked = False  # strict order among the prefetches that wait for room
        while self.deferred:
            t = self.deferred.popleft()
            s = self.state[t]
            if s == OUTGOING:
                keep.append(t)  # still leaving; fetch it back once it is away
            elif s == AWAY:
                if blocked or self._room() < self.size[t]:
                    blocked = True
                    keep.append(t)
                else:
                    self._fetch(t, "prefetch")
        self.deferred = keep

    def _issue(self, m: Move, op: int) -> None:
        t = m.tensor
        s = self.state[t]
        if m.kind == "evict":
            if s != RESIDENT or t in self.pinned:
                self.skipped += 1
                return
            dst = self._dest(self.size[t], m.tier)
            if dst is None:
                self.skipped += 1
                return
            self._evict(t, dst, "evict")
            return
        # prefetch
        if s not in (AWAY, OUTGOING) or t in self.deferred:
            return
        if self.plan.reactive and s == AWAY and self._room() < self.size[t]:
            nxt = self.op_tensors[(op + 1) % self.trace.n_ops]
            target = self.op_tensors[m.needed_by] if m.needed_by is not None else ()
            if not self._make_room(self.size[t], {t, *nxt, *target}):
                self.skipped += 1
                return
        self.deferred.append(t)
        self._pump()

    # -- the compute stream -------------------------------------------------------------
    def _place_initial(self) -> None:
        order = np.argsort(self.trace.first_use, kind="stable")
        for t in order.tolist():
            if not self.trace.tensors[t].persistent:
                continue
            size = self.size[t]
            home = self.start_tier.get(t, self.dev)
            if home == self.dev and self.used[self.dev] + size <= self.cap[self.dev]:
                self.state[t] = RESIDENT
                self.lru[t] = None
                self._alloc(self.dev, size)
                continue
            tier = self._dest(size, None if home == self.dev else home)
            if tier is None:
                raise SimulationError(f"tensor {t} ({size} bytes) fits in no tier at the start")
            self.state[t], self.where[t] = AWAY, tier
            self._alloc(tier, size)

    def run(self, iterations: int, progress: ProgressFn | None) -> None:
        with _collector_paused():
            self._run(iterations, progress)

    def _run(self, iterations: int, progress: ProgressFn | None) -> None:
        trace, eng = self.trace, self.engines
        n_ops = trace.n_ops
        durations = trace.durations.tolist()
        self._place_initial()
        total = iterations * n_ops
        every = max(1, total // 100)
        for it in range(iterations):
            last = it == iterations - 1
            if last:
                self._open_window()
            for i in range(n_ops):
                self.current_op = i
                ready = eng.now
                self._before_op(i)
                self._bring_in(self.op_tensors[i])
                start = eng.now
                eng.run_until(start + durations[i])
                if last:
                    w = self.window
                    self.op_start[i], self.op_end[i], self.op_stall[i] = start - w, eng.now - w, start - ready
                for t in self.op_tensors[i]:
                    if t in self.lru:
                        self.lru.move_to_end(t)
                self.pinned = set()
                self._after_op(i)
                for t in self.dies.get(i, ()):
                    self._die(t)
                for m in self.moves.get(i, ()):
                    self._issue(m, i)
                if self.headroom and self.headroom - self._room() - self.outgoing > 0:
                    # a pager keeps some memory free by evicting in the background, so
                    # that faults rarely wait for an eviction (as UVM drivers do); the
                    # test is _make_room's own, done first to skip building the set
                    self._make_room(self.headroom, frozenset(self.op_tensors[(i + 1) % n_ops]))
                if progress is not None and (it * n_ops + i) % every == 0:
                    progress(it * n_ops + i, total)
        self.end = eng.now
        if progress is not None:
            progress(total, total)

    def _before_op(self, i: int) -> None:
        """Hook: runs before op ``i`` gathers its tensors; time it lets pass is the op's
        stall. The plain simulator has nothing to do here."""

    def _after_op(self, i: int) -> None:
        """Hook: runs when op ``i`` ends, before its dead tensors are freed and its moves
        issued. The plain simulator has nothing to do here."""

    def _open_window(self) -> None:
        self.window = self.engines.now
        self.engines.window_start = self.window
        for tier, v in self.used.items():
            self.peak[tier] = v
            self.mem_log[tier].append((self.window, v))

    def _bring_in(self, needed: tuple[int, ...]) -> None:
        self.pinned = set(needed)
        state, eng = self.state, self.engines
        while True:
            for t in needed:
                s = state[t]
                if s == RESIDENT:
                    continue
                if s == UNBORN:
                    self._wait_room(self.size[t])
                    state[t] = RESIDENT
                    self.lru[t] = None
                    self._alloc(self.dev, self.size[t])
                elif s == AWAY:
                    if t in self.deferred:
                        self.deferred.remove(t)
                    self._wait_room(self.size[t])
                    if state[t] != AWAY:
                        continue
                    if t in self.overwrites.get(self.current_op, ()):
                        # its old contents are dead and about to be overwritten: a
                        # liveness-blind pager drops them and maps fresh memory
                        self._free(self.where[t], self.size[t])
                        state[t], self.where[t] = RESIDENT, None
                        self.lru[t] = None
                        self._alloc(self.dev, self.size[t])
                    else:
                        self._fetch(t, "fault")
            # Waiting for room lets time pass: tensors scanned earlier may have arrived,
            # or finished leaving and now need a fault. Re-scan before waiting.
            rescan = in_flight = False
            for t in needed:
                s = state[t]
                if s != RESIDENT:
                    if s == AWAY or s == UNBORN:
                        rescan = True
                        break
                    in_flight = True
            if rescan:
                continue
            if not in_flight:
                break
            eng.step()
        self.demand_waiting = False
        self._pump()

    def _die(self, t: int) -> None:
        s = self.state[t]
        if s == RESIDENT:
            self.lru.pop(t, None)
            self.state[t] = UNBORN
            self._free(self.dev, self.size[t])
        elif s == AWAY:
            self.state[t] = UNBORN
            self._free(self.where[t], self.size[t])
            self.where[t] = None
        else:  # in flight at its death: only a plan that moves a dead tensor gets here
            raise SimulationError(f"tensor {t} dies while a transfer of it is in flight")

    # -- results ------------------------------------------------------------------------
    def result(self) -> SimResult:
        with _collector_paused():
            return self._result()

    def _result(self) -> SimResult:
        w = self.window
        eng = self.engines
        flows = list(eng.done) + [f for q in eng._queues.values() for f in q]
        transfers = [
            TransferRecord(
                f.tensor, f.nbytes, f.src, f.dst, f.kind,
                f.issue_s - w, f.start_s - w, f.end_s - w, f.links,
            )
            for f in flows
            if f.issue_s >= w
        ]
        transfers.sort(key=_BY_ISSUE_THEN_TENSOR)
        memory = {}
        for tier, log in self.mem_log.items():
            arr = np.array(log, dtype=np.float64).reshape(-1, 2)
            memory[tier] = (arr[:, 0] - w, arr[:, 1])
        # The stream runs ops back to back, so the iteration is its op time plus its
        # stalls; summing exactly keeps a stall-free run at exactly the ideal time.
        stall_s = math.fsum(self.op_stall.tolist())
        return SimResult(
            policy=self.plan.policy,
            trace=self.trace.name,
            hardware=self.hw.name,
            time_s=self.trace.ideal_s + stall_s,
            ideal_s=self.trace.ideal_s,
            stall_s=stall_s,
            traffic_bytes={k: int(round(v)) for k, v in eng.traffic.items()},
            peak_bytes={k: int(v) for k, v in self.peak.items()},
            fits=self.peak[self.dev] <= self.hw.device_capacity,
            budget_bytes=self.plan.budget_bytes,
            faults=self.faults,
            fault_bytes=self.fault_bytes,
            skipped_moves=self.skipped,
            op_start_s=self.op_start,
            op_end_s=self.op_end,
            op_stall_s=self.op_stall,
            transfers=transfers,
            memory=memory,
        )

    def failed(self, reason: str) -> SimResult:
        res = SimResult.unplanned(self.plan.policy, self.trace, self.hw, reason)
        res.budget_bytes = self.plan.budget_bytes
        return res
