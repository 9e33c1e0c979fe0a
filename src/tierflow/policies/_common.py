"""Shared machinery of the seed-system policies (flashneuron, vdnn, singa, myelin, deeptm).

Every one of those systems does the same thing at heart: pick some *inactive gaps* of
some tensors, evict the tensor after the use that opens the gap and prefetch it before
the use that closes it. They differ in which gaps they pick, where the tensor goes and
when it comes back. This module holds the parts they share:

* :class:`Offload`: one chosen gap, its destination tier and its prefetch point;
* :class:`Planner`: the planned device curve and per-tier curves, computed the way
  :func:`tierflow.plan.validate` counts them (an evicted tensor leaves the device the op
  after its eviction is issued; a prefetched one is back the op after its prefetch is
  issued), so a policy can choose gaps until the curve is under the budget, then place
  each prefetch, and know before building the :class:`~tierflow.plan.Plan` that the
  validator will accept it;
* :func:`no_fit`: the one way these policies say a budget cannot be met.

Positions inside a gap are in *unwrapped* op indices: a persistent tensor's gap that
wraps from op ``a`` to op ``b`` of the next iteration spans ``a .. b + n_ops``.

Infeasibility is reported by raising :class:`~tierflow.errors.PlanError` (as
:func:`tierflow.policies.resolve_budget` does for a budget below the minimum working
set), never by returning a plan the validator would reject: the message names the
policy, the budget, the op where the paper's plan still needs more and the minimum
working set, all in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from ..hardware import Hardware
from ..plan import Move, Plan
from ..trace import Gap, Trace
from ..units import fmt_bytes


@dataclass(frozen=True, slots=True)
class Offload:
    """One gap a policy moves off the device.

    Attributes:
        tensor: tensor id.
        after_op: the use that opens the gap; the eviction is issued when it ends.
        needed_by: the use that closes the gap (in the next iteration when ``wraps``).
        wraps: the gap crosses the iteration boundary (persistent tensors only).
        tier: where the tensor waits.
        prefetch_after: unwrapped op after which the prefetch is issued, in
            ``after_op + 1 .. end - 1`` where ``end`` is ``needed_by`` unwrapped.
    """

    tensor: int
    after_op: int
    needed_by: int
    wraps: bool
    tier: str
    prefetch_after: int


def gap_end(g: Gap, n_ops: int) -> int:
    """The closing use of a gap in unwrapped op indices."""
    return g.before_op + (n_ops if g.wraps else 0)


def gap_ops(g: Gap, n_ops: int) -> int:
    """Ops strictly inside a gap (where an evicted tensor saves device memory)."""
    return gap_end(g, n_ops) - g.after_op - 1


class Curve:
    """Planned bytes per op of one tier, with ranges in unwrapped op indices."""

    def __init__(self, base: np.ndarray):
        self.v = np.asarray(base, dtype=np.int64).copy()
        self.n = len(self.v)

    def _parts(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Half-open slices of ``v`` covering unwrapped ops ``lo .. hi`` (inclusive)."""
        if hi < lo:
            return []
        start, length = lo % self.n, hi - lo + 1
        if start + length <= self.n:
            return [(start, start + length)]
        return [(start, self.n), (0, start + length - self.n)]

    def add(self, lo: int, hi: int, nbytes: int) -> None:
        for a, b in self._parts(lo, hi):
            self.v[a:b] += nbytes

    def window(self, lo: int, hi: int) -> np.ndarray:
        parts = self._parts(lo, hi)
        if not parts:
            return np.zeros(0, dtype=np.int64)
        if len(parts) == 1:
            a, b = parts[0]
            return self.v[a:b]
        return np.concatenate([self.v[a:b] for a, b in parts])

    def max(self) -> int:
        return int(self.v.max()) if self.n else 0


