"""``g10``: G10's smart tensor migration (Zhang et al., MICRO 2023), as its public
simulator's planner does it, written for tierflow's trace and hardware.

The plan is made over *slots*: op ``i`` of the iteration is slot ``i`` and lasts the op's
time. Steps:

1. **Inactive periods.** Every gap between two consecutive uses of a tensor (a
   persistent tensor's gap wraps into the next iteration) is a candidate; its idle
   slots are the ops strictly between the two uses.
2. **Memory curve.** Bytes live in each slot (``Trace.live_bytes``: dead tensors are
   freed, new ones allocated at birth); the target line is ``line_share`` (0.99) of
   the device budget.
3. **Bandwidth budgets.** Each slot offers ``bandwidth x op time`` bytes in each of the
   four directions (device to and from the slow tier, the SSD, and the fast tier, host
   memory). A direction's budget is limited by every link and bus on its route, so SSD
   traffic also spends the PCIe budget it shares with host copies.
4. **Greedy selection.** While some slot is over the line, take the gap whose
   eviction would remove the most over-line area: ``size x time`` of the over-line
   slots between the point where half of its eviction has left (the out-budget filled
   forward from the gap's start) and the point where half of its prefetch has arrived
   (the in-budget filled backward from its end); ties go to the larger
   ``size x gap length``. Gaps of one idle op, and gaps whose slots are all under the
   line, are skipped.
5. **Destination.** The SSD if the gap is longer than ``2 (L + size/B) + delta (L +
   size/B)`` for the SSD's latency ``L`` (its own plus the fault latency) and bandwidth
   ``B``, less the time an on-demand round trip of the part that does not fit at the
   gap's start would cost (G10's over-subscription allowance); host memory instead if
   the SSD's out-budget is spent where the eviction would run and host memory has
   room. Otherwise host memory if the gap passes the same test with the host link's
   figures and host memory has room. The eviction finishes where the out-budget filled
   forward allows (slot ``e``); the prefetch starts where the in-budget filled backward
   allows (slot ``p``); the move is kept only if ``p > e`` (for the SSD, a prefetch
   that would start before the eviction ends is pushed to ``e + 1`` when that is
   cheaper than a fault, as G10 does). Then both budgets are spent and the curve is
   lowered on the slots between. Wrapping gaps (weights across the iteration boundary)
   are placed by time alone, as G10 places them.
6. **Prefetches moved earlier.** In order of their slot, each prefetch of a non-wrapping
   gap moves earlier one slot at a time while the curve there stays under the line.
7. **Leftovers.** The plan is *reactive*: the moves are hints to the on-demand pager,
   which faults in whatever they miss and evicts least recently used tensors, as G10
   runs on UVM. Dead tensors are freed (G10's pre-deallocation).

Options:
    line_share (float): the target line as a share of the budget (default 0.99). Lower
        leaves the pager more room for faults; higher moves less.
    delta (float): G10's safety margin on a move's time (default 0.5): a larger margin
        offloads fewer, longer gaps and prefetches earlier.
    bw_scale (float): factor on every bandwidth the planner assumes (default 1). G10's
        own planner reads "GB/s" as 2^30 B/s, i.e. ``bw_scale = 1.0737`` reproduces its
        optimism; 1 plans with the machine's real bandwidth.
    strict_line (bool): in step 6, a prefetch moves one slot earlier only if that slot
        stays under the line *with* the tensor back (default True). G10's code tests
        the slot before adding the tensor, which lets prefetches pile up over the line
        and leaves the pager no room for the faults it must still serve.
    g10_accounting (bool): plan with G10's own bookkeeping (default True), to
        reproduce the plan G10 ran: bandwidth read as GiB/s (``bw_scale`` 1.0737),
        ``strict_line`` off, and the first tensor counted twice in every slot of the
        memory curve, as analysis.cc's curve does. This is the policy as G10 published
        it; ``False`` plans with the machine's real figures instead (and, on SENet,
        lands further from G10's published ratio: see BENCHMARKS.md).
    headroom (float): share of the budget the pager keeps free (default 0, as G10's
        UVM keeps none beyond the 1% under its line).
    move_earlier (bool): step 6 (default True).
    second_pass (bool): after step 4 runs out of gaps with a reducible area, go on
        through the gaps that still span over-line slots, largest over-line area
        first (default False). G10's code goes on too, in an order its sort leaves
        undefined; without this pass the plan stops earlier and more is left to faults.

Example:
    >>> from tierflow.policies import make_plan
    >>> plan = make_plan("g10", trace, load_hardware("g10-a100"), budget="20GiB")  # doctest: +SKIP
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

import numpy as np

from ..hardware import Hardware
from ..plan import Move, Plan
from ..trace import Gap, Trace
from . import PolicyOption, PolicyOptions, register
from ._common import issue_order

OPTIONS = (
    PolicyOption("line_share", float, 0.99, "the target line as a share of the budget"),
    PolicyOption("delta", float, 0.5, "G10's safety margin on a move's time"),
    PolicyOption("bw_scale", float, None, "factor on every bandwidth assumed (default: 1.0737 with "
                 "g10_accounting, else 1)"),
    PolicyOption("strict_line", bool, None, "a prefetch moves earlier only if the slot stays under the line "
                 "with it (default: off with g10_accounting, else on)"),
    PolicyOption("g10_accounting", bool, True, "plan with G10's own bookkeeping, as published"),
    PolicyOption("headroom", float, 0.0, "share of the budget the pager keeps free"),
    PolicyOption("move_earlier", bool, True, "step 6: move prefetches earlier while under the line"),
    PolicyOption("second_pass", bool, False, "go on through gaps still over the line after the greedy pass"),
)


@dataclass(frozen=True, slots=True)
class _Tier:
    """Planner's view of one offload tier: route latency (with the fault latency, as
    G10 counts both), assumed bandwidth each way, and the budget keys of each way."""

    name: str
    latency_s: float
    bw_out: float
    bw_in: float
    out_res: tuple[str, ...]
    in_res: tuple[str, ...]

    def move_s(self, size: float) -> float:
        return self.latency_s + size / min(self.bw_out, self.bw_in)


@dataclass(slots=True)
class _Offload:
    """One accepted eviction of a non-wrapping gap, kept for step 6."""

    gap: Gap
    tier: str
    evict_done: int  # slot e: the eviction has left by the end of it
    prefetch_at: int  # slot p: the prefetch is issued as it starts


class _Budgets:
    """Per-slot bytes left on each link and bus (and tier bandwidth) of the machine."""

    def __init__(self, hw: Hardware, durations: np.ndarray, scale: float):
        self.hw = hw
        self.cap: dict[str, np.ndarray] = {}
        for link in hw.links:
            self.cap[f"link:{link.name}"] = link.bandwidth * scale * durations
        for bus, bw in hw.buses.items():
            self.cap[f"bus:{bus}"] = bw * scale * durations
        for t in hw.tiers:
            if t.read_bw != math.inf:
                self.cap[f"read:{t.name}"] = t.read_bw * scale * durations
            if t.write_bw != math.inf:
                self.cap[f"write:{t.name}"] = t.write_bw * scale * durations
        self.used = {k: np.zeros_like(v) for k, v in self.cap.items()}
        # ``avail`` of every slot per resource set, and its prefix sums, computed once
        # and brought up to date by ``spend``: the fills read them tens of thousands of
        # times, for a few thousand spends
        self._avail: dict[tuple[str, ...], np.ndarray] = {}
        self._prefix: dict[tuple[str, ...], np.ndarray] = {}
        # the fills' shortcut (``_tolerance``) holds only while every sum is finite: an
        # infinite bandwidth (allowed for a link) gives inf - inf = NaN in ``spend``
        self._finite = all(bool(np.isfinite(c).all()) for c in self.cap.values())

    def resources(self, src: str, dst: str) -> tuple[str, ...]:
        names = [f"link:{link.name}" for link in self.hw.route(src, dst)]
        names += [f"bus:{b}" for link in self.hw.route(src, dst) for b in link.buses]
        names += [f"read:{src}", f"write:{dst}"]
        return tuple(n for n in dict.fromkeys(names) if n in self.cap)

    def _left(self, res: tuple[str, ...], lo: int) -> np.ndarray:
        """Bytes each slot from ``lo`` on can still carry on every resource of ``res``."""
        out = self.cap[res[0]][lo:] - self.used[res[0]][lo:]
        for r in res[1:]:
            out = np.minimum(out, self.cap[r][lo:] - self.used[r][lo:])
        return np.maximum(out, 0.0)

    def _avail_all(self, res: tuple[str, ...]) -> np.ndarray:
        """Bytes each slot can still carry on every resource of ``res`` (read-only)."""
        out = self._avail.get(res)
        if out is None:
            out = self._avail[res] = self._left(res, 0)
            out.flags.writeable = False
        return out

    def _prefix_sums(self, res: tuple[str, ...]) -> np.ndarray:
        """``pre[j]``: the sum of ``_avail_all(res)[:j]`` (read-only). Only a guide for
        the fills: a difference of two of these is not, to the last bit, the running
        sum a fill compares (see ``_tolerance``)."""
        pre = self._prefix.get(res)
        if pre is None:
            pre = self._prefix[res] = np.concatenate(([0.0], np.cumsum(self._avail_all(res))))
            pre.flags.writeable = False
        return pre

    def avail(self, res: tuple[str, ...], lo: int, hi: int) -> np.ndarray:
        """Bytes each slot in ``lo..hi-1`` can still carry on every resource of ``res``
        (a read-only view; element for element the same as computing the slice alone)."""
        return self._avail_all(res)[lo:hi]

    def _tolerance(self, pre: np.ndarray, size: float) -> float:
        """A bound, with room to spare, on how far a difference of two prefix sums of
        ``pre`` can be from the running sum over the same slots that a fill computes,
        plus the rounding of ``size`` +- this bound. Summing ``m`` non-negative floats
        left to right errs by at most about ``(m - 1) u`` of their total (``u =
        2**-53``); both prefix sums and the fill's running sum are such sums of at most
        ``n`` terms, under the total ``pre[-1]``, and the difference rounds once more:
        under ``(3 n + 1) u pre[-1]`` in all, plus ``u size`` for the comparison. This
        takes ``16 (n + 1) u max(pre[-1], size)``; it is 0 only where every value is
        0, and then every sum is exact."""
        return 16.0 * len(pre) * 2.0**-53 * max(float(pre[-1]), size)  # len(pre) = n + 1

    def fill_forward(self, res: tuple[str, ...], size: float, start: int) -> int:
        """The slot by whose end ``size`` bytes issued at ``start`` have moved (the last
        slot if the budget never suffices)."""
        n = len(self.cap[res[0]])
        if self._finite and start < n:
            pre = self._prefix_sums(res)
            # The answer is the first k whose running sum ``cum[k]`` of ``a[start:]``
            # reaches ``size``. The prefix sums place it in O(log n); it is taken when
            # their rounding cannot have moved it: cum[k - 1] surely under ``size``,
            # cum[k] surely not (cum never decreases, a >= 0). Else the running sum.
            tol, base = self._tolerance(pre, size), float(pre[start])
            k = min(max(int(pre.searchsorted(base + size, side="left")) - start - 1, 0), n - start)
            below = k == 0 or float(pre[start + k]) - base < size - tol
            reached = k == n - start or float(pre[start + k + 1]) - base >= size + tol
            if below and reached:
                return min(start + k, n - 1)
        cum = np.cumsum(self.avail(res, start, n))
        return min(start + int(np.searchsorted(cum, size, side="left")), n - 1)

    def fill_backward(self, res: tuple[str, ...], size: float, end: int) -> int:
        """The slot at whose start ``size`` bytes must be issued to arrive before slot
        ``end`` (slot 0 if the budget never suffices)."""
        if end <= 0:
            return 0
        if self._finite and end <= len(self.cap[res[0]]):
            pre = self._prefix_sums(res)
            # as in ``fill_forward``, for the running sum of ``a[:end]`` backward from
            # slot ``end - 1``: cum[k] covers slots ``end - 1 - k .. end - 1``
            tol, top = self._tolerance(pre, size), float(pre[end])
            k = min(max(end - int(pre.searchsorted(top - size, side="right")), 0), end)
            below = k == 0 or top - float(pre[end - k]) < size - tol
            reached = k == end or top - float(pre[end - 1 - k]) >= size + tol
            if below and reached:
                return max(end - 1 - k, 0)
        cum = np.cumsum(self.avail(res, 0, end)[::-1])
        return max(end - 1 - int(np.searchsorted(cum, size, side="left")), 0)

    def spend(self, res: tuple[str, ...], size: float, start: int) -> None:
        n = len(self.cap[res[0]])
        if start >= n:
            return
        avail = self.avail(res, start, n)
        before = np.cumsum(avail) - avail
        take = np.clip(size - before, 0.0, avail)
        for r in res:
            self.used[r][start:] += take
        # the slots before ``start`` are untouched: of each cached array that shares a
        # resource with ``res``, only the rest is computed again (the same values as
        # computing it all); its prefix sums carry on from the untouched part
        for key, old in list(self._avail.items()):
            if set(key).isdisjoint(res):
                continue
            a = self._avail[key] = np.concatenate((old[:start], self._left(key, start)))
            a.flags.writeable = False
            pre = self._prefix.get(key)
            if pre is not None:
                rest = np.cumsum(np.concatenate((pre[start : start + 1], a[start:])))  # from pre[start]
                pre = self._prefix[key] = np.concatenate((pre[:start], rest))
                pre.flags.writeable = False


def _offload_tiers(hw: Hardware, scale: float, budgets: _Budgets) -> tuple[_Tier | None, _Tier | None]:
    """(slow, fast): the SSD-like and host-like tiers G10 chooses between. Kinds decide
    when present; otherwise the slowest and fastest offload tiers. Tiers in between
    (e.g. persistent memory on a three-tier machine) are not used by G10's planner."""
    names = list(hw.offload_tiers)  # fastest round trip first
    if not names:
        return None, None

    def pick(kind: str, default: str) -> str:
        return next((n for n in names if hw.tier(n).kind == kind), default)

    fast, slow = pick("host", names[0]), pick("ssd", names[-1])

    def tier(name: str) -> _Tier:
        return _Tier(
            name,
            hw.route_latency(hw.device, name) + hw.fault_latency_s,
            hw.route_bandwidth(hw.device, name) * scale,
            hw.route_bandwidth(name, hw.device) * scale,
            budgets.resources(hw.device, name),
            budgets.resources(name, hw.device),
        )

    return (tier(slow) if slow != fast else None), tier(fast)


