"""``zero_infinity``: DeepSpeed ZeRO-Infinity (Rajbhandari et al., SC 2021), ZeRO stage 3
with ``offload_param`` and ``offload_optimizer`` to CPU or NVMe, on one GPU.

What DeepSpeed does (deepspeedai/DeepSpeed ``deepspeed/runtime/zero/
partitioned_param_coordinator.py``, ``parameter_offload.py``, ``stage3.py``; defaults
in ``deepspeed/runtime/zero/config.py`` and ``offload_config.py``):

* every parameter lives partitioned off the GPU (host memory, or NVMe swapped through
  host buffers) except those of at most ``param_persistence_threshold`` elements
  (1e5), which stay on the GPU for good (``mark_persistent_parameters``, up to
  ``model_persistence_threshold`` elements in all);
* the first iteration records the order in which modules run in forward and backward;
  each later iteration walks that trace. When a module is about to run
  (``fetch_sub_module``) its parameters that are not on the GPU are fetched, its own
  entries are popped off the parameter queue, and then parameters further down the
  queue are prefetched until ``min(max_live_parameters - available,
  prefetch_bucket_size)`` elements are in flight (defaults 1e9 and 5e7); an entry
  whose parameter is already on the GPU is skipped but remembered, and that parameter
  is then not released before that use;
* when the module ends (``release_sub_module``) each of its parameters is released
  (freed on the GPU; the host copy is the partition) unless the modules that run
  next, up to ``max_reuse_distance`` elements of parameters (1e9), use it again;
* gradients are reduced through a ``reduce_bucket_size`` GPU bucket (5e8 elements,
  allocated once) and copied to a host buffer; ``DeepSpeedCPUAdam`` steps on the host
  with the optimizer state there (or swapped from NVMe), and the updated 16-bit
  partition is written on the host, to be fetched by the next iteration.

Here the same walk runs over the trace: a *module call* is a maximal run of consecutive
ops with one scope (``Op.scope``; without scopes every op is its own call), its
parameters those its ops use; the optimizer ops are host steps and take no part. A
fetch is a prefetch move issued when the op before the call ends, needed by the
parameter's first use in the call it is fetched for; a release is an eviction when the
call's last op ends. Every parameter the optimizer updates gets a
:class:`~tierflow.plan.HostStep` on the optimizer's tier. The bucket buffer is charged
against the budget over the whole iteration. Plan-contract caveats: an eviction is a
copy in the simulator, where DeepSpeed's release only frees (its host copy is current);
gradients leave the device per tensor, not per bucket; each update starts as its
gradient lands, where DeepSpeed's ``step()`` runs after backward ends.

The walk does not look at the budget (DeepSpeed does not); when its device curve
exceeds it, or host (or SSD) memory cannot hold what it offloads, the policy raises
:class:`~tierflow.errors.PlanError` with the bytes. A trace without an optimizer step
(G10's workloads) raises it too.

Options (DeepSpeed's names; sizes in elements, DeepSpeed's defaults):
    device (str): ``cpu`` (default) or ``nvme``: where parameters are offloaded
        (``offload_param.device``).
    optimizer_device (str): ``offload_optimizer.device``; empty = as ``device``.
    prefetch_bucket_size (int): elements fetched ahead (5e7).
    max_live_parameters (int): elements on the GPU before prefetching stops (1e9).
    max_reuse_distance (int): keep a parameter used again within this many elements
        of parameters (1e9).
    param_persistence_threshold (int): parameters this small stay on the GPU (1e5).
    model_persistence_threshold (int): at most this many elements stay (no limit).
    reduce_bucket_size (int): gradient bucket on the GPU (5e8).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ..errors import PolicyError
from ..hardware import Hardware
from ..plan import Move, Plan
from ..trace import Trace
from . import PolicyOption, PolicyOptions, register
from ._common import issue_order, no_fit
from ._zero import (
    DEVICES,
    check_host_room,
    element_bytes,
    host_step_delta,
    host_stepped_ops,
    host_steps,
    offload_tier,
    param_updates,
)
from .zero_offload import REDUCE_BUCKET_SIZE

OPTIONS = (
    PolicyOption("device", str, "cpu", "where parameters are offloaded (DeepSpeed offload_param.device)", DEVICES),
    PolicyOption("optimizer_device", str, "", "where optimizer state lives (offload_optimizer.device; empty: as device)",
                 ("",) + DEVICES),
    PolicyOption("prefetch_bucket_size", int, 50_000_000, "parameter elements fetched ahead of use (DeepSpeed 5e7)"),
    PolicyOption("max_live_parameters", int, 1_000_000_000,
                 "parameter elements on the GPU beyond which nothing is prefetched (DeepSpeed 1e9)"),
    PolicyOption("max_reuse_distance", int, 1_000_000_000,
                 "keep a parameter used again within this many parameter elements (DeepSpeed 1e9)"),
    PolicyOption("param_persistence_threshold", int, 100_000,
                 "parameters of at most this many elements stay on the GPU (DeepSpeed 1e5)"),
    PolicyOption("model_persistence_threshold", int, sys.maxsize,
                 "at most this many parameter elements stay on the GPU in all (DeepSpeed: no limit)"),
    PolicyOption("reduce_bucket_size", int, REDUCE_BUCKET_SIZE,
                 "elements of the GPU gradient bucket, allocated once (DeepSpeed 5e8)"),
)


@dataclass(frozen=True, slots=True)
class Call:
    """One module call: ops ``first .. last`` and the first op using each parameter."""

    first: int
    last: int
    params: dict[int, int]  # parameter -> its first use in the call


def module_calls(trace: Trace, skip: set[int], params: set[int]) -> list[Call]:
    """Maximal runs of consecutive ops (not in ``skip``) under one scope; an op with
    no scope is a call of its own."""
    calls: list[Call] = []
    cur: list[int] = []

    def close() -> None:
        if cur:
            used: dict[int, int] = {}
            for i in cur:
                for t in trace.op_tensors[i]:
                    if t in params:
                        used.setdefault(t, i)
            calls.append(Call(cur[0], cur[-1], used))
            cur.clear()

    for i, op in enumerate(trace.ops):
        if i in skip:
            close()
            continue
        if cur and (op.scope is None or trace.ops[cur[-1]].scope != op.scope or cur[-1] != i - 1):
            close()
        cur.append(i)
    close()
    return calls


def persistent_params(trace: Trace, params: list[int], elem: int, threshold: int, model_threshold: int) -> set[int]:
    """The parameters DeepSpeed keeps on the GPU (``mark_persistent_parameters``)."""
    out: set[int] = set()
    total = 0
    for p in params:
        n = int(trace.sizes[p]) // elem
        if n + total > model_threshold:
            continue
        if n <= threshold:
            out.add(p)
            total += n
    return out


def coordinator_walk(
    calls: list[Call],
    numel: dict[int, int],
    prefetch_bucket: int,
    max_live: int,
    max_reuse: int,
    resident: set[int] = frozenset(),  # type: ignore[assignment]
) -> dict[int, list[tuple[str, int, int]]]:
    """DeepSpeed's ``PartitionedParameterCoordinator`` over one iteration, steady state.

    ``resident`` parameters (DeepSpeed's persistent ones) are on the device throughout:
    never fetched, counted or released.

    Returns:
        Per parameter, its events in time order: ``("fetch", call_fetched_at,
        call_needed_by)`` and ``("release", call, call)``.
    """
    queue = [(s, p) for s, c in enumerate(calls) for p in sorted(c.params)]
    qi = 0
    avail: set[int] = set(resident)
    n_avail = 0
    recent: dict[int, int] = defaultdict(lambda: -1)
    events: dict[int, list[tuple[str, int, int]]] = defaultdict(list)
    # parameters used by each call, with multiplicity of the traversal (elements)
    call_numel = [sum(numel[p] for p in c.params) for c in calls]
    for s, c in enumerate(calls):
        for p in sorted(c.params):
            if p not in avail:
                avail.add(p)
                n_avail += numel[p]
                events[p].append(("fetch", s, s))
        # pop this call's own entries off the queue
        own = {p for p in c.params if recent[p] < s}
        popped: set[int] = set()
        while qi < len(queue) and len(popped) < len(own):
            s2, p2 = queue[qi]
            qi += 1
            recent[p2] = s2
            popped.add(p2)
        # prefetch what comes next
        if prefetch_bucket > 0:
            limit = min(max_live - n_avail, prefetch_bucket)
            batch: dict[int, int] = {}  # parameter -> the call its entry is for
            fetched = 0
            while qi < len(queue) and fetched < limit:
                s2, p2 = queue[qi]
                qi += 1
                recent[p2] = max(recent[p2], s2)
                if p2 not in avail and p2 not in batch:
                    # (a parameter released earlier has no entry before this one left:
                    # an entry passed while it was on the device would have kept it)
                    batch[p2] = s2
                    fetched += numel[p2]
            for p2 in sorted(batch):
                avail.add(p2)
                n_avail += numel[p2]
                events[p2].append(("fetch", s, batch[p2]))
        # release this call's parameters unless reused soon
        for p in sorted(c.params):
            if p in resident or recent[p] > s or _reused_within(calls, call_numel, s + 1, p, max_reuse):
                continue
            avail.discard(p)
            n_avail -= numel[p]
            events[p].append(("release", s, s))
    return events


def _reused_within(calls: list[Call], call_numel: list[int], start: int, p: int, max_reuse: int) -> bool:
    traversed = 0
    for k in range(start, len(calls)):
        if traversed >= max_reuse:
            return False
        if p in calls[k].params:
            return True
        traversed += call_numel[k]
    return False


def _moves(trace: Trace, calls: list[Call], events: dict[int, list[tuple[str, int, int]]], tier: str) -> list[Move]:
    n = trace.n_ops
    moves: list[Move] = []
    for p, evs in events.items():
        for kind, at, need in evs:
            if kind == "fetch":
                moves.append(Move("prefetch", p, (calls[at].first - 1) % n, tier, calls[need].params[p]))
            else:
                moves.append(Move("evict", p, calls[at].last, tier))
    return list(issue_order(moves, trace))


def away_delta(trace: Trace, calls: list[Call], events: dict[int, list[tuple[str, int, int]]]) -> np.ndarray:
    """Device bytes per op the moves take away (<= 0): a released parameter is off the
    device from the op after its release to the op its fetch is issued after."""
    n = trace.n_ops
    delta = np.zeros(n + 1, dtype=np.int64)

    def sub(lo: int, hi: int, size: int) -> None:  # ops lo..hi, unwrapped into 0..2n-1
        for a, b in ((lo, min(hi, n - 1)), (max(lo, n), hi)):
            if a <= b:
                delta[a % n] -= size
                delta[b % n + 1] += size

    for p, evs in events.items():
        size = int(trace.sizes[p])
        fetch_ops = [calls[at].first - 1 for kind, at, _ in evs if kind == "fetch"]  # -1: before op 0
        release_ops = [calls[at].last for kind, at, _ in evs if kind == "release"]
        # events alternate fetch, release, ..., release (the last release wraps to the
        # first fetch of the next iteration)
        for k, r in enumerate(release_ops):
            nxt = fetch_ops[k + 1] if k + 1 < len(fetch_ops) else fetch_ops[0] + n
            sub(r + 1, nxt, size)
    return np.cumsum(delta[:-1])


@register("zero_infinity", options=OPTIONS, host_optimizer=True)
def zero_infinity(trace: Trace, hardware: Hardware, options: PolicyOptions) -> Plan:
    """DeepSpeed ZeRO-Infinity: parameters and optimizer state offloaded, fetched ahead.

    Args:
        trace: the iteration; it must have an optimizer step. Scopes give the module
            calls (without them every op is one).
        hardware: the machine: host memory, or the SSD for ``nvme``.
        options: see the module docstring; ``prefetch_bucket_size`` trades memory for
            overlap (more fetched ahead hides slower links), ``max_reuse_distance``
            keeps parameters reused soon (fewer fetches, more memory).

    Raises:
        PolicyError: a bad option, or ``nvme`` on a machine without an SSD tier.
        PlanError: no optimizer step; the plan exceeds the budget; host or SSD too small.

    Example:
        >>> make_plan("zero_infinity", trace, hw, device="nvme", prefetch_bucket_size=10**8)  # doctest: +SKIP
    """
    policy = "zero_infinity"
    ints = {k: int(options.get(k, d)) for k, d in (
        ("prefetch_bucket_size", 50_000_000), ("max_live_parameters", 1_000_000_000),
        ("max_reuse_distance", 1_000_000_000), ("param_persistence_threshold", 100_000),
        ("model_persistence_threshold", sys.maxsize))}
    for k, v in ints.items():
        if v < 0:
            raise PolicyError(f"{policy}: {k} {v} is negative")
    device = str(options.get("device", "cpu"))
    param_tier = offload_tier(hardware, device, "device", policy)
    opt_device = str(options.get("optimizer_device", "")) or device
    opt_tier = offload_tier(hardware, opt_device, "optimizer_device", policy)

    updates = param_updates(trace, policy)
    elem, elem_source = element_bytes(trace)
    steps = host_steps(updates, opt_tier)
    gone = host_stepped_ops(updates)
    tensors = trace.tensors
    all_params = [t.id for t in tensors if t.kind == "parameter" and t.persistent
                  and not (t.key or "").startswith("buffer:")]
    stay = persistent_params(trace, all_params, elem, ints["param_persistence_threshold"],
                             ints["model_persistence_threshold"])
    partitioned = set(all_params) - stay
    calls = module_calls(trace, gone, set(all_params))
    numel = {p: max(1, int(trace.sizes[p]) // elem) for p in all_params}
    events = coordinator_walk(calls, numel, ints["prefetch_bucket_size"], ints["max_live_parameters"],
                              ints["max_reuse_distance"], stay)
    moves = _moves(trace, calls, events, param_tier)

    sizes = trace.sizes
    need: dict[str, int] = defaultdict(int)
    need[param_tier] += int(sum(int(sizes[p]) for p in partitioned))
    need[opt_tier] += int(sum(int(sizes[u.param]) + int(sizes[u.grad]) + int(sizes[list(u.state)].sum())
                              for u in updates))
    check_host_room(hardware, dict(need), policy)

    bucket_elements = int(options.get("reduce_bucket_size", REDUCE_BUCKET_SIZE))
    if bucket_elements < 0:
        raise PolicyError(f"{policy}: reduce_bucket_size {bucket_elements} is negative")
    bucket = bucket_elements * elem  # stage 3 allocates one buffer, at start-up
    curve = trace.live_bytes + host_step_delta(trace, updates, policy) + away_delta(trace, calls, events) + bucket
    peak = int(curve.max()) if len(curve) else 0
    fetches = sum(1 for m in moves if m.kind == "prefetch")
    if peak > options.budget_bytes:
        raise no_fit(policy, trace, hardware, options.budget_bytes,
                     f"with {len(partitioned)} parameters offloaded to {param_tier} ({fetches} fetches), "
                     f"{len(stay)} kept, optimizer state on {opt_tier}, a {bucket}-byte gradient bucket", curve,
                     host_optimizer=True)
    meta = {
        "param_tier": param_tier,
        "optimizer_tier": opt_tier,
        "host_steps": len(steps),
        "offloaded_params": len(partitioned),
        "persistent_params": len(stay),
        "module_calls": len(calls),
        "fetches": fetches,
        "bucket_bytes": bucket,
        "element_bytes_from": elem_source,
        "offloaded_bytes": dict(need),
        "planned_peak_bytes": peak,
    }
    return Plan(policy=policy, moves=tuple(moves), budget_bytes=options.budget_bytes, meta=meta, host_steps=steps)
