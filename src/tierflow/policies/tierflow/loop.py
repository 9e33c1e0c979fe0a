"""The closed loop of ``tierflow``: seed plans, then repair them against the simulator.

Seeds are candidate plans from this package's planners (tierflow's own greedy pass,
``singa``, ``g10`` under a few of its own option settings). Each is simulated; then
:func:`repair` reads the simulation's stalls and fixes their causes:

* a **prefetch that arrived late** (it ended while the op that needs it waited) is
  issued earlier, by the measured lateness (times a factor), mapped onto the simulated
  op clock: the new ``after_op`` is the last op that ended before the new issue time;
* a **fault** (a tensor fetched on demand by a reactive plan's pager) gets a prefetch
  hint issued early enough, by the simulated clock, for the fetch to finish before the
  op would have started.
* a **queued prefetch** (a late one that also waited in its copy engine's queue, behind
  transfers issued before it) is issued earlier by its wait plus its lateness, so that
  it goes ahead of what it waited behind; moving it by its lateness alone would leave it
  in the queue behind the same transfers;
* a **room wait** (a reactive plan's pager evicting on demand while an op waits) gets
  eviction hints for the tensors it evicted, issued earlier (see :func:`_room_repairs`);
* a **wasted prefetch** (a tensor prefetched, evicted again before any op used it,
  then fetched back) is reissued after that eviction (see :func:`_wasted_repairs`);
* a **slow-tier arrival** (a tensor an op waited for coming back from the SSD) swaps
  tiers with one that waited in host memory with time to spare (see
  :func:`_tier_repairs`).
* a planned plan's **urgent evictions** (an op waited for room that evictions still
  queued would free) go sooner: the eviction queued ahead of them that the budget lets
  wait longest is reissued later (see :func:`_reorder_repair`).
* a reactive plan's **queued slow-tier stays** (a tensor that stayed on the SSD and
  whose fetch back waited in its copy queue) move to host memory where the simulated
  host occupancy has room over the whole stay (see :func:`_spill_repairs`);
* a reactive plan's **re-evicted hint** (a use that faulted because an eviction hint
  sent the tensor away again after the prefetch hint for that use) gets a new prefetch
  hint after that eviction, early enough by the simulated clock (``rehint``).

:func:`improve` applies a kind of repair to every stall at once; :func:`improve_targeted`
to one stall at a time, longest first. A repair is kept only if the simulated step gets
shorter (hill climbing), so the loop never makes a seed worse. Everything is a pure
function of its inputs: a fixed number of simulations, no wall clock, ties broken by ids.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from ...errors import PlanError
from ...hardware import Hardware
from ...plan import Move, Plan, validate
from ...trace import Trace


def simulate_score(trace: Trace, hw: Hardware, plan: Plan):
    """(step seconds, result); ``inf`` when the plan cannot run.

    A planned plan is simulated through the validator, as ``simulate`` does by default:
    the validator says which persistent tensors start the iteration off the device (a
    gap that wraps), and without it they would all start on it. Skipping it scored
    Llama-7B's singa plan 0.764 where the plan really runs at 0.733 (and ranked it above
    deeptm's, really 0.7335)."""
    from ...simulate import simulate

    try:
        res = simulate(trace, hw, plan, check_plan=not plan.reactive)
    except PlanError:
        return math.inf, None
    return (res.time_s if res.fits and not res.error else math.inf), res


def gains(new: float, old: float) -> bool:
    """True if a simulated step of ``new`` seconds is really shorter than ``old``.

    Two plans that differ only in which of two equal transfers goes first, or in the
    order a sum was taken, can score a few ulps apart; taking such a "gain" would make
    the choice (and all the repairs after it) hinge on rounding, so that an upgrade of
    the machine that changes nothing real could change the plan. A gain must be at
    least a nanosecond."""
    return new < old - 1e-9


def score_key(score: float) -> float:
    """``score`` to the nanosecond: ties between seeds go to the earlier seed (see
    :func:`gains`)."""
    return score if math.isinf(score) else round(score, 9)


def _op_before(ends: np.ndarray, t: float) -> int:
    """The last op whose simulated end is at or before ``t`` (-1 if none)."""
    return int(np.searchsorted(ends, t, side="right")) - 1