class _Planner:
    def __init__(self, trace: Trace, hw: Hardware, options: PolicyOptions):
        self.trace, self.hw = trace, hw
        self.n = n = trace.n_ops
        self.budget = float(options.budget_bytes)
        self.line = float(options.get("line_share", 0.99)) * self.budget
        self.delta = float(options.get("delta", 0.5))
        g10_books = bool(options.get("g10_accounting", True))
        self.strict_line = bool(options.get("strict_line", not g10_books))
        scale = float(options.get("bw_scale", 2**30 / 1e9 if g10_books else 1.0))
        self.durations = trace.durations
        start = trace.op_start_s
        # slot start times over two iterations, for gaps that wrap
        self.t_ext = np.concatenate([start[:n], start[n] + start[: n + 1]])
        self.curve = trace.live_bytes.astype(np.float64)
        if g10_books and trace.n_tensors:
            # analysis.cc starts its curve from every tensor's bytes plus tensor 0's
            # once more, then frees every tensor but tensor 0 outside its life: tensor
            # 0 ends up counted twice in every slot
            lo, hi = int(trace.birth[0]), int(trace.death[0])
            extra = np.full(n, 2.0 * trace.sizes[0])
            extra[lo : hi + 1] -= float(trace.sizes[0])
            self.curve += extra
        self.budgets = _Budgets(hw, self.durations, scale)
        self.slow, self.fast = _offload_tiers(hw, scale, self.budgets)
        host_cap = hw.tier(self.fast.name).capacity if self.fast else 0.0
        self.host_cap = float(host_cap)
        self.host_curve = np.zeros(n)
        self.sizes = trace.sizes
        self.over = self.curve > self.line
        self.moves: list[Move] = []
        self.offloads: list[_Offload] = []
        self.stats = {"ssd": 0, "host": 0, "skipped": 0, "considered": 0}

    # -- geometry of a gap --------------------------------------------------------------
    def _span(self, g: Gap) -> tuple[int, int, bool]:
        """(first idle slot, the use slot, wraps) in extended slot numbers; a gap after
        the last op starts at slot 0 and does not wrap."""
        if not g.wraps:
            return g.after_op + 1, g.before_op, False
        if g.after_op == self.n - 1:
            return 0, g.before_op, False
        return g.after_op + 1, g.before_op + self.n, True

    def _over_area(self, lo: int, hi: int) -> float:
        """Seconds of slots ``lo..hi-1`` (extended numbering) that are over the line."""
        n, d, over = self.n, self.durations, self.over
        if hi <= n:
            return float(d[lo:hi][over[lo:hi]].sum())
        return float(d[lo:n][over[lo:n]].sum()) + float(d[: hi - n][over[: hi - n]].sum())

    def area(self, g: Gap) -> float:
        """Over-line ``bytes x seconds`` that offloading this gap could remove."""
        s0, end, wraps = self._span(g)
        size = float(self.sizes[g.tensor])
        if wraps:
            return size * self._over_area(s0, end)
        tier = self.slow or self.fast
        lo = self.budgets.fill_forward(tier.out_res, size / 2, s0)
        hi = self.budgets.fill_backward(tier.in_res, size / 2, end)
        return size * self._over_area(lo, hi) if hi > lo else 0.0

    def _slot_at(self, t: float, lo: int, hi: int) -> int:
        """The slot in ``lo..hi-1`` (extended) during which time ``t`` falls, or -1."""
        if not self.t_ext[lo] <= t < self.t_ext[hi]:
            return -1
        return int(np.searchsorted(self.t_ext, t, side="right")) - 1

    def _host_has_room(self, size: float) -> bool:
        return self.fast is not None and float(self.host_curve.max()) <= self.host_cap - size

    def _safe(self, tier: _Tier, size: float) -> tuple[float, float, float]:
        """(one-way move time, prefetch lead time, round trip with margin)."""
        move = tier.move_s(size)
        return move, move * (1 + self.delta), move * (2 + self.delta)

    # -- one gap ------------------------------------------------------------------------
    def place(self, g: Gap) -> None:
        self.stats["considered"] += 1
        s0, end, wraps = self._span(g)
        if end - s0 <= 1:
            self.stats["skipped"] += 1
            return
        size = float(self.sizes[g.tensor])
        gap_s = float(self.t_ext[end] - self.t_ext[s0])
        over_s = 0.0
        if self.slow is not None:
            room = max(self.budget - self.curve[s0 % self.n], 0.0)
            if room < size:  # G10: what does not fit would cost a round trip on demand
                over_s = 2 * self.slow.move_s(size - room)
        use_ssd = self.slow is not None and gap_s > self._safe(self.slow, size)[2] - over_s
        use_host = not use_ssd and self.fast is not None and gap_s > self._safe(self.fast, size)[2]
        if use_host and not self._host_has_room(size):
            use_host = False
        if not (use_ssd or use_host):
            self.stats["skipped"] += 1
            return
        if wraps:
            self._place_by_time(g, s0, end, self.slow if use_ssd else self.fast, size)
            return
        if use_ssd:
            move = self._safe(self.slow, size)[0]
            ideal = self._slot_at(self.t_ext[s0] + move, s0, end)
            ideal = end - 1 if ideal < 0 else ideal
            crowded = not np.any(self.budgets.avail(self.slow.out_res, s0, ideal) > 0)
            if crowded and self._host_has_room(size):
                self._place_by_budget(g, s0, end, self.fast, size, may_delay=False)
            else:
                self._place_by_budget(g, s0, end, self.slow, size, may_delay=True)
        else:
            self._place_by_budget(g, s0, end, self.fast, size, may_delay=False)

    def _place_by_budget(self, g: Gap, s0: int, end: int, tier: _Tier, size: float, may_delay: bool) -> None:
        b = self.budgets
        p = b.fill_backward(tier.in_res, size, end)
        e = b.fill_forward(tier.out_res, size, s0)
        if may_delay and p < e:
            # G10: starting the prefetch right after the eviction is still cheaper than
            # faulting the tensor back if the wait is shorter than a round trip
            if 2 * tier.move_s(size) > self.t_ext[e] - self.t_ext[p]:
                p = e + 1
        if p <= e:
            self.stats["skipped"] += 1
            return
        b.spend(tier.out_res, size, s0)
        b.spend(tier.in_res, size, p)
        self._accept(g, tier, size)
        self._lower(e + 1, p, size)
        if tier is self.fast:
            self.host_curve[s0:end] += size
        if p < end:
            self.offloads.append(_Offload(g, tier.name, e, p))
        # else the prefetch would come after the use: the use faults it back instead

    def _place_by_time(self, g: Gap, s0: int, end: int, tier: _Tier, size: float) -> None:
        move, lead, _ = self._safe(tier, size)
        e = self._slot_at(self.t_ext[s0] + move, s0, end)
        p = self._slot_at(self.t_ext[end] - lead, s0, end)
        if e < 0 or p < 0 or p == s0:
            self.stats["skipped"] += 1
            return
        self._accept(g, tier, size)
        self.moves.append(Move("prefetch", g.tensor, (p - 1) % self.n, tier.name, g.before_op))
        self._lower(e + 1, p, size)
        if tier is self.fast:
            idx = np.arange(s0, end) % self.n
            self.host_curve[idx] += size

    def _accept(self, g: Gap, tier: _Tier, size: float) -> None:
        self.moves.append(Move("evict", g.tensor, g.after_op, tier.name))
        self.stats["ssd" if self.slow is not None and tier is self.slow else "host"] += 1

    def _lower(self, lo: int, hi: int, size: float) -> None:
        if hi <= lo:
            return
        if hi <= self.n:  # no wrap: a slice does what the index array does, faster
            self.curve[lo:hi] -= size
            self.over[lo:hi] = self.curve[lo:hi] > self.line
            return
        idx = np.arange(lo, hi) % self.n
        self.curve[idx] -= size
        self.over[idx] = self.curve[idx] > self.line

    # -- the passes ---------------------------------------------------------------------
    def span_area(self, g: Gap) -> float:
        """Over-line ``bytes x seconds`` over the gap's whole idle span."""
        s0, end, _ = self._span(g)
        return float(self.sizes[g.tensor]) * self._over_area(s0, end)

    def _greedy(self, gaps: list[Gap], area) -> list[Gap]:
        """Place gaps best ``area`` first until no slot is over the line; returns the
        gaps never placed. Areas only shrink as the curve is lowered and budgets are
        spent, so a stale key is an upper bound: the top is recomputed until it is
        current (lazy greedy), which gives the same order as recomputing every area."""
        heap = []
        for g in gaps:
            a = area(g)
            if a > 0:
                heap.append((-a, -g.length_s * float(self.sizes[g.tensor]), g.tensor, g.after_op, g))
        heapq.heapify(heap)
        placed = set()
        while heap and self.over.any():
            key, tie, t, a_op, g = heapq.heappop(heap)
            a = area(g)
            if a <= 0:
                continue
            if a < -key * (1 - 1e-12):
                heapq.heappush(heap, (-a, tie, t, a_op, g))
                continue
            self.place(g)
            placed.add((t, a_op))
        return [g for g in gaps if (g.tensor, g.after_op) not in placed]

    def run(self, move_earlier: bool, second_pass: bool) -> None:
        rest = self._greedy(list(self.trace.gaps), self.area)
        if second_pass:
            # G10 goes on through gaps whose reducible area is zero (their over-line
            # slots lie outside the half-eviction..half-prefetch window) in whatever
            # order its sort leaves them; here: by over-line area over the whole gap.
            self._greedy(rest, self.span_area)
        if move_earlier:
            self._move_prefetches_earlier()
        else:
            for o in self.offloads:
                self._emit_prefetch(o, o.prefetch_at)

    def _move_prefetches_earlier(self) -> None:
        for o in sorted(self.offloads, key=lambda o: (o.prefetch_at, o.gap.tensor)):
            p = q = o.prefetch_at
            size = float(self.sizes[o.gap.tensor])
            # with the tensor back the slot must stay under the line (G10's code tests
            # the slot before adding the tensor; ``strict_line=False`` does that)
            add = size if self.strict_line else 0.0
            # q walks back from p while the slot before it passes, never past the
            # eviction: it stops just after the last slot in between that fails
            lo = o.evict_done + 1
            if q > lo:
                fails = np.flatnonzero(~(self.curve[lo:q] + add < self.line))
                q = lo + int(fails[-1]) + 1 if fails.size else lo
            if q < p:
                self.curve[q:p] += size
                self.over[q:p] = self.curve[q:p] > self.line
            self._emit_prefetch(o, q)

    def _emit_prefetch(self, o: _Offload, slot: int) -> None:
        self.moves.append(Move("prefetch", o.gap.tensor, (slot - 1) % self.n, o.tier, o.gap.before_op))


