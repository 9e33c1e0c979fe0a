"""What a run measured, next to what the simulator predicted: :class:`RunStats`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunStats:
    """What a run measured, next to what the simulator predicted.

    Attributes:
        steps: iterations completed. profiled_steps: of which profiled (reactive mode,
            recorded); planned_steps: of which followed a plan to the end;
            reactive_steps: of which ran reactive (a reactive policy, or a stale plan).
        step_time_s: mean wall time of the planned (else all) iterations after the first.
        step_times_s: wall time of every iteration.
        peak_device_bytes: highest accounted device bytes in any iteration run under the
            budget (with a share budget, the first, unconstrained profile is left out and
            reported as ``peak_device_bytes_unconstrained``).
        peak_device_bytes_planned: the same over planned iterations only.
        cuda_max_allocated: ``torch.cuda.max_memory_allocated`` (CUDA only).
        budget_bytes: the device budget in force (``inf``: none).
        untracked_device_bytes: CUDA: the most device memory in use that no tracked
            storage explains, seen while profiling (cuBLAS's workspaces, the caching
            allocator's rounding, tensors made outside the block); plans and the pager
            keep the tracked bytes within ``budget_bytes`` minus this, so that
            ``torch.cuda.max_memory_allocated`` stays within the budget. 0 on CPU.
        held_device_bytes: device memory the loop held beside the profiled iteration,
            which no plan can move (the batches it keeps, a loss it has not let go of):
            plans keep it free, within the budget.
        held_replans: times the loop came to hold more than that (by over 0.5% of the
            budget) and the next iteration was profiled and planned again.
        link_bytes_per_s: CUDA: the measured pinned copy rate per direction
            (``device->host``, ``host->device``) the plan was made with.
        moved_bytes: bytes copied per tier, both directions (``host``, ``ssd``).
        transfers: bytes per direction (``device->host``, ``ssd->device``, ...).
        moves_by_kind: count of evictions per ``(tensor kind, tier)``, as ``"kind@tier"``.
        stalls: on-demand fetches (a tensor was away when an op needed it).
        stall_s: host time spent waiting for them.
        planned_moves: plan moves executed; skipped_moves: plan moves with nothing to do
            (a tensor the runtime cannot identify or move, or already where asked).
        unplanned_evictions: evictions the budget forced beyond the plan.
        departures: where iterations that followed a planned plan departed from it, a
            count per reason: ``"on-demand fetch: ..."`` (evicted beyond the plan, its
            planned prefetch waited for room, away with no prefetch issued before the
            use), ``"eviction: ..."`` (room an op needed beyond the plan; a gradient
            held past its last use, for a planned prefetch), ``"late prefetch: ..."``
            (CUDA: a copy in still running at the tensor's use) and ``"skipped move: ..."``.
        tier_fallbacks: moves sent to host because the plan's tier is missing or full.
        planned_slots: evictions placed at the offset the pool planner laid out for
            them in the host pool or SSD file (the rest took the first free slot: a move
            the plan did not make, or a slot still held by a late tensor).
        stale_plans: iterations that departed from the trace; replans: plans made.
        stale_reasons: the first few departures, in words.
        follow: how the current plan is followed: ``"hooks"`` (at ticks, from the trace
            coarsened to them) or ``"ops"`` (op by op), with why where ``follow="hooks"``
            was asked for and does not apply (runtime/hook_follow.py).
        plan_error: why the current plan failed :func:`tierflow.plan.validate`, if it did
            (it is executed anyway: what it gets wrong is fetched on demand).
        predicted_step_time_s: the simulator's step time for the current plan. In CPU
            mode with the runtime's own machine model, after the plan's first three
            followed iterations: the same plan scored again with their op times
            and the model's cost per op outside the runtime, medians
            (:mod:`tierflow.runtime.retime`).
        predicted_step_time_s_at_plan: the simulator's step time for the current plan
            when it was made, from the profiled iteration's times.
        outside_handler_s: CPU mode: the first followed iterations' time outside the
            runtime's handler (torch's dispatch-mode entry per op, the model's Python,
            autograd, the optimizer's loop), their median, which the prediction charges
            per op.
        ideal_step_time_s: the trace's sum of op times (no transfers).
        policy: the policy that made the current plan.
        host_pool_bytes, ssd_file_bytes: the tiers' sizes (allocated; at the end of the run,
            the most they grew to).
        ssd_bounce_bytes: the SSD tier's host staging buffer (transfers in flight).
        recomputed_ops: ops re-run by recompute chains; recompute_s: seconds spent
            re-running them (and copying the re-made bytes back).
        dropped_bytes: bytes of activations dropped for recompute (no transfer).
        skipped_drops: planned drops not made (a chain not recorded whole, a tensor the
            runtime could not identify or free); the tensor then stays on the device.
        early_recomputes: chains re-run on demand, before their planned op.
        optimizer_chunks: the param-group chunks the profiled optimizer step ran in
            (a foreach or fused optimizer under a budget its whole state exceeds:
            :mod:`tierflow.runtime.optim_chunks`); 0 when the step is not wrapped.
        pinned_bytes: page-locked host memory the run holds (CUDA: the host pool and
            the SSD bounce buffer; CPU: none).
        blocking_waits: times the host waited for a copy or SSD transfer to finish, by
            reason (``pool full``, ``bounce full``, ``ssd read``, ``write retired``,
            ``copy in flight``, ``eviction in flight``: CUDA, room the budget needs is still
            being copied out). A plan whose transfers fit their buffers and land in
            time leaves it empty: the host never waits for the device otherwise.
        host_pool_peak: highest bytes in use in the host pool.
        rank, world_size: this process in ``torch.distributed`` (0 and 1 without it).
        plan_digest: digest of the plan followed (the same on every rank when they
            agree: see :mod:`tierflow.runtime.distributed`).
        collectives: collective ops (``c10d``) seen in iterations and outside them.
        busy_refusals: moves refused because a collective still in flight reads or
            writes the storage (a DDP bucket, an FSDP reduce-scatter output).
        foreign_storages: storages another owner resizes (FSDP's unsharded
            parameters), which the runtime leaves alone and only accounts: those alive
            at the end of the last iteration.
        host_stepped_params: parameters the current plan updates on the host
            (:class:`~tierflow.plan.HostStep`; see :mod:`tierflow.runtime.host_step`).
        host_steps: host updates run (one per host-stepped parameter and step).
        host_steps_in_backward: of those, the ones that started while backward still
            ran (by their gradient's hook: overlapped with the rest of backward).
        host_step_s: seconds the host updates took, measured on the worker thread
            (overlapped with backward and the device-side step).
        host_step_wait_s: seconds the training thread waited for host updates (when
            ``optimizer.step()`` ends, or a parameter was needed before its update ended).
        host_step_bytes: host memory the host steps hold outside the host pool (master
            copies, gradient buffers, optimizer state; pinned on CUDA).
        compiled_ops_run_eager: ops of ``torch.compile``'d code (a compiled model,
            block or function) that ran eagerly under the runtime: Dynamo compiles
            nothing while a dispatch mode like the runtime's is active, so that code
            runs uncompiled inside the block (warned once per run). 0: no compiled
            code ran.
        outside_forwards: forwards outside training (under ``no_grad`` or
            ``inference_mode`` between iterations: validation, generation, a metric),
            run within the budget without ending the plan (:mod:`tierflow.runtime.outside`).
        peak_device_bytes_outside: highest accounted device bytes between iterations
            (outside forwards, logging, state dicts); within ``peak_device_bytes`` too.
        checkpoint_copies: tensors a state dict taken inside the block received as a
            copy, because the plan had them away (``torch.save`` reads bytes directly).
        plans_by_reason: plans made, by why: ``first`` (the first profile),
            ``new signature`` (an iteration fed the model shapes or dtypes no cached
            plan was made for), ``departure`` (an iteration of a known signature left
            its trace), ``held`` (the loop came to hold more than when profiled).
        signature_hits: iterations that began with a cached plan of their signature.
        signatures_cached: signatures with a plan in the cache at the end (at most
            ``max_plans``); signatures_evicted: plans dropped to make room for a new one.
        reactive_signature_steps: iterations of a signature that was not planned (past
            the cache's bound: see :mod:`tierflow.runtime.signatures`), run on the pager.
        step_kinds: per iteration, in order: ``planned`` (followed a plan to its end),
            ``profiled``, ``reactive`` or ``warmup``.
        dominated_steps: iterations of a new signature, while the cache churns, that
            followed the cached plan of a larger one (same arguments, every tensor at
            least as large): no tensor larger than that plan's, so its budget holds.
    """

    steps: int = 0
    profiled_steps: int = 0
    planned_steps: int = 0
    reactive_steps: int = 0
    step_time_s: float = 0.0
    step_times_s: list[float] = field(default_factory=list)
    peak_device_bytes: int = 0
    peak_device_bytes_planned: int = 0
    peak_device_bytes_unconstrained: int = 0
    cuda_max_allocated: int | None = None
    budget_bytes: float = math.inf
    untracked_device_bytes: int = 0
    held_device_bytes: int = 0
    held_replans: int = 0
    link_bytes_per_s: dict[str, float] = field(default_factory=dict)
    moved_bytes: dict[str, int] = field(default_factory=lambda: {"host": 0, "ssd": 0})
    transfers: dict[str, int] = field(default_factory=dict)
    moves_by_kind: dict[str, int] = field(default_factory=dict)
    stalls: int = 0
    stall_s: float = 0.0
    planned_moves: int = 0
    skipped_moves: int = 0
    unplanned_evictions: int = 0
    departures: dict[str, int] = field(default_factory=dict)
    tier_fallbacks: int = 0
    planned_slots: int = 0
    stale_plans: int = 0
    replans: int = 0
    stale_reasons: list[str] = field(default_factory=list)
    predicted_step_time_s: float | None = None
    predicted_step_time_s_at_plan: float | None = None
    outside_handler_s: float | None = None
    plan_error: str | None = None
    ideal_step_time_s: float | None = None
    policy: str = ""
    follow: str = "ops"
    host_pool_bytes: int = 0
    ssd_file_bytes: int = 0
    ssd_bounce_bytes: int = 0
    pinned_bytes: int = 0
    optimizer_chunks: int = 0
    recomputed_ops: int = 0
    recompute_s: float = 0.0
    dropped_bytes: int = 0
    skipped_drops: int = 0
    early_recomputes: int = 0
    host_stepped_params: int = 0
    host_steps: int = 0
    host_steps_in_backward: int = 0
    host_step_s: float = 0.0
    host_step_wait_s: float = 0.0
    host_step_bytes: int = 0
    blocking_waits: dict[str, int] = field(default_factory=dict)
    host_pool_peak: int = 0
    # where the model's and optimizer's tensors were left when the block ended: "device",
    # or "host" where what was away did not fit the device's free memory (runtime/homecoming.py)
    state_after_block: str = "device"
    rank: int = 0
    world_size: int = 1
    plan_digest: str | None = None
    collectives: int = 0
    busy_refusals: int = 0
    foreign_storages: int = 0
    compiled_ops_run_eager: int = 0
    outside_forwards: int = 0
    peak_device_bytes_outside: int = 0
    checkpoint_copies: int = 0
    plans_by_reason: dict[str, int] = field(default_factory=dict)
    signature_hits: int = 0
    signatures_cached: int = 0
    signatures_evicted: int = 0
    reactive_signature_steps: int = 0
    step_kinds: list[str] = field(default_factory=list)
    dominated_steps: int = 0
    compiled_graphs: list[dict[str, Any]] = field(default_factory=list)
    compiled_calls: int = 0
    compiled_compiles: int = 0
    compiled_offloads: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["step_times_s"] = list(self.step_times_s)
        d["step_kinds"] = list(self.step_kinds)
        d["plans_by_reason"] = dict(self.plans_by_reason)
        return d

    def restore(self, saved: RunStats) -> None:
        """Put back the figures of ``saved`` (a copy taken before a probe that must leave
        no trace), in place: the user may hold this object, and the copy layer shares its
        wait counts with ``blocking_waits``, so dicts and lists are refilled, not replaced."""
        for f in dataclasses.fields(saved):
            now, was = getattr(self, f.name), getattr(saved, f.name)
            if isinstance(now, dict):
                now.clear()
                now.update(was)
            elif isinstance(now, list):
                now[:] = was
            else:
                setattr(self, f.name, was)