def repair(trace: Trace, hw: Hardware, plan: Plan, res, factor: float,
           kinds: frozenset[str] = frozenset({"late", "fault", "rehint", "room", "wasted", "tier", "reorder"}),
           only: frozenset[int] | None = None) -> Plan | None:
    """One round of stall repairs (see the module docstring) of the given ``kinds``
    (``late`` and ``queued`` prefetches, ``fault`` and ``rehint`` hints, ``room`` waits,
    ``wasted`` prefetches, ``tier`` swaps, ``reorder``-ed evictions, ``spill``-ed
    slow-tier stays, for which ``factor`` is the share of the fast tier's capacity);
    None if there is nothing to change or the repaired plan does not validate."""
    stall = res.op_stall_s
    stalled = np.flatnonzero(stall > 1e-9)
    if only is not None:
        stalled = np.array(sorted(set(stalled.tolist()) & only), dtype=np.int64)
    if stalled.size == 0 or not res.transfers:
        return None
    starts, ends = res.op_start_s, res.op_end_s
    period = res.time_s
    moves = list(plan.moves)
    pf_index: dict[tuple[int, int], int] = {}
    for i, m in enumerate(moves):
        if m.kind == "prefetch" and m.needed_by is not None:
            pf_index[(m.tensor, m.needed_by)] = i
    # transfers that ended inside an op's stall, per (tensor, op)
    late: dict[tuple[int, int], tuple[float, object]] = {}
    by_tensor: dict[int, list] = {}
    for rec in res.transfers:
        if rec.kind in ("prefetch", "fault"):
            by_tensor.setdefault(rec.tensor, []).append(rec)
    for k in stalled.tolist():
        ready = starts[k] - stall[k]  # when the op could have started
        for t in trace.op_tensors[k]:
            for rec in by_tensor.get(int(t), ()):
                if ready - 1e-9 < rec.end_s <= starts[k] + 1e-9:
                    lateness = rec.end_s - ready
                    key = (int(t), k)
                    if key not in late or lateness > late[key][0]:
                        late[key] = (lateness, rec)
    changed = False
    added: list[Move] = []
    if "wasted" in kinds:
        moves, changed = _wasted_repairs(trace, res, moves, factor, only)
    if "tier" in kinds:
        moves, changed = _tier_repairs(trace, hw, res, stalled, moves)
    if "reorder" in kinds and not plan.reactive:
        moves, changed = _reorder_repair(trace, hw, plan, res, stalled, moves)
    if "spill" in kinds and plan.reactive:
        moves, spilt = _spill_repairs(trace, hw, res, moves, factor)
        changed = changed or spilt
    if plan.reactive and "room" in kinds:
        added += _room_repairs(trace, plan, res, stalled, factor)
        changed = changed or bool(added)
    if not late and not changed:
        return None
    for (t, k), (lateness, rec) in sorted(late.items()):
        i = pf_index.get((t, k))
        if i is not None and ("late" in kinds or "queued" in kinds):
            m = moves[i]
            if "late" in kinds:
                issue = rec.issue_s - factor * lateness
            else:  # "queued": ahead of what it waited behind in its engine's queue
                waited = rec.start_s - rec.issue_s
                if waited <= 1e-9:
                    continue
                issue = rec.issue_s - factor * (waited + lateness)
            q = _op_before(ends, issue)
            if m.after_op < k:  # same iteration: stay after the gap opens
                if q >= m.after_op:
                    q = m.after_op - 1
                if q < 0:
                    continue
            else:  # the prefetch wraps (issued in the previous iteration)
                if q < 0:
                    q = _op_before(ends, issue + period)
                    if q <= k or q >= m.after_op:
                        continue
                elif q >= m.after_op:
                    q = m.after_op - 1
                else:
                    continue  # moving it into this iteration would reorder the gap
            if q != m.after_op:
                moves[i] = Move("prefetch", m.tensor, q, m.tier, m.needed_by)
                changed = True
        elif plan.reactive and rec.kind == "fault" and ("fault" in kinds or "rehint" in kinds):
            # "fault": no hint of ours for this use. "rehint": our hint for it was issued
            # before an eviction hint sent the tensor away again, so the use faults; a
            # new hint after that eviction brings it back in time. (Moving the old hint,
            # as "late" does, cannot help: the eviction still follows it; the "wasted"
            # repair drops the eviction, which keeps it on the device meanwhile.) On
            # SENet-154 the room repair sends 1.6-3.3 GB tensors, prefetched early from
            # the SSD, to host memory near the end of the backward pass, and their uses
            # faulted them back while ops waited (0.6 s); with this kind in the targeted
            # phase: SENet-154 0.96971 -> 0.97187 of ideal (with the spill repair),
            # ResNet-152 0.98544 -> 0.98958.
            gone = None  # the eviction hint the new prefetch hint must follow
            if i is not None:
                if "rehint" not in kinds or moves[i].after_op >= k:
                    continue
                gone = max((x.after_op for x in moves if x.kind == "evict" and x.tensor == t
                            and moves[i].after_op < x.after_op < k), default=None)
                if gone is None:
                    continue
            elif "fault" not in kinds:
                continue
            span = rec.end_s - rec.issue_s
            issue = (starts[k] - stall[k]) - factor * span
            q = _op_before(ends, issue)
            if gone is not None:
                q = max(q, gone + 1)
            if q < 0 or q >= k:
                continue
            added.append(Move("prefetch", t, q, None, k))
            changed = True
    if not changed:
        return None
    # every field kept but the moves (recompute and host-step records included)
    new = dataclasses.replace(plan, moves=tuple(moves) + tuple(added), meta=dict(plan.meta))
    try:
        validate(new, trace, hw)
    except PlanError:
        return None
    return new


