"""The pool problem: buffers with known lifetimes and sizes, and a solution's offsets.

A buffer is live on the half-open interval ``[lower, upper)`` and needs ``size``
contiguous bytes. A solution gives every buffer an ``offset`` (a multiple of the
problem's ``alignment``) so that any two buffers live at the same time occupy disjoint
byte ranges ``[offset, offset + size)``. Its cost is the peak, ``max(offset + size)``.

This module holds only the model and its formats: the MiniMalloc CSV
(``id,lower,upper,size`` in, ``id,lower,upper,size,offset`` out) and the conversion from
a :class:`~tierflow.trace.Trace` (optionally with a :class:`~tierflow.plan.Plan`, for the
residency of one tier). Solvers live in :mod:`.greedy`, :mod:`.best` and :mod:`.exact`;
the checker in :mod:`.validate` shares no code with them.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import TierflowError

if TYPE_CHECKING:  # imported for annotations only: keeps ``tierflow.pool`` light
    from ..hardware import Hardware
    from ..plan import Plan
    from ..trace import Trace

CSV_FIELDS = ("id", "lower", "upper", "size")


class PoolError(TierflowError):
    """A pool problem or solution file is malformed, or a solution is invalid."""


@dataclass(frozen=True, slots=True)
class Buffer:
    """One block to place.

    Attributes:
        id: label, unique within a problem (the CSV ``id`` column).
        lower: first instant the buffer is live.
        upper: first instant it is no longer live (``upper > lower``).
        size: bytes (``>= 0``).
    """

    id: str
    lower: int
    upper: int
    size: int


@dataclass(frozen=True)
class Problem:
    """Buffers to place in one arena.

    Attributes:
        buffers: the buffers, in input order (solutions list offsets in this order).
        alignment: every offset must be a multiple of it (1: no constraint).
        name: a label for reports (the file stem for CSV input).
    """

    buffers: tuple[Buffer, ...]
    alignment: int = 1
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "buffers", tuple(self.buffers))
        if not isinstance(self.alignment, (int, np.integer)) or self.alignment < 1:
            raise PoolError(f"problem {self.name!r}: alignment must be a positive integer, got {self.alignment!r}")
        seen: set[str] = set()
        for i, b in enumerate(self.buffers):
            where = f"problem {self.name!r}: buffer {i} (id {b.id!r})"
            if b.id in seen:
                raise PoolError(f"{where}: duplicate id")
            seen.add(b.id)
            if b.size < 0:
                raise PoolError(f"{where}: size {b.size} is negative")
            if b.upper <= b.lower:
                raise PoolError(f"{where}: upper {b.upper} must exceed lower {b.lower}")

    def __len__(self) -> int:
        return len(self.buffers)

    @cached_property
    def lower(self) -> np.ndarray:
        return np.fromiter((b.lower for b in self.buffers), dtype=np.int64, count=len(self.buffers))

    @cached_property
    def upper(self) -> np.ndarray:
        return np.fromiter((b.upper for b in self.buffers), dtype=np.int64, count=len(self.buffers))

    @cached_property
    def size(self) -> np.ndarray:
        return np.fromiter((b.size for b in self.buffers), dtype=np.int64, count=len(self.buffers))

    @cached_property
    def units(self) -> np.ndarray:
        """Sizes in alignment units, rounded up: with offsets on the alignment grid, a
        buffer blocks its neighbours up to the next grid line, so solvers work in these."""
        a = self.alignment
        return (self.size + a - 1) // a

    @cached_property
    def cross_iteration(self) -> np.ndarray:
        """Buffers live at both ends of the horizon: in a repeated iteration they stay
        allocated across the boundary (SmartPool places them first)."""
        if not self.buffers:
            return np.zeros(0, dtype=bool)
        return (self.lower <= self.lower.min()) & (self.upper >= self.upper.max())

    @cached_property
    def lower_bound(self) -> int:
        """The most bytes live at one instant: no placement can peak lower."""
        return lower_bound(self)


def lower_bound(problem: Problem, units: bool = False) -> int:
    """Max over instants of the total size of the buffers live then.

    Args:
        problem: the problem.
        units: sum sizes in alignment units (the bound the solvers work against) rather
            than bytes.
    """
    if not len(problem):
        return 0
    sizes = problem.units if units else problem.size
    times = np.concatenate([problem.lower, problem.upper])
    delta = np.concatenate([sizes, -sizes])
    # at equal times, ends (negative deltas) come first: lifetimes are half-open
    order = np.lexsort((delta, times))
    return int(max(0, np.cumsum(delta[order]).max()))


@dataclass
class Solution:
    """Offsets for every buffer of a problem, in the problem's order.

    Attributes:
        offsets: int64 array, bytes.
        peak: ``max(offset + size)`` (0 for an empty problem).
        lower_bound: the problem's lower bound (bytes).
        solver: the solver that produced it.
        seconds: wall time the solver took.
        optimal: the peak is proven minimal (it meets the bound, or an exact search
            exhausted every better capacity).
        meta: solver facts (nodes searched, attempts, the heuristic that won).
    """

    offsets: np.ndarray
    peak: int
    lower_bound: int
    solver: str
    seconds: float = 0.0
    optimal: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """Peak over lower bound (1.0 for an empty problem)."""
        return self.peak / self.lower_bound if self.lower_bound else 1.0

    def offset_of(self, problem: Problem) -> dict[str, int]:
        """Buffer id to offset."""
        return {b.id: int(o) for b, o in zip(problem.buffers, self.offsets)}


def peak_of(problem: Problem, offsets: np.ndarray) -> int:
    return int((offsets + problem.size).max()) if len(problem) else 0


# -- CSV ---------------------------------------------------------------------------------

def read_csv(path: str | Path, alignment: int = 1) -> Problem:
    """Read a MiniMalloc CSV (``id,lower,upper,size``; extra columns such as ``offset``
    are ignored).

    Raises:
        PoolError: naming the file, line and field at fault.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PoolError(f"{path}: cannot read ({e})") from None
    rows = csv.reader(text.splitlines())
    header = next(rows, None)
    if header is None:
        raise PoolError(f"{path}: empty file, expected a header line 'id,lower,upper,size'")
    header = [h.strip() for h in header]
    missing = [f for f in CSV_FIELDS if f not in header]
    if missing:
        raise PoolError(f"{path}: line 1: header lacks field(s) {', '.join(missing)} (has {','.join(header)})")
    col = {f: header.index(f) for f in CSV_FIELDS}
    buffers: list[Buffer] = []
    for line, row in enumerate(rows, start=2):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) < len(header):
            raise PoolError(f"{path}: line {line}: {len(row)} fields, the header has {len(header)}")
        vals: dict[str, int] = {}
        for f in CSV_FIELDS[1:]:
            raw = row[col[f]].strip()
            try:
                vals[f] = int(raw)
            except ValueError:
                raise PoolError(f"{path}: line {line}: field '{f}' is {raw!r}, not an integer") from None
        bid = row[col["id"]].strip()
        if vals["size"] < 0:
            raise PoolError(f"{path}: line {line}: field 'size' is negative ({vals['size']})")
        if vals["upper"] <= vals["lower"]:
            raise PoolError(
                f"{path}: line {line}: field 'upper' ({vals['upper']}) must exceed 'lower' ({vals['lower']})"
            )
        buffers.append(Buffer(bid, vals["lower"], vals["upper"], vals["size"]))
    try:
        return Problem(tuple(buffers), alignment=alignment, name=path.stem)
    except PoolError as e:
        raise PoolError(f"{path}: {e}") from None


