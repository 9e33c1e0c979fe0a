"""The copy engines: transfers as fluid flows over shared links, buses and tiers.

Every (source tier, destination tier) pair has one copy engine that serves its transfers
in order (as a CUDA copy stream does). Demand faults are not queued: a fault is
serviced when it happens, as a UVM driver services faults in batches, not behind the
prefetches and evictions already queued on that pair nor behind other faults (their
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
        self._routes: dict[tuple[str, str], tuple[tuple[int, ...], tuple[str, ...], float]] = {}
        self._queues: dict[tuple, deque[Flow]] = {}  # (src, dst), or (src, dst, n) for fault n
        self._faults = 0
        self.active: list[Flow] = []  # heads of the queues
        self.window_start = math.inf  # traffic is counted from here on
        self.traffic: dict[str, float] = {link.name: 0.0 for link in hw.links}
        self.done: list[Flow] = []

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
        res, links, latency = self.route(src, dst)
        if not res:
            raise ValueError(f"no route from {src} to {dst} on {self.hw.name}")
        f = Flow(tensor, nbytes, src, dst, kind, self.now, latency + extra_latency, res, links, on_done)
        f.remaining = float(nbytes)
        if kind == "fault":
            self._faults += 1
            key: tuple = (src, dst, self._faults)
        else:
            key = (src, dst)
        f.extra["queue"] = key
        q = self._queues.setdefault(key, deque())
        q.append(f)
        if len(q) == 1:
            self._activate(f)
            self._reshare()
        return f

    def _activate(self, f: Flow) -> None:
        f.ready_s = self.now + f.latency_s
        self.active.append(f)
        if f.latency_s <= 0:
            f.moving, f.start_s = True, self.now

    # -- time ---------------------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self.active)

    def next_event(self) -> float:
        t = math.inf
        for f in self.active:
            if not f.moving:
                t = min(t, f.ready_s)
            elif f.rate > 0:
                t = min(t, self.now + f.remaining / f.rate)
        return t

    def _advance(self, t: float) -> None:
        dt = t - self.now
        if dt > 0:
            counted = max(0.0, t - max(self.now, self.window_start))
            for f in self.active:
                if f.moving and f.rate > 0:
                    f.remaining -= f.rate * dt
                    if counted > 0:
                        moved = f.rate * counted
                        for name in f.links:
                            self.traffic[name] += moved
        self.now = max(self.now, t)

    def step(self) -> None:
        """Advance to the next event and process everything that happens then."""
        t = self.next_event()
        if t == math.inf:
            raise RuntimeError("copy engines idle: nothing to wait for")
        self._advance(t)
        finished = []
        for f in self.active:
            if not f.moving and f.ready_s <= self.now:
                f.moving, f.start_s = True, self.now
                if f.remaining <= _EPS_BYTES:
                    finished.append(f)
            elif f.moving and (f.remaining <= _EPS_BYTES or (f.rate > 0 and f.remaining / f.rate <= 1e-12 * max(1.0, self.now))):
                finished.append(f)
        for f in finished:
            self._finish(f)
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
        elif len(key) == 3:
            del self._queues[key]  # a fault's own queue

    def run_until(self, t: float) -> None:
        """Process every event up to time ``t``, then move the clock to ``t``."""
        while self.active and self.next_event() <= t:
            self.step()
        self._advance(t)

    # -- bandwidth sharing --------------------------------------------------------------
    def _reshare(self) -> None:
        """Max-min fair rates by progressive filling over the shared resources."""
        moving = [f for f in self.active if f.moving]
        for f in self.active:
            f.rate = 0.0
        if not moving:
            return
        cap = {r: self._cap[r] for f in moving for r in f.resources}
        users: dict[int, list[Flow]] = {}
        for f in moving:
            for r in f.resources:
                users.setdefault(r, []).append(f)
        unfixed = set(moving)
        while unfixed:
            best_r, best_share = None, math.inf
            for r, fs in users.items():
                n = sum(1 for f in fs if f in unfixed)
                if n:
                    share = cap[r] / n
                    if share < best_share:
                        best_r, best_share = r, share
            if best_r is None:
                break
            for f in [f for f in users[best_r] if f in unfixed]:
                f.rate = best_share
                unfixed.discard(f)
                for r in f.resources:
                    cap[r] = max(0.0, cap[r] - best_share)