def _wasted_repairs(trace: Trace, res, moves: list[Move], factor: float,
                    only: frozenset[int] | None = None) -> tuple[list[Move], bool]:
    """Delay **wasted prefetches**: a tensor prefetched, then evicted again (by a hint
    or by the pager making room) before any op used it, then fetched back for that use.
    Its prefetch is reissued after the op that saw the eviction, as late as the next
    use allows: the op that ends ``factor`` times the transfer's measured duration
    before the use starts. Planned evictions of the tensor inside the old window are
    dropped (the tensor is away there now). Returns (moves, whether any changed)."""
    starts, ends = res.op_start_s, res.op_end_s
    pf_index: dict[tuple[int, int], int] = {}
    for i, m in enumerate(moves):
        if m.kind == "prefetch" and m.needed_by is not None:
            pf_index[(m.tensor, m.needed_by)] = i
    wanted = None if only is None else {int(t) for u in only for t in trace.op_tensors[u]}
    by_tensor: dict[int, list] = {}
    for rec in res.transfers:  # sorted by issue time
        if wanted is None or rec.tensor in wanted:
            by_tensor.setdefault(int(rec.tensor), []).append(rec)
    drop: set[tuple[int, int, int]] = set()  # (tensor, lo, hi): evictions to drop inside
    changed = False
    for t, recs in sorted(by_tensor.items()):
        uses = trace.uses(t)
        use_starts = starts[uses]
        for a, b in zip(recs, recs[1:]):
            if a.kind != "prefetch" or b.kind != "evict":
                continue
            # an op that used it between the arrival and the eviction: not wasted
            lo = int(np.searchsorted(use_starts, a.end_s - 1e-12, side="left"))
            j = int(np.searchsorted(use_starts, b.issue_s + 1e-12, side="right"))
            if j > lo or j >= uses.size:
                continue
            u = int(uses[j])
            if only is not None and u not in only:
                continue
            i = pf_index.get((t, u))
            if i is None or moves[i].after_op >= u:
                continue  # no prefetch of ours for that use, or one that wraps
            m = moves[i]
            seen = max(_op_before(ends, b.issue_s), m.after_op + 1)
            q = _op_before(ends, starts[u] - factor * (a.end_s - a.start_s))
            q = min(max(q, seen), u - 1)
            if q <= m.after_op:
                continue
            moves[i] = Move("prefetch", t, q, m.tier, u)
            drop.add((t, m.after_op, u))
            changed = True
    if drop:
        windows: dict[int, list[tuple[int, int]]] = {}
        for t, lo, hi in drop:
            windows.setdefault(t, []).append((lo, hi))
        moves = [
            m for m in moves
            if not (m.kind == "evict" and any(lo < m.after_op < hi for lo, hi in windows.get(m.tensor, ())))
        ]
    return moves, changed


