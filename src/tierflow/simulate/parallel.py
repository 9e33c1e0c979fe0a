"""Data-parallel training in the simulator: one rank of N, its collectives on a comm stream.

Every rank of a data-parallel run runs the same iteration on its own micro-batch, so
one rank is simulated and the others are symmetric. :func:`rank_trace` turns the
per-rank trace (the model at the per-rank batch) into what one rank holds and does:

* ``ddp``: the trace is unchanged (every rank holds everything); gradients are grouped
  into buckets of about ``bucket_bytes`` in the order backward finishes them (DDP's
  buckets), and each bucket is **all-reduced** once its last gradient is final.
* ``fsdp``: parameters, optimizer state and the gradients the optimizer reads are
  sharded (1/N bytes each, rounded up); each parameter's uses in forward and in
  backward read a full-size *unsharded* copy (a new non-persistent tensor, live from
  its first to its last use in that phase, as FSDP reshards after forward), brought by
  an **all-gather**; the full gradients of a bucket feed a zero-time
  ``nccl:reduce_scatter`` op whose output is the sharded gradient the optimizer reads.
  All-gathers are issued one bucket ahead of need (FSDP2's default prefetch of the next
  unit): bucket ``k`` starts when bucket ``k-1``'s first use starts, bucket 0 at the
  iteration's start.

With one GPU both are the identity: no collectives, the plain simulation.

Costs follow the ring model on a link of bandwidth ``B`` (bytes/s per direction per
GPU) and per-hop latency ``a``, for ``S`` logical bytes over ``N`` ranks::

    all-reduce                  2(N-1)/N * S / B + 2(N-1) * a
    reduce-scatter, all-gather   (N-1)/N * S / B +  (N-1) * a

:func:`simulate_parallel` runs the plain simulator with a comm stream: the hardware
gains a ``peers`` tier reached over two links, ``interconnect:send`` (all-reduce,
reduce-scatter) and ``interconnect:gather`` (all-gather), that share one ``interconnect``
bus of bandwidth ``B`` (plus the buses the hardware's ``[interconnect]`` declares, so a
PCIe peer path can share the GPU's lanes). A collective is one transfer of its ring
bytes ``(N-1)/N * S`` (twice that for all-reduce) after its ring latency; the copy
engine of each link serves its collectives in order, as a NCCL stream does, and the
two streams share the bus fairly when both are busy. Compute waits for a collective
only where it needs the result: the optimizer's first op waits for every all-reduce /
reduce-scatter of the iteration, a forward or backward op for the all-gather of the
parameters it reads; the wait is part of that op's stall. A gradient a collective is
reading is not moved away until the collective is done: a planned eviction of it is
held back and issued when the collective completes, and the memory of a gradient that
dies meanwhile (FSDP's full gradient after its reduce-scatter) is freed then.

Simplifications, stated: the all-gather buffer occupies device memory from the first
use of the parameter, not from the gather's start; one rank's straggling is not
modelled (all ranks are symmetric).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..errors import HardwareError, SimulationError
from ..hardware import Hardware, Link, Tier
from ..plan import Plan, validate
from ..trace import Op, TensorInfo, Trace
from .engine import Flow
from .result import SimResult
from .simulator import ProgressFn, _Simulator

STRATEGIES = ("ddp", "fsdp")
PEERS = "peers"
SEND, GATHER, BUS = "interconnect:send", "interconnect:gather", "interconnect"
RS_OP = "nccl:reduce_scatter"
DEFAULT_BUCKET = 25 * 2**20  # torch DDP's default bucket_cap_mb


# -- the ring cost model ----------------------------------------------------------------


def ring_factor(kind: str, n: int) -> tuple[float, int]:
    """``(bytes factor, latency hops)`` of a ring collective over ``n`` ranks: it moves
    ``factor * S`` bytes per rank per direction and pays ``hops`` link latencies."""
    if n <= 1:
        return 0.0, 0
    if kind == "all_reduce":
        return 2 * (n - 1) / n, 2 * (n - 1)
    if kind in ("reduce_scatter", "all_gather"):
        return (n - 1) / n, n - 1
    raise ValueError(f"unknown collective {kind!r}")


def ring_time(kind: str, nbytes: float, n: int, bandwidth: float, latency_s: float) -> float:
    """Seconds for a ring ``kind`` of ``nbytes`` logical bytes over ``n`` ranks, alone on
    the interconnect."""
    factor, hops = ring_factor(kind, n)
    return factor * nbytes / bandwidth + hops * latency_s


# -- the spec ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DataParallel:
    """A data-parallel run: ``gpus`` ranks over an interconnect of ``bandwidth`` bytes/s
    per direction per GPU and ``latency_s`` per ring hop; ``strategy`` ``ddp`` or
    ``fsdp``; collectives grouped into buckets of about ``bucket_bytes``; ``buses``
    of the hardware the interconnect's traffic also crosses."""

    gpus: int
    bandwidth: float
    latency_s: float = 0.0
    strategy: str = "ddp"
    bucket_bytes: int = DEFAULT_BUCKET
    buses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.gpus, int) or self.gpus < 1:
            raise ValueError(f"gpus must be an integer >= 1, got {self.gpus!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"bandwidth must be finite and > 0, got {self.bandwidth!r}")
        if not self.latency_s >= 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s!r}")
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {self.bucket_bytes!r}")

    @classmethod
    def on(cls, hw: Hardware, gpus: int, strategy: str = "ddp", bucket_bytes: int = DEFAULT_BUCKET) -> DataParallel:
        """The run over ``hw``'s ``[interconnect]``. One GPU needs none; more do."""
        ic = hw.interconnect
        if ic is None:
            if gpus > 1:
                raise HardwareError(
                    f"hardware {hw.name}: no [interconnect] table, so it cannot run {gpus} GPUs "
                    "(add one: name, gbps, latency_us)"
                )
            return cls(gpus, 1.0, 0.0, strategy, bucket_bytes)
        return cls(gpus, ic.bandwidth, ic.latency_s, strategy, bucket_bytes, ic.buses)

    def time(self, kind: str, nbytes: float) -> float:
        """Ring time of one collective alone (see :func:`ring_time`)."""
        return ring_time(kind, nbytes, self.gpus, self.bandwidth, self.latency_s)