class Planner:
    """Planned residency while a policy chooses gaps.

    Args:
        trace: the iteration.
        hardware: the machine (tier capacities).
        budget: device bytes the plan may use.

    Example:
        >>> p = Planner(trace, hw, budget)                       # doctest: +SKIP
        >>> if p.covers_excess(gap) and p.take(gap, "host"): ... # doctest: +SKIP
        >>> p.place_prefetches()                                 # doctest: +SKIP
        >>> plan = p.plan("vdnn")                                # doctest: +SKIP
    """

    def __init__(self, trace: Trace, hardware: Hardware, budget: float, assume_room: bool = False):
        # assume_room: choose as if the offload tiers were unbounded (as SINGA and Myelin
        # assume of host memory) and check capacity only at the end. A choice that does
        # not depend on the host's size cannot get worse when the host grows.
        self.assume_room = assume_room
        self.trace, self.hw, self.budget = trace, hardware, float(budget)
        self.n = trace.n_ops
        self.sizes = trace.sizes
        self.device = Curve(trace.live_bytes)
        self.tiers = {t: Curve(np.zeros(self.n, dtype=np.int64)) for t in hardware.offload_tiers}
        self.offloads: list[Offload] = []
        self.refused = 0  # offloads no allowed tier had room for

    # -- choosing gaps -------------------------------------------------------------------
    def excess(self) -> int:
        """Planned device bytes above the budget at the worst op (<= 0 when it fits)."""
        return int(self.device.max() - self.budget)

    def covers_excess(self, g: Gap) -> bool:
        """Whether evicting ``g`` for its whole length lowers an op that is over budget."""
        w = self.device.window(g.after_op + 1, gap_end(g, self.n) - 1)
        return bool(w.size) and bool((w > self.budget).any())

    def tier_room(self, g: Gap, tier: str) -> bool:
        """Whether ``tier`` can hold the tensor for the whole gap."""
        cap = self.hw.tier(tier).capacity
        w = self.tiers[tier].window(g.after_op + 1, gap_end(g, self.n) - 1)
        return bool(w.size == 0 or w.max() + int(self.sizes[g.tensor]) <= cap)

    def take(self, g: Gap, tiers: str | tuple[str, ...], prefetch_after: int | None = None) -> str | None:
        """Offload gap ``g`` to the first of ``tiers`` with room for the whole gap.

        Args:
            g: the gap (``gap_ops(g) >= 1``).
            tiers: destination, or destinations in order of preference (a full tier is
                passed over, as a system that spills would).
            prefetch_after: unwrapped op after which it is prefetched; ``None`` = at the
                last moment for now (:meth:`place_prefetches` moves it earlier).

        Returns:
            The tier chosen, or ``None`` when none has room (nothing is changed).
        """
        end = gap_end(g, self.n)
        q = end - 1 if prefetch_after is None else int(prefetch_after)
        if not g.after_op < q < end:
            return None
        for tier in (tiers,) if isinstance(tiers, str) else tiers:
            if tier not in self.tiers:
                continue
            cap = self.hw.tier(tier).capacity
            size = int(self.sizes[g.tensor])
            w = self.tiers[tier].window(g.after_op + 1, q)
            if not self.assume_room and w.size and w.max() + size > cap:
                continue
            self.device.add(g.after_op + 1, q, -size)
            self.tiers[tier].add(g.after_op + 1, q, size)
            self.offloads.append(Offload(g.tensor, g.after_op, g.before_op, g.wraps, tier, q))
            return tier
        self.refused += 1
        return None

    # -- when tensors come back ----------------------------------------------------------
    def place_prefetches(self, earliest: dict[int, int] | None = None) -> None:
        """Move every prefetch as early as the budget allows ("stick to the limit").

        Offloads are taken in the order they are needed; each one's prefetch is issued
        after the last op of its gap that would otherwise go over the budget, but not
        before ``earliest[i]`` (unwrapped op, per offload index) when given. An offload
        that the budget does not need at all (its prefetch could be issued right after
        its eviction) is dropped: moving it would buy nothing.
        """
        order = sorted(range(len(self.offloads)), key=lambda i: self._need_key(self.offloads[i]))
        keep: list[Offload] = []
        for i in order:
            o = self.offloads[i]
            size = int(self.sizes[o.tensor])
            lo = max(o.after_op, (earliest or {}).get(i, o.after_op))
            # give the gap back, then take only what the budget needs
            self.device.add(o.after_op + 1, o.prefetch_after, size)
            self.tiers[o.tier].add(o.after_op + 1, o.prefetch_after, -size)
            end = o.needed_by + (self.n if o.wraps else 0)
            w = self.device.window(o.after_op + 1, end - 1)
            over = np.flatnonzero(w + size > self.budget)
            if not over.size:
                continue  # the budget never needs it gone
            q = min(max(lo, o.after_op + 1 + int(over[-1])), o.prefetch_after)
            self.device.add(o.after_op + 1, q, -size)
            self.tiers[o.tier].add(o.after_op + 1, q, size)
            keep.append(Offload(o.tensor, o.after_op, o.needed_by, o.wraps, o.tier, q))
        self.offloads = keep

    def delay_prefetches(self) -> None:
        """Issue a prefetch later where its planned arrival would put an op over the
        budget (for policies whose prefetch point is fixed by their own rule); no
        offload is dropped."""
        order = sorted(range(len(self.offloads)), key=lambda i: self._need_key(self.offloads[i]))
        for i in order:
            o = self.offloads[i]
            size = int(self.sizes[o.tensor])
            end = o.needed_by + (self.n if o.wraps else 0)
            w = self.device.window(o.prefetch_after + 1, end - 1)
            over = np.flatnonzero(w > self.budget)
            if not over.size:
                continue
            q = min(o.prefetch_after + 1 + int(over[-1]), end - 1)
            self.device.add(o.prefetch_after + 1, q, -size)
            self.tiers[o.tier].add(o.prefetch_after + 1, q, size)
            self.offloads[i] = Offload(o.tensor, o.after_op, o.needed_by, o.wraps, o.tier, q)

    def _need_key(self, o: Offload) -> tuple[int, int]:
        return (o.needed_by + (self.n if o.wraps else 0), o.tensor)

    # -- output ----------------------------------------------------------------------------
    def fits(self) -> bool:
        if self.excess() > 0:
            return False
        return all(c.max() <= self.hw.tier(t).capacity for t, c in self.tiers.items())

    def plan(self, policy: str, meta: dict | None = None) -> Plan:
        """The planned :class:`Plan` of the chosen offloads (it passes ``validate``)."""
        moves = []
        for o in self.offloads:
            moves.append(Move("evict", o.tensor, o.after_op, o.tier))
            moves.append(Move("prefetch", o.tensor, o.prefetch_after % self.n, o.tier, o.needed_by))
        moves.sort(key=lambda m: (m.after_op, m.kind != "evict", m.tensor))
        info = {
            "offloads": len(self.offloads),
            "offloaded_bytes": {t: int(sum(int(self.sizes[o.tensor]) for o in self.offloads if o.tier == t)) for t in self.tiers},
            "planned_peak_bytes": self.device.max(),
        }
        info.update(meta or {})
        return Plan(policy=policy, moves=tuple(moves), budget_bytes=self.budget, meta=info)

    def no_fit(self, policy: str, what: str) -> PlanError:
        """The error to raise when the paper's plan cannot meet the budget."""
        if self.refused:
            what += f" ({self.refused} more found no room: " + ", ".join(
                f"{t} holds {fmt_bytes(self.hw.tier(t).capacity)}"
                for t in self.tiers
                if np.isfinite(self.hw.tier(t).capacity)
            ) + ")"
        return no_fit(policy, self.trace, self.hw, self.budget, what, self.device.v, self.tiers)