def _fastest_tier(hw: Hardware) -> str | None:
    """The offload tier with the fastest route back to the device (ties to the first),
    or None if there is only one: a tier to move stays into."""
    tiers = list(hw.offload_tiers)
    if len(tiers) < 2:
        return None
    return max(tiers, key=lambda t: (hw.route_bandwidth(t, hw.device), -tiers.index(t)))


def _stays(res, dev: str):
    """Each stay of a tensor off the device in the simulation: (tensor, eviction record,
    record of the fetch that ended it), in the order the fetches were issued."""
    last_evict: dict[int, object] = {}
    for r in res.transfers:
        if r.kind == "evict":
            last_evict[int(r.tensor)] = r
        elif r.dst == dev and int(r.tensor) in last_evict:
            yield int(r.tensor), last_evict.pop(int(r.tensor)), r


def _tier_repairs(trace: Trace, hw: Hardware, res, stalled: np.ndarray,
                  moves: list[Move]) -> tuple[list[Move], bool]:
    """Swap tiers for a **slow-tier arrival**: a tensor ``t`` that arrived from a slower
    tier (an SSD) while op ``k`` waited for it trades places with a tensor ``h`` that
    waited in the fastest tier (host memory) over all of ``t``'s absence and came back
    with time to spare (more than its transfer from the slow tier would take): ``t``'s
    eviction now goes to the fast tier and ``h``'s to the slow one, so the fast tier
    holds no more than before. Prefetches that name their tier follow. Returns
    (moves, whether any changed)."""
    dev = hw.device
    fastest = _fastest_tier(hw)
    if fastest is None:
        return moves, False
    starts, ends, stall = res.op_start_s, res.op_end_s, res.op_stall_s
    # each tensor's stays off the device: (eviction record, fetch record)
    stays: dict[int, list[tuple]] = {}
    for t, e, r in _stays(res, dev):
        stays.setdefault(t, []).append((e, r))
    ev_index = {(m.tensor, m.after_op): i for i, m in enumerate(moves) if m.kind == "evict"}
    used: set[int] = set()
    changed = False
    for k in stalled.tolist():
        ready = starts[k] - stall[k]
        need = {int(t) for t in trace.op_tensors[k]}
        for t in sorted(need):
            for e, f in stays.get(t, ()):
                if not (f.src != fastest and ready - 1e-9 < f.end_s <= starts[k] + 1e-9):
                    continue
                i_t = ev_index.get((t, _op_before(ends, e.issue_s + 1e-12)))
                if i_t is None or t in used:
                    continue
                # a partner: in the fast tier over t's whole absence, at least as big,
                # back early enough to come from the slow tier instead
                best = None
                for h, hs in stays.items():
                    if h == t or h in used or int(trace.sizes[h]) < int(trace.sizes[t]):
                        continue
                    for he, hf in hs:
                        if hf.src != fastest or he.end_s > e.end_s or hf.start_s < f.start_s:
                            continue
                        uses = trace.uses(h)
                        nxt = uses[starts[uses] >= hf.end_s - 1e-12]
                        if not nxt.size:
                            continue
                        spare = starts[int(nxt[0])] - hf.end_s
                        slow_s = int(trace.sizes[h]) / hw.route_bandwidth(f.src, dev)
                        if spare > slow_s and (best is None or spare > best[0]):
                            i_h = ev_index.get((h, _op_before(ends, he.issue_s + 1e-12)))
                            if i_h is not None:
                                best = (spare, h, i_h, int(nxt[0]))
                if best is None:
                    continue
                _, h, i_h, h_use = best
                for i, tensor, tier, use in ((i_t, t, fastest, k), (i_h, h, f.src, h_use)):
                    m = moves[i]
                    moves[i] = Move("evict", tensor, m.after_op, tier)
                    for j, x in enumerate(moves):  # the prefetch that ends this stay
                        if x.tensor == tensor and x.kind == "prefetch" and x.tier is not None and x.needed_by == use:
                            moves[j] = Move("prefetch", tensor, x.after_op, tier, use)
                used.update((t, h))
                changed = True
    return moves, changed


