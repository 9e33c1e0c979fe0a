"""One greedy pass of ``tierflow``'s move planner (:func:`greedy_moves`, for one
setting of the :class:`Knobs`): which idle gaps leave the device, when and to which tier.

1. **What must leave.** At each op the bytes live beyond the budget (less a margin) must
   be off the device. Candidates are every idle gap of every tensor — activations,
   gradients, weights, optimizer state — including a persistent tensor's gap that wraps
   the iteration boundary.
2. **Which gaps.** Ops are swept in order; while an op is over the line, the gap covering
   it whose tensor is needed furthest in the future (Belady's choice: it relieves memory
   for longest per byte moved) and whose transfers fit the bandwidth timeline is taken.
   Gaps smaller than ``min_bytes`` are left out (their transfers cost more latency
   than they free) except by the fallback plan (``Knobs(safe=True)``).
3. **When and where.** Each route (device to host, to SSD, ...) reserves bytes per op
   slot on every resource it crosses (links, shared buses, tier bandwidth), as the
   simulator shares them; an eviction is packed as early as possible after the last use,
   a prefetch as late as possible before the next ("just in time"). The destination is
   the first tier whose capacity holds the tensor over the gap and whose transfers fit;
   gaps long enough for a slow tier (``ssd_slack`` times its round trip) try the slowest
   tier first so the fast one stays free for short gaps.

The pass is a bottom layer of the policy: it imports no other module of it. The move-only
pipeline (:mod:`.moves`) uses it as its first seed, the joint planner (:mod:`.joint`) to
plan each lever variant's moves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...hardware import Hardware
from ...plan import Move
from ...trace import Trace


@dataclass(frozen=True)
class Knobs:
    """One setting of the planner's trade-offs.

    Attributes:
        efficiency: share of each resource's bandwidth the packer assumes (lower leaves
            slack for the simulator's fair sharing and FIFO engines, at the cost of
            fewer gaps fitting).
        margin: share of the budget kept free (absorbs evictions still in flight).
        lead: extra op slots each prefetch is issued early (more lead, more memory).
    """

    efficiency: float = 0.9
    margin: float = 0.0
    lead: int = 0
    safe: bool = False  # plan by the validator's accounting only (no bandwidth packing)


@dataclass
class _Gap:
    tensor: int
    a: int  # last use before the gap
    b: int  # next use, unrolled: b + n when the gap wraps
    size: int


class _Timeline:
    """Bytes each resource can still carry in each op slot (cyclic over the iteration).

    Queries outnumber bookings by far (every candidate gap of every op over the line is
    tried; on a 9,000-op trace about 240,000 tries for 1,000 bookings), so each route
    keeps what it can carry per slot (the least of its resources) as a prefix sum over
    two unrolled iterations: a try is two binary searches, and only a booking touches
    whole arrays."""

    def __init__(self, trace: Trace, hw: Hardware, efficiency: float):
        self.n = trace.n_ops
        dur = trace.durations
        self.routes: dict[tuple[str, str], list[int]] = {}
        names: dict[str, float] = {}
        for tier in hw.offload_tiers:
            for src, dst in ((hw.device, tier), (tier, hw.device)):
                res = []
                for link in hw.route(src, dst):
                    names[f"link:{link.name}"] = link.bandwidth
                    res.append(f"link:{link.name}")
                    for b in link.buses:
                        names[f"bus:{b}"] = hw.buses[b]
                        res.append(f"bus:{b}")
                for key, bw in ((f"read:{src}", hw.tier(src).read_bw), (f"write:{dst}", hw.tier(dst).write_bw)):
                    if bw != math.inf:
                        names[key] = bw
                        res.append(key)
                self.routes[(src, dst)] = sorted(set(res))
        order = sorted(names)
        self.index = {k: i for i, k in enumerate(order)}
        self.rem = np.array([names[k] * dur * efficiency for k in order]).reshape(len(order), self.n)
        self.route_idx = {k: [self.index[r] for r in v] for k, v in self.routes.items()}
        self.avail: dict[tuple[str, str], np.ndarray] = {}
        self.prefix: dict[tuple[str, str], np.ndarray] = {}
        for key in self.route_idx:
            self._refresh(key)

    def _refresh(self, key) -> None:
        """Recompute a route's per-slot capacity and its prefix sum (2 unrolled
        iterations: prefix[j] = bytes slots 0..j-1 can carry)."""
        rows = self.route_idx[key]
        a = self.rem[rows].min(axis=0) if rows else np.zeros(self.n)
        a = np.maximum(a, 0.0)
        self.avail[key] = a
        self.prefix[key] = np.concatenate([[0.0], np.cumsum(np.concatenate([a, a, a]))])

    def _takes(self, key, lo: int, hi: int, nbytes: float, last_at_end: bool) -> np.ndarray:
        """What slots lo..hi (unrolled, inclusive) give to carry ``nbytes``: all they
        have, less the excess taken from the last slot filled (``hi`` when packing
        forward, ``lo`` when packing backward)."""
        takes = self.avail[key][np.arange(lo, hi + 1) % self.n].copy()
        excess = takes.sum() - nbytes
        if last_at_end:
            takes[-1] -= excess
        else:
            takes[0] -= excess
        return np.maximum(takes, 0.0)

    def forward(self, key, start: int, stop: int, nbytes: float):
        """Pack ``nbytes`` into slots start..stop-1 (unrolled) as early as possible.
        Returns (last slot used, first slot used, booking) or None if it does not fit."""
        if stop <= start:
            return None
        P = self.prefix[key]
        tol = 1e-9 * nbytes + 1e-6
        target = P[start] + nbytes - tol
        if P[stop] < target:
            return None
        # last slot: the first j with P[j + 1] >= target
        last = int(np.searchsorted(P, target, side="left")) - 1
        last = max(last, start)
        # first slot that carries anything
        first = int(np.searchsorted(P, P[start], side="right")) - 1
        first = min(max(first, start), last)
        idx = np.arange(first, last + 1)
        takes = self._takes(key, first, last, nbytes, True)
        return last, first, (key, idx % self.n, takes)

    def backward(self, key, stop: int, start: int, nbytes: float):
        """Pack ``nbytes`` into slots stop-1 down to start (unrolled) as late as possible.
        Returns (first slot used, booking) or None."""
        if stop <= start:
            return None
        P = self.prefix[key]
        tol = 1e-9 * nbytes + 1e-6
        target = P[stop] - nbytes + tol
        if P[start] > target:
            return None
        # first slot: the last j with P[j] <= target
        first = int(np.searchsorted(P, target, side="right")) - 1
        first = min(max(first, start), stop - 1)
        idx = np.arange(first, stop)
        takes = self._takes(key, first, stop - 1, nbytes, False)
        return first, (key, idx % self.n, takes)

    def commit(self, booking) -> None:
        key, idx, takes = booking
        rows = self.route_idx[key]
        for r in rows:
            np.subtract.at(self.rem[r], idx, takes)
        touched = set(rows)
        for other, orows in self.route_idx.items():
            if touched & set(orows):
                self._refresh(other)


def _gaps(trace: Trace) -> list[_Gap]:
    n = trace.n_ops
    out = []
    for g in trace.gaps:
        size = int(trace.sizes[g.tensor])
        if size <= 0:
            continue
        out.append(_Gap(g.tensor, g.after_op, g.before_op + (n if g.wraps else 0), size))
    return out


def greedy_moves(
    trace: Trace, hw: Hardware, budget: float, knobs: Knobs, opts: dict, drop: np.ndarray | None = None
) -> list[Move]:
    """One greedy pass (steps 1-3 of the module docstring). ``drop`` lowers the line per
    op (bytes), where the closed loop found the simulated step stalling."""
    n = trace.n_ops
    if n == 0:
        return []
    dev = hw.device
    live = trace.live_bytes.astype(np.float64)
    line = np.full(n, budget * (1.0 - knobs.margin))
    if drop is not None:
        # never below what the op itself needs: that much cannot leave
        line = np.maximum(line - drop, np.minimum(line, trace.working_set_bytes.astype(np.float64)))
    # gaps below min_bytes cost more in latency than they free; the validator-only
    # fallback (knobs.safe) still takes them when nothing else can make room
    small_bytes = 0 if knobs.safe else int(opts.get("min_bytes", 2**20))
    gaps = [g for g in _gaps(trace) if g.size >= small_bytes]
    if not gaps or not (live > line).any():
        return []
    tl = _Timeline(trace, hw, knobs.efficiency)
    tiers = list(hw.offload_tiers)
    tier_used = {T: np.zeros(n) for T in tiers}
    tier_cap = {T: hw.tier(T).capacity for T in tiers}
    fast = {T: hw.route_bandwidth(dev, T) for T in tiers}
    slack = float(opts.get("ssd_slack", 4.0))
    A = np.array([g.a for g in gaps])
    Bu = np.array([g.b for g in gaps])
    size = np.array([g.size for g in gaps], dtype=np.float64)
    taken = np.zeros(len(gaps), dtype=bool)
    window: dict[int, list] = {}  # gap -> [first op off, last op off, prefetch move index, tier]
    off = np.zeros(n)
    starts = np.concatenate([trace.op_start_s, trace.op_start_s[1:] + trace.ideal_s])  # unrolled
    moves: list[Move] = []
    fastest = max(fast.values()) if fast else 0.0

    def cover(lo: int, hi: int, arr: np.ndarray, amount: float) -> None:
        """Add ``amount`` to arr over unrolled ops lo..hi inclusive."""
        if hi < lo:
            return
        idx = np.arange(lo, hi + 1) % n
        np.add.at(arr, idx, amount)

    for k in range(n):
        over = live[k] - off[k] - line[k]
        if over <= 0:
            continue
        # gaps covering op k (in this iteration, or wrapping from the previous one)
        cand = np.flatnonzero(~taken & (((A < k) & (Bu > k)) | ((A < k + n) & (Bu > k + n))))
        ku = np.where(Bu[cand] > k + n, k + n, k)  # k unrolled into each gap's frame
        ku = np.where((A[cand] < k) & (Bu[cand] > k), k, ku)
        # Belady: furthest next use first; ties by larger size, then id
        order = np.lexsort((cand, -size[cand], -(Bu[cand] - ku), size[cand] < small_bytes))
        for j in order:
            if over <= 0:
                break
            i = int(cand[j])
            g = gaps[i]
            kk = int(ku[j])
            length = starts[g.b] - starts[g.a + 1]
            tier_order = list(tiers)
            if len(tiers) > 1:
                slow = [T for T in tiers if fast[T] < fastest]
                if any(length >= slack * 2 * g.size / fast[T] for T in slow):
                    tier_order = sorted(tiers, key=lambda T: fast[T])
            for T in tier_order if not knobs.safe else ():
                ev = tl.forward((dev, T), g.a + 1, kk, g.size)
                if ev is None:
                    continue
                q, e0, ev_book = ev
                e = e0 - 1  # issue the eviction when its bytes can start moving (FIFO)
                pf = tl.backward((T, dev), g.b, kk + 1, g.size)
                if pf is None:
                    continue
                f, pf_book = pf
                p = max(kk, f - 1 - knobs.lead)  # prefetch issued after op p (unrolled)
                # the destination holds it from op a+1 to op p (as the validator counts)
                if tier_cap[T] != math.inf:
                    idx = np.arange(e + 1, p + 1) % n
                    if (tier_used[T][idx] + g.size > tier_cap[T]).any():
                        continue
                    np.add.at(tier_used[T], idx, g.size)
                tl.commit(ev_book)
                tl.commit(pf_book)
                cover(q + 1, p, off, g.size)
                taken[i] = True
                window[i] = [q + 1, p, len(moves) + 1, T, e]
                moves.append(Move("evict", g.tensor, e % n, T))
                moves.append(Move("prefetch", g.tensor, p % n, T, g.b % n))
                over = live[k] - off[k] - line[k]
                break
        if over > 0:
            # Bandwidth cannot hide what is left: take the furthest-used gaps anyway (the
            # step will stall, but the plan fits), evicting at once and fetching back
            # right after op k.
            for j in order:
                if over <= 0:
                    break
                i = int(cand[j])
                if taken[i]:
                    continue
                g = gaps[i]
                kk = int(ku[j])
                for T in tiers:
                    if tier_cap[T] != math.inf:
                        idx = np.arange(g.a + 1, kk + 1) % n
                        if (tier_used[T][idx] + g.size > tier_cap[T]).any():
                            continue
                        np.add.at(tier_used[T], idx, g.size)
                    # fetch back just in time (by the ideal clock), not before op k
                    back = starts[g.b] - g.size / (fast[T] * knobs.efficiency)
                    p = max(kk, min(g.b - 1, int(np.searchsorted(starts, back, side="right")) - 2))
                    if tier_cap[T] != math.inf:
                        idx = np.arange(kk + 1, p + 1) % n
                        if (tier_used[T][idx] + g.size > tier_cap[T]).any():
                            p = kk
                        else:
                            np.add.at(tier_used[T], idx, g.size)
                    ev = tl.forward((dev, T), g.a + 1, g.b, g.size)
                    if ev is not None:
                        tl.commit(ev[2])
                    pf = tl.backward((T, dev), g.b, p + 1, g.size)
                    if pf is not None:
                        tl.commit(pf[1])
                    cover(g.a + 1, p, off, g.size)
                    taken[i] = True
                    window[i] = [g.a + 1, p, len(moves) + 1, T, g.a]
                    moves.append(Move("evict", g.tensor, g.a, T))
                    moves.append(Move("prefetch", g.tensor, p % n, T, g.b % n))
                    over = live[k] - off[k] - line[k]
                    break
        if over > 0:
            # Gaps already taken whose planned absence misses op k (their prefetch was
            # packed before k, or their eviction ends after it): hold them off through
            # op k, as the validator counts them.
            every = np.flatnonzero(((A < k) & (Bu > k)) | ((A < k + n) & (Bu > k + n)))
            ranked = sorted(every.tolist(), key=lambda i: (-(Bu[i] - A[i]), i))
            # first pass: cheap extensions; second: reissue late evictions (last resort,
            # it reorders the eviction queue)
            for i, last_resort in [(i, False) for i in ranked] + [(i, True) for i in ranked]:
                if over <= 0:
                    break
                if not taken[i]:
                    continue
                g = gaps[i]
                kk = k if A[i] < k < Bu[i] else k + n
                lo, hi, mi, T, e = window[i]
                if lo <= kk <= hi or (e >= kk and lo > kk) != last_resort:
                    continue
                if hi < kk:
                    # hold it off until just in time for its next use (by the ideal
                    # clock), so that the ops after k need not extend it again
                    back = starts[g.b] - g.size / (fast[T] * knobs.efficiency)
                    p = max(kk, min(g.b - 1, int(np.searchsorted(starts, back, side="right")) - 2))
                    dest = _room_for(tier_used, tier_cap, tiers, T, e + 1, hi, p, g.size, n)
                    if dest is None and p > kk:
                        p = kk
                        dest = _room_for(tier_used, tier_cap, tiers, T, e + 1, hi, p, g.size, n)
                    if dest is None:
                        continue
                    cover(hi + 1, p, off, g.size)
                    window[i][1], window[i][3] = p, dest
                    moves[mi - 1] = Move("evict", g.tensor, e % n, dest)
                    moves[mi] = Move("prefetch", g.tensor, p % n, dest, g.b % n)
                else:
                    # its eviction finishes after k (or was issued at k or later, behind
                    # others): issue it right after the last use, and count it off from
                    # there, as the validator does
                    if e >= kk:
                        ext = np.arange(g.a + 1, e + 1) % n
                        if tier_cap[T] != math.inf and (tier_used[T][ext] + g.size > tier_cap[T]).any():
                            continue
                        np.add.at(tier_used[T], ext, g.size)
                        e = g.a
                        window[i][4] = e
                        moves[mi - 1] = Move("evict", g.tensor, e % n, T)
                    cover(e + 1, lo - 1, off, g.size)
                    window[i][0] = e + 1
                over = live[k] - off[k] - line[k]
    return moves


def _room_for(used, cap, tiers, T, lo, hi, new_hi, size, n):
    """A tier that can hold a gap's tensor over ops lo..new_hi (unrolled) when its absence
    is extended from ..hi: its own tier ``T`` if it has room, else another (moving the
    gap's bookkeeping there). Returns the tier, or None."""
    ext = np.arange(hi + 1, new_hi + 1) % n
    if cap[T] == math.inf or not (used[T][ext] + size > cap[T]).any():
        np.add.at(used[T], ext, size)
        return T
    full = np.arange(lo, new_hi + 1) % n
    for T2 in tiers:
        if T2 != T and (cap[T2] == math.inf or not (used[T2][full] + size > cap[T2]).any()):
            np.add.at(used[T], np.arange(lo, hi + 1) % n, -size)
            np.add.at(used[T2], full, size)
            return T2
    return None


# The knob setting tierflow's own greedy pass uses (see :class:`Knobs`).
DEFAULT_KNOBS = Knobs(0.9, 0.0, 0)