def no_fit(
    policy: str,
    trace: Trace,
    hardware: Hardware,
    budget: float,
    what: str,
    device_curve: np.ndarray,
    tiers: dict[str, Curve] | None = None,
    host_optimizer: bool = False,
) -> PlanError:
    """A :class:`PlanError` saying why ``policy`` cannot meet ``budget``, in bytes
    (``host_optimizer``: the optimizer ops run on the host and are left out of the
    minimum working set)."""
    from . import min_working_set

    need, need_op = min_working_set(trace, host_optimizer)
    op = int(np.argmax(device_curve)) if len(device_curve) else 0
    peak = int(device_curve[op]) if len(device_curve) else 0
    full = [
        f"{t} full ({fmt_bytes(hardware.tier(t).capacity)})"
        for t, c in (tiers or {}).items()
        if c.max() + 0 >= 0.999 * hardware.tier(t).capacity
    ]
    msg = (
        f"{policy}: no plan fits in {fmt_bytes(budget)} ({int(budget)} bytes) on {hardware.name}: "
        f"{what}, {fmt_bytes(peak)} ({peak} bytes) stay planned on {hardware.device} at op {op} "
        f"({trace.ops[op].name if trace.n_ops else '-'}); the minimum working set is {need} bytes (op {need_op})"
    )
    if full:
        msg += "; " + ", ".join(full)
    return PlanError(msg)


def phase_start(trace: Trace, phase: str) -> int | None:
    """Index of the first op of ``phase``, or ``None``."""
    return next((i for i, o in enumerate(trace.ops) if o.phase == phase), None)


def pick_tier(hardware: Hardware, kinds: tuple[str, ...]) -> str:
    """The fastest offload tier whose kind is the first of ``kinds`` present, else the
    fastest offload tier (e.g. ``("host",)`` on ``cpu-dram-pmem`` gives ``pmem``)."""
    tiers = hardware.offload_tiers
    if not tiers:
        raise PlanError(f"hardware {hardware.name}: no tier to offload to from {hardware.device}")
    for kind in kinds:
        for t in tiers:
            if hardware.tier(t).kind == kind:
                return t
    return tiers[0]


def issue_order(moves: list[Move] | tuple[Move, ...], trace: Trace) -> tuple[Move, ...]:
    """``moves`` in the order to issue them at each op: evictions first, smallest first
    (shortest-processing-time order on a copy queue, so room comes back soonest), then
    prefetches by the op that needs them (earliest deadline first, the next
    iteration's after this one's), smallest first among equals. Issue order matters
    because each copy queue serves its transfers one after another."""
    n, sizes = trace.n_ops, trace.sizes

    def key(m: Move) -> tuple[int, int, int, int, int]:
        size = int(sizes[m.tensor])
        if m.kind == "evict":
            return (m.after_op, 0, 0, size, m.tensor)
        need = m.needed_by if m.needed_by is not None else m.after_op + 1
        return (m.after_op, 1, need if need > m.after_op else need + n, size, m.tensor)

    return tuple(sorted(moves, key=key))