def _spill_repairs(trace: Trace, hw: Hardware, res, moves: list[Move],
                   factor: float = 1.0) -> tuple[list[Move], bool]:
    """Bring a reactive plan's **queued slow-tier stays** into the fast tier where it
    has room (:func:`repair` applies it to reactive plans only; see ``_STEPS``). A tensor
    that stayed in a slower tier (an SSD) and whose fetch back waited in its copy
    queue crossed a link that was busy at both ends of the stay; where the fastest tier
    (host memory) had room for it over the whole stay, by the simulated occupancy of
    that tier (bytes are held there from the eviction's issue to the fetch's end, as
    the simulator counts them), its eviction and its prefetch name the fast tier
    instead. Shortest stays first (least fast-tier memory per byte kept off the slow
    link), each one added to the occupancy before the next is tried; ``factor`` caps
    the occupancy at that share of the fast tier's capacity (``_STEPS`` uses 1: applied
    once to the plan tierflow made for SENet-154 before, share 1 gave 0.96942 of ideal,
    0.95 gave 0.96837). On SENet-154 the SSD link carries 210 GB each way, saturated for
    the whole backward pass, while host memory, full at the start of the backward pass, has
    8-11 GiB free during the last 10 s of the forward pass: the tensors evicted then
    and fetched soon after the backward pass starts went to the SSD (g10's hints, by its
    own bookkeeping of the host); spilling them took 0.96755 -> 0.96971 of ideal. The
    pager still sends an eviction to the SSD if the host is full when it is issued, so
    a spill that the simulated occupancy misjudges costs time, never a failure; the hill
    climb keeps it only if the step gets shorter. Returns (moves, whether any changed)."""
    dev = hw.device
    fastest = _fastest_tier(hw)
    if fastest is None:
        return moves, False
    cap = hw.tier(fastest).capacity * factor
    times, used = res.memory.get(fastest, (np.zeros(0), np.zeros(0)))
    if not len(times):
        return moves, False
    used = np.array(used, dtype=np.float64)
    ends = res.op_end_s
    # slow-tier stays whose fetch waited in its queue: (length, tensor, eviction, fetch)
    stays = [(r.end_s - e.issue_s, t, e, r) for t, e, r in _stays(res, dev)
             if e.dst == r.src != fastest and r.start_s - r.issue_s > 1e-9]
    if not stays:
        return moves, False
    ev_index = {(m.tensor, m.after_op): i for i, m in enumerate(moves) if m.kind == "evict"}
    pf_by_tensor: dict[int, list[int]] = {}
    for i, m in enumerate(moves):
        if m.kind == "prefetch":
            pf_by_tensor.setdefault(m.tensor, []).append(i)
    changed = False
    for _, t, e, f in sorted(stays, key=lambda x: (x[0], x[1])):
        i_e = ev_index.get((t, _op_before(ends, e.issue_s + 1e-12)))
        if i_e is None:
            continue  # the pager's own eviction: no move of ours to retarget
        lo = max(int(np.searchsorted(times, e.issue_s, side="right")) - 1, 0)
        hi = max(int(np.searchsorted(times, f.end_s, side="left")), lo + 1)
        if used[lo:hi].max() + f.nbytes > cap:
            continue
        used[lo:hi] += f.nbytes
        m = moves[i_e]
        moves[i_e] = Move("evict", t, m.after_op, fastest)
        # the prefetch that ended this stay (issued by the fetch's issue, for a later use)
        q = _op_before(ends, f.issue_s + 1e-12)
        for j in pf_by_tensor.get(t, ()):
            x = moves[j]
            if x.after_op == q and x.tier is not None:
                moves[j] = Move("prefetch", t, x.after_op, fastest, x.needed_by)
        changed = True
    return moves, changed