def write_csv(path: str | Path, problem: Problem, offsets: Iterable[int]) -> Path:
    """Write the MiniMalloc output CSV: the input columns plus ``offset``."""
    path = Path(path)
    with path.open("w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow([*CSV_FIELDS, "offset"])
        for b, o in zip(problem.buffers, offsets):
            w.writerow([b.id, b.lower, b.upper, b.size, int(o)])
    return path


# -- from a trace and a plan ------------------------------------------------------------

def from_trace(
    trace: Trace,
    plan: Plan | None = None,
    hardware: Hardware | None = None,
    tier: str | None = None,
    alignment: int = 1,
) -> Problem:
    """The pool problem of one tier: every stay of a tensor on that tier is a buffer.

    Time is op indices: a stay during ops ``a..b`` (inclusive) is the buffer
    ``[a, b + 1)``. Without a plan every tensor stays on the device for its whole life
    (persistent tensors for the whole iteration). With a plan, the stays come from the
    plan's residency walk; a tensor that leaves and comes back gets one buffer per stay
    (it may come back at another offset), ids ``"<tensor>"`` or ``"<tensor>.<k>"``.

    A persistent tensor resident at both the end and the start of the iteration keeps
    its offset across the boundary, so its first and last stays are one allocation: it
    becomes a single buffer over the whole iteration (conservative when it is evicted in
    between), and is a cross-iteration block that greedy places first.

    Args:
        trace: the iteration.
        plan: a planned (non-reactive) plan; ``None`` means everything stays resident.
        hardware: required with a plan (the tiers the plan names).
        tier: the tier to plan the pool of; defaults to the device.
        alignment: offset alignment in bytes.

    Raises:
        PoolError: a plan without hardware, a reactive plan, or an unknown tier.
        PlanError: the plan is inconsistent with the trace.
    """
    sizes = trace.sizes
    n_ops = trace.n_ops
    stays: list[list[tuple[int, int]]]
    if plan is None:
        if tier is not None and hardware is not None and tier != hardware.device:
            raise PoolError(f"tier {tier!r}: without a plan only the device holds tensors")
        stays = [[(int(trace.birth[t]), int(trace.death[t]))] for t in range(trace.n_tensors)]
    else:
        if hardware is None:
            raise PoolError("from_trace with a plan needs the hardware the plan was made for")
        if plan.reactive:
            raise PoolError(f"plan {plan.policy} is reactive: its residency is decided at run time, not planned")
        if plan.recomputes or plan.host_steps:
            raise PoolError(f"plan {plan.policy} recomputes or host-steps: its pool problem is not modelled yet")
        tier = hardware.device if tier is None else tier
        if tier not in {t.name for t in hardware.tiers}:
            raise PoolError(f"tier {tier!r} is not a tier of {hardware.name}")
        stays = _plan_stays(plan, trace, hardware, tier)
    buffers: list[Buffer] = []
    for t, spans in enumerate(stays):
        merged: list[tuple[int, int]] = []
        for a, b in sorted(spans):  # back-to-back stays (evicted and refetched at once) are one
            if merged and a <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
            else:
                merged.append((a, b))
        spans = merged
        if len(spans) > 1 and trace.tensors[t].persistent and spans[0][0] == 0 and spans[-1][1] == n_ops - 1:
            spans = [(0, n_ops - 1)]
        for k, (a, b) in enumerate(spans):
            bid = str(t) if len(spans) == 1 else f"{t}.{k}"
            buffers.append(Buffer(bid, a, b + 1, int(sizes[t])))
    return Problem(tuple(buffers), alignment=alignment, name=trace.name)


def _plan_stays(plan: Plan, trace: Trace, hw: Hardware, tier: str) -> list[list[tuple[int, int]]]:
    """Per tensor, the op spans ``(first, last)`` it occupies ``tier`` under ``plan``,
    by the same walk :func:`tierflow.plan.validate` uses (run here after validating)."""
    from ..plan import _start_state, _tensor_walk, validate

    validate(plan, trace, hw)
    per_tensor: dict[int, list] = {}
    for m in plan.moves:
        per_tensor.setdefault(m.tensor, []).append(m)
    out: list[list[tuple[int, int]]] = []
    for t in range(trace.n_tensors):
        moves = sorted(per_tensor.get(t, []), key=lambda m: (m.after_op, m.kind != "evict"))
        uses = trace.uses(t).tolist()
        if trace.tensors[t].persistent:
            lo, hi, start = 0, trace.n_ops - 1, _start_state(moves, uses)
        else:
            lo, hi, start = int(trace.birth[t]), int(trace.death[t]), ("on", None, None)
        spans, _ = _tensor_walk(plan.policy, t, moves, set(uses), lo, hi, start, hw.device)
        out.append([(a, b) for a, b, where in spans if where == tier and b >= a])
    return out


__all__ = [
    "Buffer",
    "PoolError",
    "Problem",
    "Solution",
    "from_trace",
    "lower_bound",
    "peak_of",
    "read_csv",
    "write_csv",
]