# -- the per-rank trace -----------------------------------------------------------------


def _buckets(items: list[tuple[int, int, int]], cap: int) -> list[list[tuple[int, int, int]]]:
    """Consecutive groups of ``(order_key, tensor, bytes)`` items (already sorted), each
    closed before it would exceed ``cap`` bytes (one oversized item is a bucket alone)."""
    out: list[list[tuple[int, int, int]]] = []
    size = 0
    for it in items:
        if out and size + it[2] <= cap:
            out[-1].append(it)
            size += it[2]
        else:
            out.append([it])
            size = it[2]
    return out


def rank_trace(trace: Trace, dp: DataParallel) -> Trace:
    """What one rank of ``dp`` holds and does (see the module docstring). The schedule
    of collectives is stored in ``meta["collectives"]`` (plain data, so it survives
    saving the trace): dicts with ``kind``, ``bytes`` (logical), ``tensors`` (read by
    it, held on the device until it is done), ``issue`` (``[op, "before"|"after"]``)
    and ``wait_op`` (the op that waits for it)."""
    n = dp.gpus
    meta = dict(trace.meta)
    meta["data_parallel"] = {"gpus": n, "strategy": dp.strategy, "bucket_bytes": dp.bucket_bytes}
    if n == 1:
        meta["collectives"] = []
        return Trace(trace.ops, trace.tensors, trace.name, meta)
    opt_ops = [j for j, o in enumerate(trace.ops) if o.phase == "optimizer"]
    # with no optimizer phase, the next iteration's first op is what needs the result
    opt_wait = opt_ops[0] if opt_ops else 0
    phase = [o.phase for o in trace.ops]

    # when backward is done with each gradient: its last backward use
    grads: list[tuple[int, int, int]] = []
    for t in trace.tensors:
        if t.kind != "gradient":
            continue
        bw = [int(j) for j in trace.uses(t.id) if phase[j] == "backward"]
        if bw:
            grads.append((bw[-1], t.id, t.bytes))
    grads.sort()
    grad_buckets = _buckets(grads, dp.bucket_bytes)

    if dp.strategy == "ddp":
        meta["collectives"] = [
            {"kind": "all_reduce", "bytes": sum(b for _, _, b in bk), "tensors": [t for _, t, _ in bk],
             "issue": [max(j for j, _, _ in bk), "after"], "wait_op": opt_wait}
            for bk in grad_buckets
        ]
        return Trace(trace.ops, trace.tensors, trace.name, meta)
    return _fsdp(trace, dp, meta, grad_buckets, opt_wait)