def _reorder_repair(trace: Trace, hw: Hardware, plan: Plan, res, stalled: np.ndarray,
                    moves: list[Move]) -> tuple[list[Move], bool]:
    """Let a planned plan's **urgent evictions** go sooner. An op of a planned plan
    that waits for room waits for evictions still queued (they free room only when
    complete, and a copy queue is first in, first out). Of the evictions queued ahead
    of those it waits for, the one the budget lets wait longest (by the planned device
    curve, as :func:`tierflow.plan.validate` counts it) is reissued that much later, up
    to just before the stalled op: one move per repair (delaying every one of them at
    once lost on ViT: the ops in between then wait). Returns (moves, whether changed)."""
    if not stalled.size:
        return moves, False
    starts, ends, stall = res.op_start_s, res.op_end_s, res.op_stall_s
    try:
        curve = validate(dataclasses.replace(plan, moves=tuple(moves)), trace, hw)
    except PlanError:
        return moves, False
    dev = curve.tier_bytes[hw.device].astype(np.float64)
    budget = float(plan.budget_bytes)
    ev_index = {(m.tensor, m.after_op): i for i, m in enumerate(moves) if m.kind == "evict"}
    evicts = [r for r in res.transfers if r.kind == "evict"]
    k = int(stalled[0])
    ready = starts[k] - stall[k]
    urgent = [r for r in evicts if ready - 1e-12 < r.end_s <= starts[k] + 1e-12]
    if not urgent:
        return moves, False
    first = min(r.issue_s for r in urgent)
    best = None
    for r in evicts:
        # queued before the urgent ones and still on the link after they were issued
        if r.issue_s >= first or r.end_s <= first:
            continue
        t = int(r.tensor)
        a = _op_before(ends, r.issue_s + 1e-12)
        i = ev_index.get((t, a))
        if i is None or a >= k - 1:
            continue
        uses = trace.uses(t)
        nxt = uses[uses > a]
        pf = [m.after_op for m in moves if m.tensor == t and m.kind == "prefetch" and m.after_op > a]
        hi = min([k - 1] + [p - 1 for p in pf] + ([int(nxt[0]) - 1] if nxt.size else []))
        room = dev[a + 1 : hi + 1] + float(trace.sizes[t]) <= budget
        last = a + (room.size if room.all() else int(np.argmin(room)))
        if last > a and (best is None or (last - a, r.nbytes) > best[0]):
            best = ((last - a, r.nbytes), i, last)
    if best is None:
        return moves, False
    _, i, last = best
    m = moves[i]
    moves[i] = Move("evict", m.tensor, last, m.tier)
    return moves, True


def _room_repairs(trace: Trace, plan: Plan, res, stalled: np.ndarray, factor: float) -> list[Move]:
    """Eviction hints for a reactive plan's **room waits**: when op ``k`` stalled while the
    pager evicted tensors on demand (to make room for its faults or births), those
    evictions are issued earlier, after the op that ends ``factor`` times the eviction's
    duration before ``k`` could have started (never before the tensor's last use ahead
    of ``k``), so that the room is free when ``k`` asks for it.

    A demand eviction is one the plan did not issue: an ``evict`` transfer issued inside
    the stall with no move of the plan evicting that tensor after op ``k - 1``."""
    starts, ends, stall = res.op_start_s, res.op_end_s, res.op_stall_s
    planned = {(m.tensor, m.after_op) for m in plan.moves if m.kind == "evict"}
    have = {(m.tensor, m.after_op) for m in plan.moves}
    evicts = [r for r in res.transfers if r.kind == "evict"]
    issue = np.array([r.issue_s for r in evicts]) if evicts else np.zeros(0)
    out: list[Move] = []
    for k in stalled.tolist():
        ready = starts[k] - stall[k]
        lo = int(np.searchsorted(issue, ready - 1e-12, side="left"))
        hi = int(np.searchsorted(issue, starts[k] + 1e-12, side="right"))
        for rec in evicts[lo:hi]:
            t = int(rec.tensor)
            if (t, k - 1) in planned or rec.end_s <= ready + 1e-12:
                continue
            uses = trace.uses(t)
            before = uses[uses < k]
            if before.size == 0:
                continue
            q = _op_before(ends, ready - factor * (rec.end_s - rec.start_s))
            q = max(q, int(before[-1]))
            if q >= k - 1 or (t, q) in have:
                continue
            out.append(Move("evict", t, q, rec.dst))
            have.add((t, q))
    return out


