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
* Issuing a transfer (a planned move, a hint, a fault, a pager's eviction) costs the
  compute stream's thread the hardware's ``move_issue_s`` (0 on the published
  machines): that time is paid before the next op starts, in the step's time.
* The runtime's own host costs (all 0 on the published machines): each op run on the
  compute stream costs the dispatching thread ``op_issue_s``, each op a recompute chain
  replays ``recompute_issue_s``, each host step issued (when its gradient leaves)
  ``host_step_issue_s``. Without ``async_launch`` (CPU mode: that thread runs the ops)
  they are paid on the compute stream like the move issue cost, before the op or the
  chain's op. With ``async_launch`` (a GPU) they and the move issue cost advance a
  *host timeline* instead: an op cannot start before the host has issued it, so a
  launch-bound plan is scored as such and a device-bound one pays nothing; a stall is
  resolved by the host before it issues the op, so the host waits for it.
* With ``host_copies`` (CPU mode: a move is a ``memmove`` on the dispatching thread)
  each eviction, prefetch or fault also costs that thread its bytes at the route's
  rate, paid as its issue cost is.
* Transfers move data (they do not copy it): an eviction holds its device bytes until it
  completes, a fetch reserves device bytes when it is issued and releases its source
  when it completes.

Recompute (:class:`~tierflow.plan.Recompute`, planned plans only):

* A recomputed tensor is **dropped** when the last op that uses it before the chain's
  ``before_op`` ends (with that op's dead tensors, before its moves): its device bytes
  are freed at once, no transfer.
* Its **chain** runs on the compute stream just before ``before_op``, after the
  previous op's moves were issued and before the op gathers its tensors; several chains
  before one op run in plan order. Each chain op first has the tensors it reads from
  outside the chain on the device (pinned for the whole chain; one away is fetched on
  demand, one in flight awaited), then allocates what it makes (the tensors born at that
  op: kept ones become resident again, the others are temporaries), waiting for room
  as a birth does (bytes already leaving first, then least recently used unpinned
  tensors are evicted); then it runs for its trace duration. A temporary is freed
  once the last step that reads it has run (as a replay lets go of it); kept tensors
  live until their death or next drop. A chain whose
  own tensors cannot fit fails the simulation with the chain named.
* An input a chain reads is held on the device until the chain's op ends, also where
  the trace's last use of it is earlier (the plan's contract).
* The op's stall excludes its chains' compute; the iteration is
  ``ideal + stalls + recompute - host-stepped op time``.

Host steps (:class:`~tierflow.plan.HostStep`; the hardware must have
``host_compute``, else a :class:`SimulationError` before anything runs):

* Its tier holds, for good, the parameter's master copy, a gradient buffer and the
  optimizer state (placed there at the start; the state never comes to the device).
* When the last backward op that uses the gradient ends, the gradient is copied
  device -> tier (a ``host_grad`` transfer on the copy engines, sharing bandwidth with
  moves); its device bytes are held until the copy lands, then freed.
* The update is queued on the **host-compute stream** when the gradient has landed: one
  stream, FIFO, each update taking (parameter + gradient + state bytes) /
  ``optimizer_bytes_per_s``.
* When it ends, if the parameter is on the device (or on its way there) the updated
  values are copied tier -> device (a ``host_param`` transfer, into the same device
  bytes); the parameter's next use, in practice the next iteration's first, waits for
  that copy, and it is not evicted meanwhile. If the parameter is away, the update
  lands in its off-device copy and its prefetch or fault waits for the update instead.
* The host-stepped optimizer ops take no compute-stream time and touch nothing on the
  device.

Two iterations are simulated and the second (steady state) is reported, as G10 does.
Its recompute chains and the host updates queued within it are reported with the
transfers (``SimResult.recomputes``, ``SimResult.host_steps``).
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
from .levers import Chain, LeverSchedule
from .result import HostStepRecord, RecomputeRecord, SimResult, TransferRecord

# DROPPED: freed by a recompute (no transfer) until its chain re-creates it
UNBORN, RESIDENT, AWAY, INCOMING, OUTGOING, DROPPED = range(6)
_HOST_KINDS = frozenset({"host_step"})  # engine work that is not a transfer

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
        self.issue_cost = hw.move_issue_s
        # bytes/s of the routes when the thread makes the copies itself (host_copies)
        self.copy_rate: dict[tuple[str, str], float] | None = {} if hw.host_copies else None
        self.issue_debt = 0.0  # compute-thread seconds of transfers issued, not yet paid
        self.issuing_s = 0.0  # paid in the measured iteration
        # the runtime's host costs (see the module's docstring); host_t is the host
        # timeline with async_launch, and host_wait_s what the stream waited for it (or,
        # without async_launch, paid for it) in the measured iteration
        self.op_cost = hw.op_issue_s
        self.replay_cost = hw.recompute_issue_s
        self.step_issue_cost = hw.host_step_issue_s
        self.launch_async = hw.async_launch
        self.host_t = 0.0
        self.host_wait_s = 0.0
        self.host_debt = 0.0  # host-step issue costs not yet paid
        self.host_waited = 0.0  # host_wait_s over every iteration (for the stalls)
        self.offload = [t for t in hw.offload_tiers if self.engines.reachable(self.dev, t)]
        self.start_tier = start_tier
        self.headroom = plan.budget_bytes * plan.headroom if plan.reactive else 0.0
        self.moves = plan.by_op
        persistent = trace.persistent.tolist()
        # recomputes and host steps (None for a plan with neither: the loop skips them)
        self.lev = LeverSchedule.of(plan, trace, hw) if plan.recomputes or plan.host_steps else None
        death_at = self.lev.death if self.lev is not None else {}
        dies: dict[int, list[int]] = {}
        if plan.frees_dead:
            for t, op in enumerate(trace.death.tolist()):
                if not persistent[t]:
                    if t in death_at:
                        op = death_at[t]
                        if op is None:  # never on the device, or leaves it for a host step
                            continue
                    dies.setdefault(op, []).append(t)
        self.dies = dies
        # host steps: parameters whose update is under way (their next use waits), and
        # those whose updated values are on their way back to the device
        self.stale: set[int] = set()
        self.updating: set[int] = set()
        self.host_of = {h.param: h for h in plan.host_steps}
        self.recompute_log: list[RecomputeRecord] = []
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
        self.op_recompute = np.zeros(n_ops)  # compute-stream seconds of chains before each op

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
    def _copy_s(self, nbytes: float, src: str, dst: str) -> float:
        """Seconds of the dispatching thread a copy of ``nbytes`` takes (host_copies)."""
        rate = self.copy_rate.get((src, dst))
        if rate is None:
            rate = self.copy_rate[(src, dst)] = self.hw.route_bandwidth(src, dst)
        return nbytes / rate if rate > 0 else 0.0

    def _evict(self, t: int, dst: str, kind: str) -> None:
        size = self.size[t]
        self.issue_debt += self.issue_cost
        if self.copy_rate is not None:
            self.issue_debt += self._copy_s(size, self.dev, dst)
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
        self.issue_debt += self.issue_cost
        if self.copy_rate is not None:
            self.issue_debt += self._copy_s(size, self.where[t], self.dev)
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

    def _wait_room(self, need: float, what: str | None = None) -> None:
        """Block the compute stream until ``need`` device bytes are free (demand path);
        ``what`` says what needs them when they can never be found."""
        self.demand_waiting = True
        while self._room() < need:
            self._make_room(need, _NOTHING)
            if self._room() >= need:
                break
            if not self.engines.busy():
                raise SimulationError(
                    what
                    or f"op {self.current_op} ({self.trace.ops[self.current_op].name}) needs "
                    f"{self.trace.working_set_bytes[self.current_op]} bytes on {self.dev}, more than the "
                    f"budget of {self.cap[self.dev]:.0f} bytes allows"
                )
            self.engines.step()

    def _pump(self) -> None:
        """Start deferred prefetches, in order, as room allows."""
        if self.demand_waiting or not self.deferred:
            return
        keep: deque[int] = deque()
        stale = self.stale
        blocked = False  # strict order among the prefetches that wait for room
        while self.deferred:
            t = self.deferred.popleft()
            s = self.state[t]
            if s == OUTGOING:
                keep.append(t)  # still leaving; fetch it back once it is away
            elif s == AWAY:
                if t in stale:
                    keep.append(t)  # its update is under way on the host: fetch it after
                elif blocked or self._room() < self.size[t]:
                    blocked = True
                    keep.append(t)
                else:
                    self._fetch(t, "prefetch")
        self.deferred = keep

    def _issue(self, m: Move, op: int) -> None:
        t = m.tensor
        s = self.state[t]
        if m.kind == "evict":
            if s != RESIDENT or t in self.pinned or t in self.held:
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
        if self.lev is not None:
            # host steps hold a gradient buffer and the parameter's master copy on their
            # tier for good, and their optimizer state starts (and stays) there
            for tier, nbytes in self.lev.host_buffers.items():
                if self.used[tier] + nbytes > self.cap[tier]:
                    raise SimulationError(f"host steps need {nbytes} bytes on {tier}, more than its capacity")
                self._alloc(tier, nbytes)
            self.start_tier = {**self.start_tier, **self.lev.start_tier}
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
        lev = self.lev
        chains = lev.chains if lev is not None and lev.chains else None
        self._place_initial()
        total = iterations * n_ops
        every = max(1, total // 100)
        # external tensors (the batch the loop made before the iteration) are in memory
        # from its start, not from their first use
        externals = tuple(np.flatnonzero(trace.external & ~trace.persistent).tolist())
        launch_async, op_cost = self.launch_async, self.op_cost
        for it in range(iterations):
            last = it == iterations - 1
            if last:
                self._open_window()
            if externals:
                self.current_op = 0
                self._bring_in(externals)
                self.pinned = set()
            for i in range(n_ops):
                self.current_op = i
                host_op = lev is not None and i in lev.host_ops
                debt = self.host_debt if host_op else self.host_debt + op_cost
                if self.issue_debt:  # the thread issued transfers since the last op
                    if launch_async:
                        debt += self.issue_debt
                    else:
                        eng.run_until(eng.now + self.issue_debt)
                        if last:
                            self.issuing_s += self.issue_debt
                    self.issue_debt = 0.0
                if debt:
                    self.host_debt = 0.0
                    self._host_issue(debt, last)
                ready = eng.now
                if host_op:
                    # the host runs it (HostStep): no time on the compute stream
                    if last:
                        self.op_start[i] = self.op_end[i] = eng.now - self.window
                else:
                    waited = self.host_waited
                    recompute_s = self._run_chains(i, last) if chains is not None and i in chains else 0.0
                    self._before_op(i)
                    self._bring_in(self.op_tensors[i])
                    start = eng.now
                    # (what a chain's replay waited for the host is not the op's stall)
                    stall = start - ready - recompute_s - (self.host_waited - waited)
                    if launch_async and stall > 1e-12 and start > self.host_t:
                        self.host_t = start  # the host resolved the stall before issuing the op
                    eng.run_until(start + durations[i])
                    if last:
                        w = self.window
                        self.op_start[i], self.op_end[i] = start - w, eng.now - w
                        self.op_stall[i] = stall
                        if recompute_s:
                            self.op_recompute[i] = recompute_s
                    for t in self.op_tensors[i]:
                        if t in self.lru:
                            self.lru.move_to_end(t)
                    self.pinned = set()
                    self._after_op(i)
                for t in self.dies.get(i, ()):
                    self._die(t)
                if lev is not None:
                    self._after_op_levers(i)
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

    def _host_issue(self, cost: float, last: bool) -> None:
        """The dispatching thread spends ``cost`` seconds before the compute stream's
        next op: on the stream itself (CPU mode), or on the host timeline, which the
        stream waits for only where the host is behind it (``async_launch``)."""
        eng = self.engines
        if self.launch_async:
            self.host_t += cost
            wait = self.host_t - eng.now
            if wait <= 0:
                return
        else:
            wait = cost
        eng.run_until(eng.now + wait)
        self.host_waited += wait
        if last:
            self.host_wait_s += wait

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

    def _bring_in(self, needed: tuple[int, ...], pins: set[int] | None = None) -> None:
        """Have every tensor of ``needed`` on the device (births allocated, the away
        fetched on demand, the in flight arrived); ``pins`` (default: ``needed``) are
        never chosen as eviction victims meanwhile."""
        self.pinned = set(needed) if pins is None else pins
        state, eng = self.state, self.engines
        # parameters a host step is updating: their use waits for the update
        stale, updating = self.stale, self.updating
        waiting = bool(stale or updating)
        while True:
            for t in needed:
                s = state[t]
                if s == RESIDENT and not waiting:
                    continue
                if waiting and (t in stale or t in updating):
                    continue  # not faulted in before its update is done: rescanned below
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
                if waiting and (t in stale or t in updating):
                    in_flight = True
                    continue
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
            if waiting:
                waiting = bool(stale or updating)
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
        elif s == DROPPED:  # (a recompute that re-creates it for no later use)
            self.state[t] = UNBORN
        else:  # in flight at its death: only a plan that moves a dead tensor gets here
            raise SimulationError(f"tensor {t} dies while a transfer of it is in flight")

    # -- recompute and host steps ----------------------------------------------------------
    def _run_chains(self, b: int, last: bool) -> float:
        """Run the recompute chains due before op ``b`` on the compute stream; return
        the seconds their ops computed (time waiting for room or inputs is stall)."""
        eng = self.engines
        state, size = self.state, self.size
        computed = 0.0
        for chain in self.lev.chains[b]:
            t0 = eng.now
            pins = set(chain.reads)
            temps = 0
            for step in chain.steps:
                for x in step.reads:
                    if state[x] in (UNBORN, DROPPED):
                        raise SimulationError(
                            f"recompute {chain.index} (before op {b}): op {step.op} reads tensor {x}, "
                            f"which is not there ({'dropped' if state[x] == DROPPED else 'not live'})"
                        )
                self._bring_in(step.reads, pins)
                for t in step.kept:
                    if state[t] != DROPPED:
                        raise SimulationError(f"recompute {chain.index} (before op {b}): tensor {t} "
                                              f"was not dropped, yet the chain re-creates it")
                    self._wait_room(size[t], self._chain_short(chain, size[t]))
                    state[t] = RESIDENT
                    self.lru[t] = None
                    pins.add(t)
                    self._alloc(self.dev, size[t])
                if step.temps:
                    self._wait_room(step.temps, self._chain_short(chain, step.temps))
                    temps += step.temps
                    self._alloc(self.dev, step.temps)
                self.demand_waiting = False
                if self.replay_cost:
                    self._host_issue(self.replay_cost, last)
                eng.run_until(eng.now + step.duration_s)
                computed += step.duration_s
                if step.frees:  # (temporaries no later step reads)
                    temps -= step.frees
                    self._free(self.dev, step.frees)
            if temps:
                self._free(self.dev, temps)
            if last:
                w = self.window
                self.recompute_log.append(RecomputeRecord(chain.index, b, len(chain.steps), t0 - w, eng.now - w))
        self.pinned = set()
        return computed

    def _chain_short(self, chain: Chain, need: int) -> str:
        return (
            f"recompute {chain.index} (before op {chain.before_op}) needs {need} more bytes on {self.dev} "
            f"with {self.used[self.dev]:.0f} held by what it cannot evict: the budget of "
            f"{self.cap[self.dev]:.0f} bytes is too small for it"
        )

    def _after_op_levers(self, i: int) -> None:
        """Drop what recomputes drop after op ``i``; send host-stepped gradients home."""
        lev = self.lev
        for t in lev.drops.get(i, ()):
            if self.state[t] != RESIDENT:
                raise SimulationError(f"tensor {t} is to be dropped after op {i}, but it is not on {self.dev}")
            self.lru.pop(t, None)
            self.state[t] = DROPPED
            self._free(self.dev, self.size[t])
        for h in lev.grad_out.get(i, ()):
            g = h.grad
            if self.state[g] != RESIDENT:
                raise SimulationError(f"host step of tensor {h.param}: its gradient {g} is not on {self.dev} "
                                      f"after its last backward op {i}")
            self.state[g] = OUTGOING
            self.lru.pop(g, None)
            self.outgoing += self.size[g]
            self.stale.add(h.param)  # (its buffer on h.tier is held for good)
            self.host_debt += self.step_issue_cost  # (paid before the next op)
            f = self.engines.submit(g, self.size[g], self.dev, h.tier, "host_grad", self._grad_landed)
            f.extra["param"] = h.param

    def _grad_landed(self, f: Flow) -> None:
        g = f.tensor
        self.outgoing -= f.nbytes
        self.state[g] = UNBORN
        p = f.extra["param"]
        self.engines.submit_work(p, self.lev.work_bytes[p], "host_step", self._host_done)
        self._free(self.dev, f.nbytes)

    def _host_done(self, f: Flow) -> None:
        p = f.tensor
        self.stale.discard(p)
        if self.state[p] in (RESIDENT, INCOMING):
            # the updated values overwrite the device copy in place; its use waits
            h = self.host_of[p]
            self.updating.add(p)
            self.held[p] = self.held.get(p, 0) + 1
            self.engines.submit(p, self.size[p], h.tier, self.dev, "host_param", self._param_landed)
        else:
            # away (or leaving): the update lands in its off-device copy, which a
            # prefetch or fault now may bring
            self._pump()

    def _param_landed(self, f: Flow) -> None:
        p = f.tensor
        self.updating.discard(p)
        self.held[p] -= 1
        if not self.held[p]:
            del self.held[p]

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
            if f.issue_s >= w and f.kind not in _HOST_KINDS
        ]
        transfers.sort(key=_BY_ISSUE_THEN_TENSOR)
        memory = {}
        for tier, log in self.mem_log.items():
            arr = np.array(log, dtype=np.float64).reshape(-1, 2)
            memory[tier] = (arr[:, 0] - w, arr[:, 1])
        # The stream runs ops back to back, so the iteration is its op time plus its
        # stalls; summing exactly keeps a stall-free run at exactly the ideal time.
        stall_s = math.fsum(self.op_stall.tolist())
        time_s = self.trace.ideal_s + stall_s + self.issuing_s + self.host_wait_s
        levers: dict = {}
        if self.lev is not None:
            # the stream also ran the chains and no longer runs the host-stepped ops
            recompute_s = math.fsum(self.op_recompute.tolist())
            time_s = time_s + recompute_s - self.lev.host_op_s
            host = sorted(
                (HostStepRecord(f.tensor, f.nbytes, f.issue_s - w, f.start_s - w, f.end_s - w)
                 for f in flows if f.kind in _HOST_KINDS and f.issue_s >= w),
                key=lambda r: (r.issue_s, r.param),
            )
            levers = dict(
                recompute_s=recompute_s,
                recompute_ops=sum(r.ops for r in self.recompute_log),
                recomputes=list(self.recompute_log),
                host_step_s=self.lev.host_step_s,
                host_op_s=self.lev.host_op_s,
                host_step_bytes=sum(r.nbytes for r in transfers if r.kind in ("host_grad", "host_param")),
                host_steps=host,
            )
        return SimResult(
            policy=self.plan.policy,
            trace=self.trace.name,
            hardware=self.hw.name,
            time_s=time_s,
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
            issuing_s=self.issuing_s,
            host_wait_s=self.host_wait_s,
            transfers=transfers,
            memory=memory,
            **levers,
        )

    def failed(self, reason: str) -> SimResult:
        res = SimResult.unplanned(self.plan.policy, self.trace, self.hw, reason)
        res.budget_bytes = self.plan.budget_bytes
        return res