def _shard(nbytes: int, n: int) -> int:
    return -(-nbytes // n)


def _fsdp(trace: Trace, dp: DataParallel, meta: dict, grad_buckets: list, opt_wait: int) -> Trace:
    n = dp.gpus
    tensors = list(trace.tensors)
    for i, t in enumerate(tensors):
        if t.kind in ("parameter", "optimizer_state"):
            tensors[i] = dataclasses.replace(t, bytes=_shard(t.bytes, n))

    def new(bytes_: int, kind: str, name: str) -> int:
        tensors.append(TensorInfo(len(tensors), bytes_, kind, False, name, None))
        return len(tensors) - 1

    # the unsharded copy each phase of each parameter reads
    params = [t for t in trace.tensors if t.kind == "parameter"]
    swap: dict[tuple[str, int], int] = {}
    for p in params:
        for ph in ("forward", "backward"):
            if any(trace.ops[j].phase == ph for j in trace.uses(p.id)):
                swap[(ph, p.id)] = new(p.bytes, "temporary", f"{p.name}.unsharded.{ph[:3]}")
    # the sharded gradient each full gradient is reduce-scattered into
    shard_of = {t: new(_shard(b, n), "gradient", f"{trace.tensors[t].name}.shard") for bk in grad_buckets for _, t, b in bk}
    rs_after: dict[int, list] = {}
    for bk in grad_buckets:
        rs_after.setdefault(max(j for j, _, _ in bk), []).append(bk)

    def sub(ids: tuple[int, ...], ph: str) -> tuple[int, ...]:
        if ph == "optimizer":
            return tuple(shard_of.get(t, t) for t in ids)
        return tuple(swap.get((ph, t), t) for t in ids)

    ops: list[Op] = []
    old_to_new: list[int] = []
    rs_ops: list[tuple[int, list]] = []
    for j, o in enumerate(trace.ops):
        old_to_new.append(len(ops))
        ops.append(Op(o.name, o.phase, o.duration_s, sub(o.inputs, o.phase), sub(o.outputs, o.phase)))
        for bk in rs_after.get(j, ()):
            full = tuple(t for _, t, _ in bk)
            rs_ops.append((len(ops), bk))
            ops.append(Op(RS_OP, "backward", 0.0, full, tuple(shard_of[t] for t in full)))
    wait = old_to_new[opt_wait]
    coll = [
        {"kind": "reduce_scatter", "bytes": sum(b for _, _, b in bk), "tensors": [t for _, t, _ in bk],
         "issue": [k, "after"], "wait_op": wait}
        for k, bk in rs_ops
    ]
    # all-gathers: the unsharded copies by first use, bucketed, one bucket ahead
    out = Trace(tuple(ops), tuple(tensors), trace.name, meta)
    gathered = sorted((int(out.first_use[g]), g, out.tensors[g].bytes) for g in swap.values())
    prev = 0
    for bk in _buckets(gathered, dp.bucket_bytes):
        first = bk[0][0]
        # "bytes" is the unsharded size gathered; nothing is held (it is not born yet)
        coll.append({"kind": "all_gather", "bytes": sum(b for _, _, b in bk), "tensors": [],
                     "issue": [min(prev, first), "before"], "wait_op": first})
        prev = first
    meta["collectives"] = coll
    return out


# -- simulation -------------------------------------------------------------------------


def with_interconnect(hw: Hardware, dp: DataParallel) -> Hardware:
    """``hw`` plus the ``peers`` endpoint and the two interconnect links (module
    docstring). ``peers`` has no capacity, so no tensor is ever placed there."""
    if hw.has_tier(PEERS):
        return hw
    buses = dict(hw.buses)
    buses[BUS] = dp.bandwidth
    extra = (BUS, *dp.buses)
    links = hw.links + (
        Link(SEND, hw.device, PEERS, dp.bandwidth, 0.0, extra),
        Link(GATHER, PEERS, hw.device, dp.bandwidth, 0.0, extra),
    )
    return dataclasses.replace(hw, tiers=hw.tiers + (Tier(PEERS, "peer", 0.0),), links=links, buses=buses)


@dataclass
class ParallelResult:
    """One rank's simulated iteration under data parallelism.

    Attributes:
        sim: the simulator's result for the rank (its ``time_s`` is the step time;
            waits for collectives are part of ``stall_s``); the ``peers`` endpoint is
            left out of its memory figures.
        gpus, strategy: the run.
        comm_wait_s: the part of the stall spent waiting for collectives.
        interconnect_bytes: bytes this rank sent over the interconnect in the reported
            iteration (ring bytes, both links).
        collectives: per collective of the reported iteration, ``(kind, logical bytes,
            issue_s, start_s, end_s)`` relative to the iteration's start.
    """

    sim: SimResult
    gpus: int
    strategy: str
    comm_wait_s: float
    interconnect_bytes: int
    collectives: list[tuple[str, int, float, float, float]]

    @property
    def time_s(self) -> float:
        return self.sim.time_s


class _ParallelSimulator(_Simulator):
    def __init__(self, trace: Trace, hw: Hardware, plan: Plan, start_tier: dict[int, str], dp: DataParallel):
        super().__init__(trace, hw, plan, start_tier)
        self.dp = dp
        self.offload = [t for t in self.offload if t != PEERS]
        self.coll = trace.meta.get("collectives", [])
        self.issue_before: dict[int, list[int]] = {}
        self.issue_after: dict[int, list[int]] = {}
        self.waits: dict[int, list[int]] = {}
        for k, c in enumerate(self.coll):
            op, when = c["issue"]
            (self.issue_before if when == "before" else self.issue_after).setdefault(op, []).append(k)
            self.waits.setdefault(c["wait_op"], []).append(k)
        self.pending: dict[int, Flow] = {}
        self.held_moves: dict[int, list] = {}
        self.held_dies: set[int] = set()
        self.comm_wait = 0.0

    def _start(self, k: int) -> None:
        c = self.coll[k]
        factor, hops = ring_factor(c["kind"], self.dp.gpus)
        src, dst = (PEERS, self.dev) if c["kind"] == "all_gather" else (self.dev, PEERS)
        for t in c["tensors"]:
            self.held[t] = self.held.get(t, 0) + 1
        f = self.engines.submit(-1 - k, factor * c["bytes"], src, dst, c["kind"], self._done,
                                hops * self.dp.latency_s)
        f.extra["collective"] = k
        self.pending[k] = f

    def _done(self, f: Flow) -> None:
        k = f.extra["collective"]
        for t in self.coll[k]["tensors"]:
            self.held[t] -= 1
            if self.held[t]:
                continue
            del self.held[t]
            if t in self.held_dies:
                self.held_dies.discard(t)
                super()._die(t)
            for m, op in self.held_moves.pop(t, ()):
                self._issue(m, op)

    def _before_op(self, i: int) -> None:
        for k in self.issue_before.get(i, ()):
            self._start(k)
        t0 = self.engines.now
        for k in self.waits.get(i, ()):
            f = self.pending.get(k)
            while f is not None and math.isnan(f.end_s):
                self.engines.step()
        if self.engines.now >= self.window:
            self.comm_wait += self.engines.now - t0

    def _after_op(self, i: int) -> None:
        for k in self.issue_after.get(i, ()):
            self._start(k)

    def _issue(self, m, op: int) -> None:  # noqa: ANN001 (a plan Move)
        if m.kind == "evict" and m.tensor in self.held:
            # moving it now would take it from under the collective reading it
            self.held_moves.setdefault(m.tensor, []).append((m, op))
            return
        super()._issue(m, op)

    def _die(self, t: int) -> None:
        if t in self.held:
            self.held_dies.add(t)  # freed when the collective reading it is done
            return
        super()._die(t)


def simulate_parallel(
    trace: Trace,
    hardware: Hardware,
    plan: Plan,
    dp: DataParallel,
    *,
    iterations: int = 2,
    progress: ProgressFn | None = None,
    check_plan: bool = True,
) -> ParallelResult:
    """Simulate one rank of ``dp`` running ``plan`` for ``trace``, a trace from
    :func:`rank_trace` (a plain trace is taken as one with no collectives). Arguments
    and the failure convention as :func:`tierflow.simulate.simulate`."""
    if trace.meta.get("data_parallel", {}).get("gpus", 1) != dp.gpus:
        raise SimulationError(
            f"trace {trace.name!r} was not made by rank_trace for {dp.gpus} GPUs "
            f"(its meta says {trace.meta.get('data_parallel')})"
        )
    if plan.recomputes or plan.host_steps:
        raise SimulationError(
            f"plan {plan.policy}: the data-parallel simulator does not model recompute or host steps yet"
        )
    hw = with_interconnect(hardware, dp)
    residency = validate(plan, trace, hw) if check_plan else None
    sim = _ParallelSimulator(trace, hw, plan, residency.start_tier if residency else {}, dp)
    try:
        sim.run(iterations, progress)
        res = sim.result()
    except SimulationError as e:
        res = sim.failed(str(e))
    for d in (res.peak_bytes, res.memory):
        d.pop(PEERS, None)
    # collectives are reported on their own; transfers stay those of tensors
    res.transfers = [r for r in res.transfers if r.tensor >= 0]
    w = sim.window
    colls = [
        (f.kind, int(sim.coll[f.extra["collective"]]["bytes"]), f.issue_s - w, f.start_s - w, f.end_s - w)
        for f in sim.engines.done if "collective" in f.extra and f.issue_s >= w
    ]
    return ParallelResult(
        sim=res,
        gpus=dp.gpus,
        strategy=dp.strategy,
        comm_wait_s=sim.comm_wait,
        interconnect_bytes=int(round(res.traffic_bytes.get(SEND, 0) + res.traffic_bytes.get(GATHER, 0))),
        collectives=colls,
    )