@register("g10", OPTIONS)
def g10(trace: Trace, hardware: Hardware, options: PolicyOptions) -> Plan:
    """G10's plan for ``trace`` within ``options.budget_bytes`` (see the module docstring
    for the algorithm and its options).

    Raises:
        PlanError: raised before this is called, by ``resolve_budget``, when the budget
            is below the minimum working set.
    """
    t0 = time.perf_counter()
    planner = _Planner(trace, hardware, options)
    if planner.fast is not None:
        planner.run(bool(options.get("move_earlier", True)), bool(options.get("second_pass", False)))
    moves = issue_order(planner.moves, trace)
    return Plan(
        policy="g10",
        moves=tuple(moves),
        budget_bytes=options.budget_bytes,
        reactive=True,
        frees_dead=True,
        headroom=float(options.get("headroom", 0.0)),
        meta={
            "plan_s": time.perf_counter() - t0,
            "line_bytes": planner.line,
            "evictions_ssd": planner.stats["ssd"],
            "evictions_host": planner.stats["host"],
            "gaps_considered": planner.stats["considered"],
            "gaps_skipped": planner.stats["skipped"],
            "over_line_ops": int(planner.over.sum()),
            "planned_peak_bytes": float(planner.curve.max()) if trace.n_ops else 0.0,
        },
    )
