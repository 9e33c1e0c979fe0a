"""The copy engines: transfers as fluid flows over shared links, buses and tiers.

The device has one copy engine per link that leaves or enters it, and it serves the
transfers over that link in order (as a CUDA copy stream does). A transfer whose route
is staged through another tier (a GPU without GPUDirect Storage reaches its SSD through
host memory: the GPU copies to a host buffer, the host writes it out) queues on the
engine of its device-side link, behind host-memory copies, as the GPU copy engine
serves both; where the SSD has its own link to the device it has its own engine. So
an eviction's queue does not depend on which tier behind that link it goes to, only on
the link. A staged transfer holds its engine until its last byte has reached the SSD
(or the device): the pessimistic end for a runtime with plenty of pinned staging
memory, whose copies could run ahead of the SSD, and the right one for tierflow's
runtime, which stages through a bounce buffer of at most 256 MiB on one copy stream
and waits for the SSD once that is full. Demand faults are not queued: a fault is
serviced when it happens, as a UVM driver services faults in batches, not behind the
prefetches and evictions already queued on that engine nor behind other faults (their
latencies overlap). A transfer at the head of an engine, and every fault, first waits
out its latency, then moves bytes. All moving transfers share bandwidth max-min
fairly over the resources they cross: each link of their route, each bus those links
declare, the source tier's read bandwidth and the destination tier's write bandwidth.
Rates change only when a transfer starts or ends, so the engine advances from event to
event and is exact for this model.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..hardware import Hardware

_EPS_BYTES = 1e-3
HOST_COMPUTE = "host-compute"  # the resource and queue of host-side optimizer updates


@dataclass(eq=False, slots=True)
class Flow:
    """One transfer in flight or queued."""

    tensor: int
    nbytes: int
    src: str
    dst: str
    kind: str  # evict | prefetch | fault
    issue_s: float
    latency_s: float
    resources: tuple[int, ...]
    links: tuple[str, ...]
    on_done: Callable[[Flow], None] | None = None
    start_s: float = math.nan  # when its bytes start moving (after latency)
    end_s: float = math.nan
    remaining: float = 0.0
    rate: float = 0.0
    ready_s: float = math.inf  # latency over
    moving: bool = False
    extra: dict = field(default_factory=dict)


class CopyEngines:
    """Event-driven fluid model of all transfers on one machine."""

    def __init__(self, hw: Hardware):
        self.hw = hw
        self.now = 0.0
        self._cap: list[float] = []
        self._res_index: dict[str, int] = {}
        for link in hw.links:
            self._resource(f"link:{link.name}", link.bandwidth)
        for bus, bw in hw.buses.items():
            self._resource(f"bus:{bus}", bw)
        for tier in hw.tiers:
            if tier.read_bw != math.inf:
                self._resource(f"read:{tier.name}", tier.read_bw)
            if tier.write_bw != math.inf:
                self._resource(f"write:{tier.name}", tier.write_bw)
        if hw.host_compute is not None:
            # the host's optimizer updates (HostStep): one FIFO stream of its own, a
            # "transfer" of the bytes an update processes at the host's rate
            self._resource(HOST_COMPUTE, hw.host_compute.optimizer_bytes_per_s)
        self._routes: dict[tuple[str, str], tuple[tuple[int, ...], tuple[str, ...], float]] = {}
        self._engine: dict[tuple[str, str], tuple] = {}  # (src, dst) -> its engine's queue key
        # one queue per engine (see the module docstring), and one per fault ("fault", n)
        self._queues: dict[tuple, deque[Flow]] = {}
        self._faults = 0
        self.active: list[Flow] = []  # heads of the queues
        self.window_start = math.inf  # traffic is counted from here on
        self.traffic: dict[str, float] = {link.name: 0.0 for link in hw.links}
        self.done: list[Flow] = []
        # Max-min rates depend only on the resources of the moving flows, in order (see
        # _maxmin), and the same few routes recur all the time: remember each answer.
        self._rates_memo: dict[tuple[tuple[int, ...], ...], tuple[float, ...]] = {}

    def _resource(self, name: str, cap: float) -> None:
        self._res_index[name] = len(self._cap)
        self._cap.append(cap)

    def route(self, src: str, dst: str) -> tuple[tuple[int, ...], tuple[str, ...], float]:
        key = (src, dst)
        if key not in self._routes:
            path = self.hw.route(src, dst)
            if not path:
                self._routes[key] = ((), (), math.inf)
            else:
                names = [f"link:{link.name}" for link in path]
                names += [f"bus:{b}" for link in path for b in link.buses]
                names += [f"read:{src}", f"write:{dst}"]
                res = tuple(sorted({self._res_index[n] for n in names if n in self._res_index}))
                self._routes[key] = (res, tuple(link.name for link in path), self.hw.route_latency(src, dst))
                dev = self.hw.device
                if path[0].src == dev:
                    self._engine[key] = ("engine", path[0].name)
                elif path[-1].dst == dev:
                    self._engine[key] = ("engine", path[-1].name)
                else:  # a route that does not touch the device: an engine of its own
                    self._engine[key] = ("engine", src, dst)
        return self._routes[key]

    def reachable(self, src: str, dst: str) -> bool:
        return bool(self.route(src, dst)[0])

    # -- issuing ------------------------------------------------------------------------
    def submit(
        self,
        tensor: int,
        nbytes: int,
        src: str,
        dst: str,
        kind: str,
        on_done: Callable[[Flow], None] | None,
        extra_latency: float = 0.0,
    ) -> Flow:
        route = self._routes.get((src, dst))
        res, links, latency = route if route is not None else self.route(src, dst)
        if not res:
            raise ValueError(f"no route from {src} to {dst} on {self.hw.name}")
        f = Flow(tensor, nbytes, src, dst, kind, self.now, latency + extra_latency, res, links, on_done)
        f.remaining = float(nbytes)
        if kind == "fault":
            self._faults += 1
            key: tuple = ("fault", self._faults)
        else:
            key = self._engine[(src, dst)]
        f.extra["queue"] = key
        q = self._queues.get(key)
        if q is None:  # (not setdefault: that would build a deque for every transfer)
            q = self._queues[key] = deque()
        q.append(f)
        if len(q) == 1 and self._activate(f):
            # a flow that first waits out a latency moves nothing yet: the rates of the
            # others stay as they are, so sharing is redone only when it starts moving
            self._reshare()
        return f

    def submit_work(self, tensor: int, nbytes: int, kind: str, on_done: Callable[[Flow], None] | None) -> Flow:
        """Queue ``nbytes`` of work on the host-compute stream (FIFO, one at a time, at
        the hardware's ``host_compute`` rate); it crosses no link."""
        res = self._res_index[HOST_COMPUTE]
        f = Flow(tensor, nbytes, HOST_COMPUTE, HOST_COMPUTE, kind, self.now, 0.0, (res,), (), on_done)
        f.remaining = float(nbytes)
        key = ("engine", HOST_COMPUTE)
        f.extra["queue"] = key
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = deque()
        q.append(f)
        if len(q) == 1 and self._activate(f):
            self._reshare()
        return f

    def _activate(self, f: Flow) -> bool:
        """Put ``f`` at the head of its engine; True if its bytes start moving now."""
        f.ready_s = self.now + f.latency_s
        self.active.append(f)
        if f.latency_s <= 0:
            f.moving, f.start_s = True, self.now
            return True
        return False

    # -- time ---------------------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self.active)

    def next_event(self) -> float:
        t = math.inf
        now = self.now
        for f in self.active:
            if not f.moving:
                if f.ready_s < t:
                    t = f.ready_s
            elif f.rate > 0:
                e = now + f.remaining / f.rate
                if e < t:
                    t = e
        return t

    def _advance(self, t: float) -> None:
        now = self.now
        dt = t - now
        if dt > 0:
            # max(0.0, t - max(now, window_start)), without two calls at every event
            ws = self.window_start
            counted = t - (ws if ws > now else now)
            if not counted > 0.0:
                counted = 0.0
            traffic = self.traffic
            for f in self.active:
                rate = f.rate
                if rate > 0 and f.moving:
                    f.remaining -= rate * dt
                    if counted > 0:
                        moved = rate * counted
                        for name in f.links:
                            traffic[name] += moved
            self.now = t
        # (dt <= 0: the clock never goes back)

    def step(self, t: float | None = None) -> None:
        """Advance to the next event and process everything that happens then.

        ``t`` is :meth:`next_event` when the caller has just computed it."""
        if t is None:
            t = self.next_event()
        if t == math.inf:
            raise RuntimeError("copy engines idle: nothing to wait for")
        self._advance(t)
        now = self.now
        close = 1e-12 * (now if now > 1.0 else 1.0)  # 1e-12 * max(1.0, now)
        finished = []
        started = False
        for f in self.active:
            if not f.moving:
                if f.ready_s <= now:
                    f.moving, f.start_s = True, now
                    started = True
                    if f.remaining <= _EPS_BYTES:
                        finished.append(f)
            elif f.remaining <= _EPS_BYTES or (f.rate > 0 and f.remaining / f.rate <= close):
                finished.append(f)
        for f in finished:
            self._finish(f)
        if finished or started:
            # nothing started or ended (an event that rounding left a hair short): the
            # rates are those of the same moving flows, so there is nothing to redo
            self._reshare()
        for f in finished:
            if f.on_done is not None:
                f.on_done(f)

    def _finish(self, f: Flow) -> None:
        f.remaining, f.end_s = 0.0, self.now
        self.active.remove(f)
        self.done.append(f)
        key = f.extra["queue"]
        q = self._queues[key]
        q.popleft()
        if q:
            self._activate(q[0])
        elif key[0] == "fault":
            del self._queues[key]  # a fault's own queue

    def run_until(self, t: float) -> None:
        """Process every event up to time ``t``, then move the clock to ``t``."""
        while self.active:
            e = self.next_event()
            if e > t:
                break
            self.step(e)
        self._advance(t)

    # -- bandwidth sharing --------------------------------------------------------------
    def _reshare(self) -> None:
        """Give every active flow its max-min fair rate (0 until it moves)."""
        # A flow that is not moving has rate 0 already: it got 0.0 when created and
        # only moving flows are given rates; once moving it moves until it is done.
        moving = [f for f in self.active if f.moving]
        if not moving:
            return
        key = tuple([f.resources for f in moving])
        rates = self._rates_memo.get(key)
        if rates is None:
            if len(self._rates_memo) >= 65536:
                self._rates_memo.clear()  # bound the memory of a pathological trace
            rates = self._rates_memo[key] = self._maxmin(key)
        for f, r in zip(moving, rates):
            f.rate = r

    def _maxmin(self, routes: tuple[tuple[int, ...], ...]) -> tuple[float, ...]:
        """Max-min fair rates, by progressive filling, of flows crossing ``routes``.

        The answer (every float of it) depends only on ``routes`` in this order: ties
        between equally tight resources go to the first one met, flow by flow."""
        rate = [0.0] * len(routes)
        if len(routes) == 1:
            # one flow: the tightest of its resources (the filling below, in one round;
            # it fixes nothing when every resource is unbounded)
            tight = min(self._cap[r] for r in routes[0])
            rate[0] = tight if tight < math.inf else 0.0
            return tuple(rate)
        cap = {r: self._cap[r] for res in routes for r in res}
        users: dict[int, list[int]] = {}
        for i, res in enumerate(routes):
            for r in res:
                users.setdefault(r, []).append(i)
        unfixed = set(range(len(routes)))
        while unfixed:
            best_r, best_share = None, math.inf
            for r, fs in users.items():
                n = sum(1 for i in fs if i in unfixed)
                if n:
                    share = cap[r] / n
                    if share < best_share:
                        best_r, best_share = r, share
            if best_r is None:
                break
            for i in [i for i in users[best_r] if i in unfixed]:
                rate[i] = best_share
                unfixed.discard(i)
                for r in routes[i]:
                    cap[r] = max(0.0, cap[r] - best_share)
        return tuple(rate)