# The repair steps the hill climb tries, in order: first every slow-tier arrival swaps
# tiers with a fast-tier stay that had time to spare (the swap moves no more bytes to
# either tier; on SENet-154, where the host is full and 411-822 MB tensors came back
# from the SSD while ops waited, swapping them all at once took the step from 0.942 to
# 0.968 of ideal, where one stall at a time, in the targeted phase, had gained 0.001),
# then queued prefetches ahead of their queue, then each kind of timing repair alone (a
# round that mixes them is often worse than its best part: measured on ResNet-152, the
# room repair alone gains while all three together lose), at the measured lateness,
# twice it and half of it. (With the queued repair, here and in the targeted phase:
# Inception-v3 0.98953 -> 0.99266, ResNet-152 0.98474 -> 0.98544, the others unchanged.)
# After the tier swaps, a reactive plan's queued SSD stays spill into the host's room:
# on SENet-154, 0.96755 -> 0.96971 of ideal alone (12 GB fewer each way over the SSD,
# whose links are saturated for the whole forward (writes) and backward (reads) pass),
# 0.97187 with the rehint repair; ResNet-152 unchanged. (A planned plan's tiers are its
# packer's, by the validator's accounting: on Inception-v3 the spill lost and its
# simulation, taken from the repair budget, cost 0.99266 -> 0.99251.)
_STEPS = ((frozenset({"tier"}), 1.0), (frozenset({"spill"}), 1.0), (frozenset({"queued"}), 1.0)) + tuple(
    (frozenset({kind}), f) for f in (1.0, 2.0, 0.5) for kind in ("late", "fault", "room")
)


def improve(trace: Trace, hw: Hardware, plan: Plan, score: float, res, rounds: int,
            steps: tuple[tuple[frozenset[str], float], ...] = _STEPS, tick: Callable[[], None] | None = None):
    """Hill-climb ``plan`` with :func:`repair` for at most ``rounds`` simulations, cycling
    through ``steps`` until none of them gains. ``tick()`` is called after each
    simulation (progress). Returns (score, plan, result, simulations used)."""
    used = 0
    si = 0
    misses = 0
    while used < rounds and misses < len(steps):
        kinds, factor = steps[si]
        new = repair(trace, hw, plan, res, factor, kinds)
        if new is not None:
            s2, r2 = simulate_score(trace, hw, new)
            used += 1
            if tick is not None:
                tick()
            if gains(s2, score):
                score, plan, res, misses = s2, new, r2, 0
                continue  # the same step again, on the new simulation
        misses += 1
        si = (si + 1) % len(steps)
    return score, plan, res, used


def improve_targeted(trace: Trace, hw: Hardware, plan: Plan, score: float, res, rounds: int,
                     groups: tuple[tuple[str, ...], ...] = (("wasted", "rehint", "late", "queued", "tier", "reorder"), ("room", "fault")),
                     factor: float = 1.0, tick: Callable[[], None] | None = None):
    """Hill-climb ``plan`` one stall at a time: the op that stalled longest (in the
    current simulation) not tried yet gets each kind of repair alone, restricted to its
    own stall (a round that repairs every stall at once moves hundreds of transfers and
    mostly loses; one stall's repair is a small change whose effect the simulation
    measures). The kinds of the first of ``groups`` are tried on every stalled op
    before those of the next (the pager's kinds, second, lost on most ops of SENet and
    ResNet; ``rehint``, in the first, re-hints only uses faulted after an eviction
    hint, few and worth it on both). A gain restarts from the new simulation's stalls. At most ``rounds``
    simulations, and at most ``4 * rounds`` repairs tried (a repair that changes
    nothing or that the validator rejects costs no simulation, but it is not free: on
    a planned 9,600-op plan, hundreds of them were rejected at 0.1 s each). Kinds
    that apply only to reactive plans are not tried on a planned one. ``tick()`` is
    called after each simulation (progress). Returns (score, plan, result, simulations
    used)."""
    used = attempts = 0
    tried: set[tuple[int, str]] = set()
    if not plan.reactive:
        groups = tuple(tuple(k for k in g if k not in ("fault", "room", "rehint")) for g in groups)
    while used < rounds and attempts < 4 * rounds:
        stall = res.op_stall_s
        order = [int(k) for k in np.argsort(-stall, kind="stable") if stall[k] > 1e-9]
        step = None
        for k, kind in ((k, kind) for g in groups for k in order for kind in g):
            if (k, kind) in tried:
                continue
            tried.add((k, kind))
            attempts += 1
            if attempts > 4 * rounds:
                break
            step = repair(trace, hw, plan, res, factor, frozenset({kind}), frozenset({k}))
            if step is not None:
                break
        if step is None:
            break
        s2, r2 = simulate_score(trace, hw, step)
        used += 1
        if tick is not None:
            tick()
        if gains(s2, score):
            score, plan, res = s2, step, r2
    return score, plan, res, used
