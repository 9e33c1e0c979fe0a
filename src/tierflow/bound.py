"""The physical limit: a proven upper bound on the ratio (ideal / step time) any plan can reach.

``tierflow bound TRACE --hardware H [--budget B]`` solves a linear program whose optimum
is a lower bound on the stall time of *every* plan the simulator can execute, planned or
reactive, and prints ``ideal / (ideal + that stall)``.

The argument (why it is a proof)
--------------------------------
Take any plan and the timeline the simulator produces for its reported (second)
iteration. Measure time from the iteration's start ``W`` (the end of the first
iteration's last op). Op ``k`` starts at ``s_k`` after a stall ``σ_k >= 0`` and runs
``d_k``, so ``s_k = Σ_{i<k} d_i + Σ_{i<=k} σ_i`` and the step time is
``ideal + Σ σ_k``. We derive facts every such timeline satisfies, and minimise
``Σ σ_k`` subject to them only; the minimum can only be lower than the truth.

1. *Memory at check points.* At ``s_k`` every tensor live at op ``k`` (born at or before
   ``k``, not yet dead; persistent ones always) is either fully on the device (resident,
   being fetched — a fetch reserves its bytes when issued — or being evicted — an
   eviction holds its bytes until it completes) or fully off it. So the bytes off the
   device at ``s_k`` are at least ``live_bytes[k] - budget``. We impose this only at a
   chosen set of check ops ``p_1 < … < p_m`` (dropping constraints relaxes).
2. *Which bytes can be off.* A tensor used by op ``k`` is on the device at ``s_k``. So a
   byte off the device at ``s_{p_j}`` belongs to one *gap piece* of a tensor with
   ``p_j`` strictly inside it: a gap between two uses ``a < p_j < b``; for a
   persistent tensor whose idle time wraps the iteration boundary, the *start piece*
   (ops before its first use, where it may already be off when the iteration begins, no
   eviction needed) or the *end piece* (ops after its last use, where it may leave and
   need not come back within the measured iteration). Non-persistent tensors are born
   on the device, so being off needs an eviction first. A gap piece's bytes may leave
   only after ``e_a`` (op ``a`` ended) and must be back by ``s_b``.
3. *Bandwidth.* Transfers are fluid flows over the hardware's resources (each link of
   the route, each bus those links name, the source tier's read and destination tier's
   write bandwidth). Over any interval of length ``Δ`` the bytes a resource carries are
   at most its bandwidth times ``Δ`` (latencies and fault costs only lower real rates).
   The interval between two check ops has length ``Σ d + Σ σ`` over its ops.
4. *Capacity of other tiers.* Off-device bytes sit in some tier; each tier's inventory
   changes only through the transfers in (3) and never exceeds its capacity.

Relaxations that keep the program small (each only enlarges the feasible set): a
tensor's bytes may be split fluidly (in part off, in part on); transfers between two
check ops are aggregated; gap pieces that contain the same check ops and have the same
ends are merged (their sum satisfies every constraint the parts do); tier inventories
are tracked in aggregate (a byte evicted to one tier may return from another, as long as
every inventory stays within ``[0, capacity]``); the engines' FIFO order, latencies and
the start state (any placement within capacities, in-flight transfers as fractionally
moved bytes) are free. Dead tensors that a liveness-blind pager keeps only add
occupancy, so the bound holds for reactive plans too. The program is solved by HiGHS;
the reported stall is the optimum less a small solver tolerance.

What :func:`physical_bound` does not cover: plans that recompute or host-step (a
dropped tensor leaves the device with no transfer, and a host-stepped optimizer op leaves
the compute stream), and any hardware beyond the :class:`~tierflow.hardware.Hardware`
model.

The levers bound (:func:`levers_bound`)
---------------------------------------
A second program, valid for *every* plan the simulator runs, moves only or with
recomputes and host steps. It relaxes the first one three ways, each of which only
enlarges the feasible set, so it is never above :func:`physical_bound`:

5. *Optimizer ops need nothing.* Any optimizer op may be host-stepped, and then touches
   nothing on the device: the program ignores the optimizer ops' uses (optimizer state
   may be off the device all iteration at no cost; a gradient may leave after its last
   backward use at no cost; a parameter's idle time wraps from its last backward use).
6. *Optimizer time may leave the stream.* A slot's length is its op time plus its
   non-op time less any share ``η`` of the optimizer op time in it, and the step time
   is ``ideal + Σ σ - Σ η`` (the host's compute and the host steps' copies are free).
   The levers bound may therefore exceed ratio 1.
7. *Dropping costs compute, not bandwidth.* A gap piece of a non-persistent tensor
   (between two uses) may instead be dropped for the whole gap, at no transfer: its
   chain must re-run the forward op the tensor is born at, which costs that op's
   duration ``d_k``; one re-run re-creates all ``B_k`` bytes born there, so each dropped
   byte is charged ``d_k / B_k`` seconds (rounded down to a grid of 2^(1/4) steps, by
   which classes are merged), a lower bound on what the chains cost in all. A slot's
   non-op time ``σ`` then holds stalls and chains, and ``Σ σ`` is at least the charge.
   A chain's inputs, temporaries and RNG state are not constrained.

Example:
    >>> from tierflow import load_hardware
    >>> from tierflow.synthetic import gpt_trace
    >>> hw = load_hardware("rtx4090-24g")
    >>> trace = gpt_trace(hw, layers=2, d_model=256, batch=2, seq=128)
    >>> physical_bound(trace, hw).bound_ratio
    1.0
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .hardware import Hardware
from .trace import Trace

_GB = 1e9  # the program works in GB and seconds, which keeps HiGHS well scaled
_TOL_S = 1e-9  # subtracted from the solver's optimum (absolute, seconds per ideal second)
_METHOD = "highs-ipm"


@dataclass(frozen=True)
class BoundResult:
    """What :func:`physical_bound` proves.

    Attributes:
        bound_ratio: upper bound on ``ideal / step time`` for every plan (0 when no plan
            can run: the budget or the tiers' capacities cannot hold the working set).
        bound_time_s: lower bound on the step time.
        ideal_s: sum of op durations.
        stall_s: lower bound on the total stall.
        seconds: time to build and solve the program.
        check_ops: the ops at which memory was checked.
        status: ``"optimal"``, ``"fits"`` (nothing is over the budget: the bound is 1)
            or ``"infeasible"``.
        size: variables and constraints of the program.
    """

    bound_ratio: float
    bound_time_s: float
    ideal_s: float
    stall_s: float
    seconds: float
    check_ops: tuple[int, ...] = ()
    status: str = "optimal"
    size: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "bound_ratio": self.bound_ratio,
            "bound_time_s": self.bound_time_s,
            "ideal_s": self.ideal_s,
            "stall_s": self.stall_s,
            "seconds": self.seconds,
            "status": self.status,
            "check_ops": len(self.check_ops),
            **self.size,
        }


def choose_check_ops(trace: Trace, budget: float, points: int, live: np.ndarray | None = None) -> np.ndarray:
    """Ops at which the program checks memory: among the ops whose live bytes (``live``,
    default the trace's) exceed the budget, the worst one in each of ``points`` equal
    slices of the (ideal) time span they cover, plus the overall peak. Any choice gives a
    valid bound; more points give a tighter one."""
    live = trace.live_bytes if live is None else live
    over = np.flatnonzero(live > budget)
    if over.size == 0:
        return over
    if over.size <= points:
        return over
    start = trace.op_start_s[over]
    # slice the span where memory is over the budget, not the whole iteration
    edges = np.linspace(float(start[0]), float(start[-1]) * (1 + 1e-12) + 1e-12, points + 1)
    seg = np.clip(np.searchsorted(edges, start, side="right") - 1, 0, points - 1)
    chosen = {int(live.argmax())}
    live = live[over]
    # the highest live bytes of each slice: sort by (slice, -live), take each slice's first
    order = np.lexsort((-live, seg))
    first = np.ones(order.size, dtype=bool)
    first[1:] = seg[order][1:] != seg[order][:-1]
    chosen.update(int(x) for x in over[order[first]])
    return np.array(sorted(chosen), dtype=np.int64)


@dataclass(frozen=True)
class _View:
    """What the program reads of the trace: live bytes and working set per op, and the
    gap pieces ``(tensor, after_op, before_op, wraps)``; with the levers, also the ops'
    optimizer time, the per-byte cost of dropping each tensor and the tensors never
    needed on the device."""

    live: np.ndarray
    working_set: np.ndarray
    gaps: list[tuple[int, int, int, bool]]
    opt_s: np.ndarray | None = None  # per op: its duration if an optimizer op, else 0
    drop_s_per_byte: dict[int, float] = field(default_factory=dict)
    never_needed: tuple[int, ...] = ()
    # per op: host-work bytes per second of its duration if it is host-stepped (inf for
    # ops that are not optimizer ops or take no time: they take nothing off the stream)
    host_s_per_s: np.ndarray | None = None


def _move_view(trace: Trace) -> _View:
    return _View(trace.live_bytes, trace.working_set_bytes,
                 [(g.tensor, g.after_op, g.before_op, g.wraps) for g in trace.gaps])


def _levers_view(trace: Trace) -> _View:
    """The trace as the levers bound relaxes it (items 5 and 7 of the module docstring)."""
    n = trace.n_ops
    opt = np.fromiter((o.phase == "optimizer" for o in trace.ops), dtype=bool, count=n)
    sizes, persistent, first = trace.sizes, trace.persistent, trace.first_use
    delta = np.zeros(n + 1, dtype=np.int64)
    gaps: list[tuple[int, int, int, bool]] = []
    never: list[int] = []
    for t in range(trace.n_tensors):
        u = [x for x in trace.uses(t).tolist() if not opt[x]]
        size = int(sizes[t])
        if persistent[t]:
            delta[0] += size
            delta[n] -= size
            if not u:
                never.append(t)
                continue
            a, b = u[-1], u[0]
            if not (a == n - 1 and b == 0):
                gaps.append((t, a, b, True))
        elif u:
            delta[u[0]] += size
            delta[u[-1] + 1] -= size
        gaps += [(t, a, b, False) for a, b in zip(u, u[1:]) if b > a + 1]
    # one re-run of the op a tensor is born at re-creates every tensor born there
    born_bytes: dict[int, int] = {}
    for t in range(trace.n_tensors):
        k = int(first[t])
        if not persistent[t] and t in trace.ops[k].outputs and trace.ops[k].phase == "forward":
            born_bytes[k] = born_bytes.get(k, 0) + int(sizes[t])
    drop: dict[int, float] = {}
    for t, _, _, wraps in gaps:
        k = int(first[t])
        if not wraps and k in born_bytes and t in trace.ops[k].outputs and born_bytes[k] > 0:
            drop[t] = trace.ops[k].duration_s / born_bytes[k]
    ws = np.where(opt, 0, trace.working_set_bytes)
    # a host step processes its parameter, gradient and state; an optimizer op stands for
    # a share of that: each such tensor's bytes split evenly among the optimizer ops
    # touching it (so the shares of one host step's ops never exceed its work)
    n_opt: dict[int, int] = {}
    for k in np.flatnonzero(opt).tolist():
        for t in trace.op_tensors[k]:
            n_opt[t] = n_opt.get(t, 0) + 1
    work_kinds = ("parameter", "gradient", "optimizer_state")
    per = np.full(n, math.inf)
    for k in np.flatnonzero(opt).tolist():
        d = trace.ops[k].duration_s
        if d > 0:
            w = sum(int(sizes[t]) / n_opt[t] for t in trace.op_tensors[k] if trace.tensors[t].kind in work_kinds)
            per[k] = w / d
    return _View(np.cumsum(delta[:-1]), ws, gaps, np.where(opt, trace.durations, 0.0), drop, tuple(never), per)


def _slot_min(per_op: np.ndarray, bnd: np.ndarray) -> list[float]:
    """Per slot (ops ``bnd[j-1]`` to ``bnd[j]``), the least of ``per_op`` over its ops (inf
    where it holds none)."""
    return [float(per_op[a:b].min(initial=math.inf)) for a, b in zip(bnd[:-1].tolist(), bnd[1:].tolist())]


def _rate_floor(rate: float) -> float:
    """``rate`` rounded down to the grid ``2^(k/4)`` (0 stays 0)."""
    if rate <= 0.0:
        return 0.0
    return 2.0 ** (math.floor(math.log2(rate) * 4) / 4) * (1 - 1e-12)


def _resources(hw: Hardware, src: str, dst: str) -> dict[str, float]:
    """The shared resources a copy from ``src`` to ``dst`` crosses, with bytes/s; the same
    set the simulator's copy engines share max-min fairly."""
    out: dict[str, float] = {}
    for link in hw.route(src, dst):
        out[f"link:{link.name}"] = link.bandwidth
        for b in link.buses:
            out[f"bus:{b}"] = hw.buses[b]
    for name, bw in ((f"read:{src}", hw.tier(src).read_bw), (f"write:{dst}", hw.tier(dst).write_bw)):
        if bw != math.inf:
            out[name] = bw
    return out


def physical_bound(
    trace: Trace,
    hardware: Hardware,
    budget: float | None = None,
    *,
    points: int = 100,
) -> BoundResult:
    """A proven upper bound on the ratio any plan reaches (see the module docstring).

    Args:
        trace: the training iteration.
        hardware: the machine: offload tiers, their capacities, links and buses.
        budget: device bytes a plan may use (default: the device's capacity).
        points: how many check ops at most. More makes the bound tighter and the program
            larger (variables grow about linearly, solve time faster): 100 solves G10's
            cases in 0.5-12 s on a 2-core CPU; 200 tightened ViT's bound by 0.002 only.

    Returns:
        A :class:`BoundResult`.

    Example:
        >>> from tierflow import load_hardware
        >>> from tierflow.synthetic import gpt_trace
        >>> hw = load_hardware("rtx4090-24g")
        >>> tr = gpt_trace(hw, layers=4, d_model=1024, batch=8, seq=512)
        >>> r = physical_bound(tr, hw, budget=tr.peak_live_bytes * 0.4)
        >>> 0 < r.bound_ratio <= 1
        True
    """
    return _bound(trace, hardware, budget, points, _move_view(trace))


def levers_bound(
    trace: Trace,
    hardware: Hardware,
    budget: float | None = None,
    *,
    points: int = 100,
) -> BoundResult:
    """A proven upper bound on the ratio any plan reaches, also one that recomputes or
    host-steps (the relaxations are items 5-7 of the module docstring). Never above
    :func:`physical_bound`; it may exceed 1, as host steps take optimizer time off the
    compute stream.

    Args and Returns: as :func:`physical_bound`; ``stall_s`` is then the least non-op
    time less the optimizer time taken off the stream (it may be negative).

    Example:
        >>> from tierflow import load_hardware
        >>> from tierflow.synthetic import gpt_trace
        >>> hw = load_hardware("rtx4090-24g")
        >>> tr = gpt_trace(hw, layers=4, d_model=1024, batch=8, seq=512)
        >>> b = tr.peak_live_bytes * 0.4
        >>> levers_bound(tr, hw, b).bound_ratio >= physical_bound(tr, hw, b).bound_ratio
        True
    """
    return _bound(trace, hardware, budget, points, _levers_view(trace))


def _bound(trace: Trace, hardware: Hardware, budget: float | None, points: int, view: _View) -> BoundResult:
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    t0 = time.perf_counter()
    B = float(hardware.device_capacity if budget is None else budget)
    ideal = trace.ideal_s
    n = trace.n_ops
    live = view.live
    ws = view.working_set
    levers = view.opt_s is not None
    # optimizer time every plan may take off the stream (0 without the levers)
    opt_total = float(view.opt_s.sum()) if levers else 0.0
    if n and ws.max() > B:
        return BoundResult(0.0, math.inf, ideal, math.inf, time.perf_counter() - t0, (), "infeasible")
    P = choose_check_ops(trace, B, points, live)
    if len(P) == 0:
        t = ideal - opt_total
        return BoundResult(ideal / t if t > 0 else 1.0, t, ideal, -opt_total, time.perf_counter() - t0, (), "fits")
    dev = hardware.device
    tiers = [t for t in hardware.offload_tiers]
    if not tiers and not levers:
        return BoundResult(0.0, math.inf, ideal, math.inf, time.perf_counter() - t0, tuple(P.tolist()), "infeasible")

    # -- slots: slot j (1..m+1) runs from the start of check op p_{j-1} (time 0 for j=1)
    # to the start of p_j; the last one ends at the start of the last op, by which every
    # transfer that matters here is done (a fetch is due when its op starts); its fixed
    # length is the op time inside it.
    # Memory is checked at two instants per check op, its start and its end: the live
    # set is the same throughout the op, so bytes fetched during it must fit as well.
    starts = trace.op_start_s
    inst_op = np.repeat(P, 2)
    inst_end = np.tile([False, True], len(P))
    inst_t = starts[inst_op] + np.where(inst_end, trace.durations[inst_op], 0.0)
    m = len(inst_op)
    tau = np.concatenate([[0.0], inst_t, [max(starts[n - 1], inst_t[-1])]])
    slot_len = np.diff(tau)  # m+1 entries, index j-1

    # -- gap pieces -> classes (l, r, init_free, end_free, drop cost) with summed bytes
    # (in GB); the drop cost (seconds per GB, rounded down) is None where the piece
    # cannot be dropped
    classes: dict[tuple[int, int, bool, bool, float | None], float] = {}
    sizes = trace.sizes

    def add(lo_op: int, hi_op: int, init_free: bool, end_free: bool, nbytes: int, cost: float | None = None) -> None:
        """A piece off-able at ops lo_op..hi_op (inclusive)."""
        lft = int(np.searchsorted(inst_op, lo_op, side="left")) + 1  # first instant in lo_op..
        rgt = int(np.searchsorted(inst_op, hi_op, side="right"))  # last instant in ..hi_op
        if lft > rgt:
            return
        key = (lft, rgt, init_free, end_free, cost)
        classes[key] = classes.get(key, 0.0) + nbytes / _GB

    drop = view.drop_s_per_byte
    for t, after, before, wraps in view.gaps:
        size = int(sizes[t])
        if not wraps:
            cost = _rate_floor(drop[t] * _GB) if t in drop else None
            add(after + 1, before - 1, False, False, size, cost)
        else:
            if before > 0:
                add(0, before - 1, True, False, size)
            if after < n - 1:
                add(after + 1, n - 1, False, True, size)
    for t in view.never_needed:  # off the whole iteration, never fetched
        add(0, n - 1, True, True, int(sizes[t]))

    # -- variables
    nv = 0

    def alloc(k: int) -> int:
        nonlocal nv
        nv += k
        return nv - k

    sigma = alloc(m + 1)  # stall per slot, slot j at sigma + j - 1
    lb: list[float] = [0.0] * (m + 1)
    # no stall inside an op: a slot that ends at an op's end is exactly its duration
    ub: list[float] = [0.0 if j < m and inst_end[j] else math.inf for j in range(m + 1)]
    eta = None
    opt_tail = 0.0
    if levers:
        # optimizer time in each slot that a plan may take off the stream; slot j ends
        # at op boundary ``bnd[j]`` (an op's start, or its end)
        opt_cum = np.concatenate([[0.0], np.cumsum(view.opt_s)])
        bnd = np.concatenate([[0], inst_op + inst_end.astype(np.int64), [max(n - 1, int(inst_op[-1] + inst_end[-1]))]])
        in_slot = np.diff(opt_cum[bnd])
        opt_tail = float(opt_cum[n] - opt_cum[bnd[-1]])
        eta = alloc(m + 2)  # slots 1..m+1, then the ops after the last slot
        lb += [0.0] * (m + 2)
        ub += [max(0.0, float(v)) for v in in_slot] + [max(0.0, opt_tail)]
    drop_terms: list[tuple[int, float]] = []  # (variable, seconds per GB)
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    eq_rhs: list[float] = []
    n_eq = 0
    ub_rows: list[int] = []
    ub_cols: list[int] = []
    ub_vals: list[float] = []
    ub_rhs: list[float] = []
    n_ub = 0
    # per slot j (1..m+1): lists of (var) for total out / total in
    out_terms: list[list[int]] = [[] for _ in range(m + 2)]
    in_terms: list[list[int]] = [[] for _ in range(m + 2)]
    off_at: list[list[int]] = [[] for _ in range(m + 1)]  # per instant 1..m
    init_vars: list[int] = []

    for (lft, rgt, init_free, end_free, cost), size in sorted(classes.items(), key=lambda kv: (kv[0][:4], kv[0][4] or -1.0)):
        span = rgt - lft + 1
        o = alloc(span)  # off bytes at check j: o + (j - lft)
        x = alloc(span)  # evicted during slot j
        y = alloc(span - 1) if span > 1 else nv  # fetched during slot j (lft+1..rgt)
        lb += [0.0] * (3 * span - 1)
        ub += [size] * span + [math.inf] * (2 * span - 1)
        z = None
        if init_free:
            z = alloc(1)
            lb.append(0.0)
            ub.append(size)
            init_vars.append(z)
        if cost is not None:
            # dropped for the whole gap: off at every check in it, with what moves
            d = alloc(1)
            lb.append(0.0)
            ub.append(size)
            drop_terms.append((d, cost))
            for j in range(lft, rgt + 1):
                ub_rows += [n_ub, n_ub]
                ub_cols += [o + j - lft, d]
                ub_vals += [1.0, 1.0]
                ub_rhs.append(size)
                n_ub += 1
                off_at[j].append(d)
        for j in range(lft, rgt + 1):
            k = j - lft
            # o_j - o_{j-1} - x_j + y_j (- z at j = lft) = 0
            rows += [n_eq, n_eq]
            cols += [o + k, x + k]
            vals += [1.0, -1.0]
            if k > 0:
                rows += [n_eq, n_eq]
                cols += [o + k - 1, y + k - 1]
                vals += [-1.0, 1.0]
                in_terms[j].append(y + k - 1)
            elif z is not None:
                rows.append(n_eq)
                cols.append(z)
                vals.append(-1.0)
            eq_rhs.append(0.0)
            n_eq += 1
            out_terms[j].append(x + k)
            off_at[j].append(o + k)
        if not end_free:
            in_terms[rgt + 1].append(o + span - 1)  # everything comes back in slot r+1

    # per-tier totals and inventories
    X = {T: alloc(m + 1) for T in tiers}  # slot j at X[T] + j - 1
    Y = {T: alloc(m + 1) for T in tiers}
    inv = {T: alloc(m + 2) for T in tiers}  # inventory at tau_j, j=0..m+1
    for T in tiers:
        cap = hardware.tier(T).capacity / _GB
        lb += [0.0] * (2 * (m + 1)) + [0.0] * (m + 2)
        ub += [math.inf] * (2 * (m + 1)) + [cap] * (m + 2)
    for j in range(1, m + 2):
        # Σ class out - Σ_T X_T = 0 ; Σ class in - Σ_T Y_T = 0
        for terms, tot in ((out_terms[j], X), (in_terms[j], Y)):
            rows += [n_eq] * (len(terms) + len(tiers))
            cols += terms + [tot[T] + j - 1 for T in tiers]
            vals += [1.0] * len(terms) + [-1.0] * len(tiers)
            eq_rhs.append(0.0)
            n_eq += 1
        for T in tiers:  # I_j - I_{j-1} - X_j + Y_j = 0
            rows += [n_eq] * 4
            cols += [inv[T] + j, inv[T] + j - 1, X[T] + j - 1, Y[T] + j - 1]
            vals += [1.0, -1.0, -1.0, 1.0]
            eq_rhs.append(0.0)
            n_eq += 1
    # initial inventories hold exactly the start pieces' initially-off bytes
    rows += [n_eq] * (len(tiers) + len(init_vars))
    cols += [inv[T] for T in tiers] + init_vars
    vals += [1.0] * len(tiers) + [-1.0] * len(init_vars)
    eq_rhs.append(0.0)
    n_eq += 1

    # memory at each check op: Σ off >= live - budget
    for j in range(1, m + 1):
        need = (float(live[inst_op[j - 1]]) - B) / _GB
        if need <= 0:
            continue
        ub_rows += [n_ub] * len(off_at[j])
        ub_cols += off_at[j]
        ub_vals += [-1.0] * len(off_at[j])
        ub_rhs.append(-need)
        n_ub += 1

    # bandwidth of every shared resource in every slot
    res_out = {T: _resources(hardware, dev, T) for T in tiers}
    res_in = {T: _resources(hardware, T, dev) for T in tiers}
    names = sorted({r for d in (*res_out.values(), *res_in.values()) for r in d})
    for name in names:
        cap = None
        users: list[tuple[dict[str, int], str]] = []
        for T in tiers:
            if name in res_out[T]:
                cap = res_out[T][name]
                users.append((X, T))
            if name in res_in[T]:
                cap = res_in[T][name]
                users.append((Y, T))
        assert cap is not None
        c = cap / _GB
        for j in range(1, m + 2):
            ub_rows += [n_ub] * (len(users) + 1)
            ub_cols += [var[T] + j - 1 for var, T in users] + [sigma + j - 1]
            ub_vals += [1.0] * len(users) + [-c]
            if eta is not None:  # optimizer time off the stream shortens the slot
                ub_rows.append(n_ub)
                ub_cols.append(eta + j - 1)
                ub_vals.append(c)
            ub_rhs.append(c * float(slot_len[j - 1]))
            n_ub += 1
    if eta is not None and hardware.host_compute is not None and view.host_s_per_s is not None:
        # the host's one stream runs an iteration's updates per iteration: their time,
        # at least (host seconds per optimizer second taken off) x (that time), is at
        # most the step, ideal + Σ σ - Σ η
        per = view.host_s_per_s / hardware.host_compute.optimizer_bytes_per_s
        coef = [*(float(c) for c in _slot_min(per, bnd)), float(per[bnd[-1]:].min(initial=math.inf))]
        coef = [c if math.isfinite(c) else 0.0 for c in coef]
        ub_rows += [n_ub] * (2 * (m + 2) - 1)
        ub_cols += [eta + j for j in range(m + 2)] + list(range(sigma, sigma + m + 1))
        ub_vals += [c + 1.0 for c in coef] + [-1.0] * (m + 1)
        ub_rhs.append(ideal)
        n_ub += 1
    if drop_terms:
        # the chains' compute is non-op time: Σ cost · dropped <= Σ σ
        ub_rows += [n_ub] * (len(drop_terms) + m + 1)
        ub_cols += [d for d, _ in drop_terms] + list(range(sigma, sigma + m + 1))
        ub_vals += [c for _, c in drop_terms] + [-1.0] * (m + 1)
        ub_rhs.append(0.0)
        n_ub += 1

    cost = np.zeros(nv)
    cost[sigma : sigma + m + 1] = 1.0
    if eta is not None:
        cost[eta : eta + m + 2] = -1.0
    A_eq = coo_matrix((vals, (rows, cols)), shape=(n_eq, nv)).tocsr()
    A_ub = coo_matrix((ub_vals, (ub_rows, ub_cols)), shape=(n_ub, nv)).tocsr()
    res = linprog(
        cost,
        A_ub=A_ub,
        b_ub=np.array(ub_rhs),
        A_eq=A_eq,
        b_eq=np.array(eq_rhs),
        bounds=np.column_stack([lb, ub]),
        method=_METHOD,
    )
    size = {"variables": nv, "constraints": n_eq + n_ub, "classes": len(classes)}
    elapsed = time.perf_counter() - t0
    if res.status == 2:
        return BoundResult(0.0, math.inf, ideal, math.inf, elapsed, tuple(P.tolist()), "infeasible", size)
    if res.status != 0:
        raise RuntimeError(f"bound: HiGHS did not solve the program ({res.message})")
    if levers:
        stall = float(res.fun) - _TOL_S * max(ideal, 1.0)
    else:
        stall = max(0.0, float(res.fun) - _TOL_S * max(ideal, 1.0))
    t = ideal + stall
    return BoundResult(ideal / t if t > 0 else 1.0, t, ideal, stall, elapsed, tuple(P.tolist()), "optimal", size)


# -- CLI ------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    """Add ``tierflow bound``."""
    from . import _cli_util as u

    p = subparsers.add_parser(
        "bound",
        help="the physical limit: a proven upper bound on the ratio any plan can reach",
        description=(
            "Solve a linear relaxation of every transfer schedule (device budget, tier "
            "capacities, per-link and bus bandwidth, ops in order) and print the best "
            "ratio ideal/step that any plan could reach on this machine: one bound for plans "
            "that only move tensors, and a looser one also valid for plans that recompute "
            "or run optimizer steps on the host (printed where it differs)."
        ),
    )
    u.add_trace_args(p)
    p.add_argument("--hardware", default="g10-a100", help="preset name or TOML file (default: g10-a100)")
    p.add_argument("--budget", default=None, help="device budget: bytes (20GiB) or share of the peak (30%%)")
    p.add_argument("--points", type=int, default=100, help="check ops at most (more: tighter, slower)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_handler)


def _handler(args: Any) -> int:
    from . import _cli_util as u
    from .hardware import load_hardware
    from .policies import resolve_budget
    from .units import fmt_bytes, fmt_seconds

    hw = load_hardware(args.hardware)
    trace = u.resolve_trace(args, hw)
    budget = resolve_budget(trace, hw, args.budget)
    r = physical_bound(trace, hw, budget, points=args.points)
    lev = levers_bound(trace, hw, budget, points=args.points)
    if args.json:
        u.print_json({**r.to_dict(), "levers": lev.to_dict()})
        return 0
    con = u.console()
    con.print(
        f"{trace.name} on {hw.name}, budget {fmt_bytes(budget)}: ideal {fmt_seconds(r.ideal_s)}; "
        f"no plan that only moves tensors can step faster than {fmt_seconds(r.bound_time_s)} "
        f"(ratio <= {r.bound_ratio:.4f}; {r.status}, {len(r.check_ops)} check ops, "
        f"solved in {r.seconds:.2f} s)"
    )
    if lev.bound_time_s != r.bound_time_s:
        host = "" if hw.host_compute is not None else "; no host compute model: host updates free"
        con.print(
            f"  with recompute and host steps too: no faster than {fmt_seconds(lev.bound_time_s)} "
            f"(ratio <= {lev.bound_ratio:.4f}; {lev.status}, solved in {lev.seconds:.2f} s{host})"
        )
    return 0
