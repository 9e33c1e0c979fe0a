"""Profiling and planning: the profiled iteration becomes a :class:`~tierflow.trace.Trace`
(ops with measured times, their module scopes and ``rng``/``pure`` flags as
:mod:`tierflow.capture` records them (:mod:`.opfacts`), storages with their kinds and
runtime keys), the policy plans for the hardware :mod:`.machine_model` builds (CUDA: a
preset with the real device's capacity; CPU: RAM as device and host with the measured
copy bandwidth), the plan is validated and simulated, and the follower's tables are
built. A budget below the minimum working set is refused here, before the first
optimizer step changes anything.

The state this takes and gives is owned elsewhere: the profiled iteration's ops by
:class:`~.profile_record.ProfileRecord` (``Run._recorder``), when to profile and why
by :class:`~.profile_schedule.ProfileSchedule` (``Run._schedule``), the machine's
measurements by :class:`~.machine_model.MachineModel` (``Run._machine``), the chains
by :class:`~.recompute.Recomputer` (``Run._recomputer``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from ..errors import PlanError, TierflowError
from ..hardware import Hardware
from ..plan import Plan, validate
from ..trace import Op, TensorInfo, Trace
from ..units import fmt_bytes
from .errors import BudgetError
from .follow import _runtime_tier
from .followed_plan import FollowedPlan
from .host_step import follow_past_host_ops
from .retime import Retimed, Retimer
from .storages import (
    LOOP_KINDS,
    METADATA_ONLY,
    RESIDENT,
    _flat_tensor_args,
    _op_kind,
    _op_name,
    _returns_views,
    _storage_bytes,
    _write_spots,
)

if TYPE_CHECKING:
    from .host_costs import HostCosts


def _bindings(trace: Trace, sigs: list[tuple], named: set[int] = frozenset()) -> tuple[list[tuple | None], list[tuple | None]]:
    """Where a followed iteration finds the tensors the plan and the follower name: per
    op, ``(position among its inputs or outputs, trace id, expected key or size)`` for
    each tensor it uses first, if that tensor is a parameter or optimizer state (checked
    by key), an activation or gradient (the plan moves them; Belady ranks them; bound,
    they are labelled as profiled, so the pack and gradient hooks have nothing to do),
    or an input of the iteration (the batch: checked by size before the first op that
    reads it runs), or a tensor in ``named`` (those recompute chains re-make), with the
    label to give it. Other temporaries are not bound: their sizes are checked with
    their op's results."""
    seen: set[int] = set()
    bind_in: list[tuple | None] = []
    bind_out: list[tuple | None] = []
    for _f, ins, outs, in_sizes, out_sizes in sigs:
        for ids, sizes, side, first_as_input in ((ins, in_sizes, bind_in, True), (outs, out_sizes, bind_out, False)):
            found = []
            for pos, tid in enumerate(ids):
                if tid in seen:
                    continue
                seen.add(tid)
                info = trace.tensors[tid]
                if info.persistent and info.key:
                    found.append((pos, tid, info.key, None))
                elif info.kind in ("activation", "gradient"):  # labelled here, not by the hooks
                    found.append((pos, tid, sizes[pos], (info.kind, info.key, info.name)))
                elif info.persistent or first_as_input or tid in named:
                    found.append((pos, tid, sizes[pos], None))
            side.append(tuple(found) or None)
    return bind_in, bind_out


# Share of the budget a plan leaves for what the loop comes to hold beyond what it held
# when profiled (gpt-tiny over a list of 4 batches: 2 KB more once it had met them all,
# against a plan within 68 bytes of its budget: 22 unplanned evictions, 20 fetches back)
_HELD_MARGIN = 0.005

class Profiling:
    """Profile, plan and predict (a mixin of :class:`~tierflow.runtime.executor.Run`)."""

    def _on_step_pre(self, optimizer, args, kwargs) -> None:
        # (a subclass's step calling super().step() runs the hooks twice: the outermost
        # pair is the step, runtime/step_clock.StepNesting)
        if not self._step_nesting.enter():
            return
        if self._hook is not None and self._hook.off_mode:  # (the ticks end: the optimizer op by op)
            self._hook.to_optimizer()
        if self._in_iter and self._recording and self._budget_bytes is not None:
            self._check_working_set()

    def _on_step_post(self, optimizer, args, kwargs) -> None:
        if self._step_nesting.leave():
            self.end_iteration()

    def _check_working_set(self) -> None:
        """Refuse, before the first optimizer step changes anything, a budget below what
        one op of forward/backward needs, or what the update of one parameter needs."""
        sizes = [e.nbytes for e in self._iter_entries]
        worst, where = 0, ""
        for j, (name, _ph, _d, ins, outs) in enumerate(self._recorder.ops):
            ws = sum(sizes[t] for t in set(ins) | set(outs))
            if ws > worst:
                worst, where = ws, f"op {j} ({name})"
        if self.optimizer is not None:
            for g in self.optimizer.param_groups:
                fused = bool(g.get("foreach") or g.get("fused"))
                group = 0
                for p in g["params"]:
                    if p.grad is None:
                        continue
                    b = _storage_bytes(p) + _storage_bytes(p.grad)
                    b += sum(_storage_bytes(v) for v in self.optimizer.state.get(p, {}).values()
                             if isinstance(v, torch.Tensor) and v.device.type == self.device.type)
                    group = group + b if fused else max(group, b)
                if group > worst:
                    worst, where = group, "the optimizer step" + (" (foreach: all parameters at once)" if fused else "")
        if worst > self.budget:
            raise BudgetError(
                f"budget {fmt_bytes(self.budget)} ({int(self.budget)} bytes) is below the minimum working set: "
                f"{where} alone needs {fmt_bytes(worst)} ({worst} bytes); nothing was updated"
            )

    def _held_entries(self) -> list:
        """Storages on the device, between iterations, that no plan can move: the
        batches of earlier iterations the loop keeps (made inside the block: those made
        before it are not the budget's, see StorageTracking._entry)."""
        return [e for e in self._entries.values()
                if e.external and e.counted and e.state is RESIDENT and not e.foreign and e.ref() is not None]

    def _check_held(self) -> None:
        """Before a planned iteration: if the loop now holds more device memory than when
        the plan's iteration was profiled (it keeps every batch it has seen, say), by
        more than ``_HELD_MARGIN`` of the budget, the plan no longer fits beside it: this iteration
        is profiled again and the plan remade with the larger reserve
        (``stats.held_device_bytes``, ``stats.held_replans``)."""
        if not math.isfinite(self.stats.budget_bytes):
            return
        self._reap()
        now = sum(e.nbytes for e in self._held_entries())
        if now - self._held_baseline > _HELD_MARGIN * self.stats.budget_bytes:
            self._schedule.profile("held")  # (stats.plans_by_reason)
            self.stats.held_replans += 1

    def _build_trace(self) -> Trace:
        # NOTE: memory the loop holds that this iteration does not use (other batches it
        # keeps) is on the device all through it, and nothing can move it: the plan
        # keeps that much of the budget free (see _make_plan)
        used = {id(e) for e in self._iter_entries}
        held_then = self._recorder.take_held()
        # (bytes held, and of those the ones the trace does not have: handed to the plan
        # made from this trace, like _trace_sigs_next, which keeps them: FollowedPlan)
        self._profiled_held = (sum(e.nbytes for e in held_then),
                               sum(e.nbytes for e in held_then if id(e) not in used))
        # the recorded ops with their best times, less those our saved-tensor hooks
        # caused (runtime/profile_record.py)
        recorded = self._recorder.finish()
        if recorded.dropped:
            self._opfacts.keep_only(recorded.kept)
        last_kept = recorded.last_kept
        n_ops = len(recorded.ops)
        tensors = []
        for i, e in enumerate(self._iter_entries):
            kind = e.kind
            if kind == "temporary" and e.name == "<pre-existing>" and e.ref() is not None:
                kind = "parameter"  # held across iterations outside any op: model state
            persistent = kind in ("parameter", "optimizer_state")
            # NOTE: what the iteration did not make and the runtime does not own (the
            # batch, its targets, tensors the model keeps outside its state) is in
            # memory from the iteration's start and cannot be moved: external, so that
            # no plan counts on moving it (each such move was skipped, and the room the
            # plan had counted on was made by unplanned evictions)
            external = i in self._first_in and (e.kind in LOOP_KINDS or e.foreign)
            # (a storage the runtime did not make and cannot resize, what torch.load or
            # from_numpy built, say: held memory, never moved; runtime/outside.py)
            external = external or not e.resizable
            # NOTE: PyTorch frees a storage when its last reference goes, not at its last
            # use: a Python local, autograd's buffers, every .grad until zero_grad. The
            # memory is held until then, and a plan that counts it freed at its last use
            # finds the device fuller than simulated (unet-mini at 50%: 28 on-demand
            # fetches a step, 0 predicted). Gradients alive at the end (until the next
            # zero_grad) are the exception: a plan has no move for a tensor past its
            # last use, and held they would make every budget below parameters plus
            # gradients unplannable (vit-tiny at 30%); the runtime evicts them at need
            # instead, and nothing fetches them back.
            held = None
            if not persistent and n_ops:
                if e.ref() is not None:
                    held = n_ops - 1 if kind != "gradient" else None  # still alive when the iteration ended
                elif i in self._freed_at:
                    held = last_kept(self._freed_at[i])
            # (a storage made before the block is not the budget's: no bytes in the plan's count)
            size = int(max(e.nbytes, e.top)) if e.counted else 0
            tensors.append(TensorInfo(i, size, kind, persistent, e.name, e.key,
                                      held if held is not None and held >= 0 else None, external))
        rec, timing, kernels = recorded.ops, recorded.timing, recorded.kernels
        facts = self._opfacts.ops_facts(rec, [t.kind for t in tensors])  # scope, rng, pure (see opfacts)
        ops = [Op(name, phase, max(0.0, d), tuple(ins), tuple(outs), *f)
               for (name, phase, d, ins, outs), f in zip(rec, facts)]
        trace = Trace(ops, tensors, name=f"{type(self.model).__name__}@{self.device.type}",
                      meta={"source": "tierflow.runtime", "device": str(self.device), "timing": timing,
                            **({"kernel_times": kernels.summary()} if kernels is not None else {}),
                            # (the ticks a hook-driven follower could act at: runtime/segments.py)
                            **({"ticks": self._trace_ticks(recorded.kept)} if self._opfacts.ticks else {})})
        self._trace_sigs_next = list(recorded.sigs)
        return trace

    def _trace_ticks(self, kept: list[int]) -> list[list[Any]]:
        """The profiled iteration's ticks with the trace's op indices (segments.TickLog)."""
        from .segments import TickLog

        log = TickLog(lambda: 0, {})
        log.ticks = self._opfacts.ticks
        return log.for_trace(kept)

    def _agree_trace(self, trace: Trace) -> Trace:
        """The trace every rank plans from: the same ops and tensors on every rank (else
        :class:`~tierflow.runtime.distributed.RankMismatchError`), each op timed at the
        slowest rank's measurement; the CPU copy bandwidth, the slowest rank's."""
        from .distributed import trace_digest

        sync = self._sync
        sync.check_same(
            "profiled different iterations",
            f"{trace.n_ops} ops, {len(trace.tensors)} tensors, digest {trace_digest(trace)}",
            ": each rank must run the same ops on tensors of the same sizes (same per-rank batch shape, "
            "even shards) to share a plan; pass sync_ranks=False to let each rank plan alone")
        slowest = sync.slowest([o.duration_s for o in trace.ops])
        self._machine.agree_copy_bw()  # (CPU: the slowest rank's copy bandwidth)
        ops = tuple(replace(o, duration_s=d) for o, d in zip(trace.ops, slowest))
        # NOTE: when a storage is really freed depends on timing (a collective's buffers
        # go when its Work completes): every rank holds each tensor as long as the rank
        # that held it longest, and keeps free the most any rank's loop holds
        held = sync.slowest([float(-1 if t.held_until is None else t.held_until) for t in trace.tensors]
                            + [float(self._profiled_held[1])])
        self._profiled_held = (self._profiled_held[0], int(held[-1]))
        tensors = tuple(replace(t, held_until=int(h) if h >= 0 else None) for t, h in zip(trace.tensors, held))
        return Trace(ops, tensors, name=trace.name,
                     meta=dict(trace.meta, timing=f"measured, slowest of {sync.world_size} ranks"))

    @property
    def _host_costs(self) -> HostCosts | None:
        """The runtime's costs measured at the first plan (runtime/machine_model.py)."""
        return self._machine.costs

    def _plan_hardware(self, hw: Hardware, policy: str, own_host_steps: bool = True) -> Hardware:
        """The machine the policy plans for: without a host to step the optimizer on
        where host steps are not wanted (``offload(host_steps=...)``): on CUDA, by
        default, tierflow's planner does not choose them, since the host's optimizer
        kernels can round differently from the GPU's and the user expects parameters
        equal to plain PyTorch's. ``own_host_steps`` False: none where the choice is
        tierflow's own (``host_steps=None``; see ``Run._plan_for_signature``)."""
        allowed = self._host_steps_allowed(policy, own_host_steps)
        return hw if allowed or hw.host_compute is None else replace(hw, host_compute=None)

    def _host_steps_allowed(self, policy: str, own_host_steps: bool = True) -> bool:
        if self._host_steps is not None:
            return self._host_steps
        if not own_host_steps and policy == "tierflow":
            return False
        return not self._cuda or policy != "tierflow"

    def _policy_plan(self, trace: Trace, hw: Hardware, plan_budget: float, budget: float | None,
                     moves_only: bool = False, own_host_steps: bool = True) -> Plan:
        """The policy's plan for ``trace`` (the pager's reactive plan where it cannot
        make one: ``stats.plan_error`` says why); ``moves_only``: tierflow's joint planner
        with its move lever alone, unless the options name the levers."""
        from ..policies import make_plan

        arg = self._policy_arg
        if callable(arg):
            return arg(trace, hw, plan_budget)
        name = arg
        options = dict(self._policy_options)
        if name == "tierflow" and "levers" not in options and (moves_only or trace.peak_live_bytes <= plan_budget):
            # NOTE: the iteration fits: nothing leaves the device (what a user without
            # a budget expects). The joint planner would otherwise step the optimizer
            # on the host for a simulated gain, the host update overlapping the
            # device's work, which CPU mode does not have: there "host" and "device"
            # are the same cores (gpt2-small without a budget: 148 host steps, 2 GB
            # copied per step, 12% slower than plain PyTorch).
            options["levers"] = "move"
        if name == "tierflow":
            # NOTE: the runtime follows a planned plan move by move, as simulated; a
            # reactive one (G10's hints) runs through a pager the simulator does not
            # model, with on-demand fetches it did not predict. Hints only where no
            # planned plan fits (the policy's own fallback).
            options.setdefault("reactive", False)
        try:
            plan = make_plan(name, trace, self._plan_hardware(hw, name, own_host_steps), budget=budget, **options)
            if plan.host_steps and not self._host_steps_allowed(name, own_host_steps):
                # (a policy whose method is host steps plans them whatever the machine)
                raise PlanError(f"{name} planned {len(plan.host_steps)} host optimizer steps, which "
                                "offload(host_steps=False) refuses")
        except PlanError as e:
            # The policy cannot plan for this budget (the budget itself is above the
            # minimum working set: checked above). Training goes on with the reactive
            # pager, which needs no plan; stats.plan_error says why.
            plan = Plan(policy=f"lru (fallback from {name})", budget_bytes=plan_budget, reactive=True)
            self.stats.plan_error = str(e)
        return plan

    def _coarse_for(self, trace: Trace, plan_budget: float) -> tuple[Any, str | None]:
        """follow="hooks": the trace coarsened to its ticks, or None and why not."""
        if self._follow != "hooks":
            return None, None
        from ..policies import min_working_set
        from .segments import coarsen

        if not trace.meta.get("ticks") or not trace.n_ops:
            return None, "the profile logged no ticks"
        if self._sync is not None or self._foreign or self.stats.collectives:
            return None, "collectives and tensor subclasses are followed op by op"
        coarse = coarsen(trace)
        need, _op = min_working_set(coarse.trace)
        if need > plan_budget:
            return None, f"a segment needs {fmt_bytes(need)}, over the budget"
        return coarse, None

    def _host_step_tables(self, trace: Trace, plan: Plan, actions: list) -> tuple[list[int], list[bool]]:
        """Take up ``plan``'s host steps (runtime/host_step.py); where they cannot be
        executed the plan is followed without them and ``stats.plan_error`` says why.
        Returns the follower's order (the op after each) and which ops have moves after
        them; ``actions`` (the plan's move table) is changed in place where the host runs
        ops: their moves go to the device op before."""
        why, host_ops = self._host_adopt(trace, plan)
        if why is not None:
            self.stats.plan_error = why
        if not host_ops:
            return list(range(1, trace.n_ops + 1)), [bool(a) for a in actions]
        next_op, moved = follow_past_host_ops(trace.n_ops, host_ops, actions)
        actions[:] = moved  # (the plan's table, changed in place: the plan cache keeps it)
        return next_op, [bool(a) for a in moved]

    def _adopt_host_steps(self) -> None:
        """The followed plan's host steps taken up again (a cached plan restored): the
        plan with its follower's order past them."""
        fp = self._followed
        next_op, has_moves = self._host_step_tables(fp.trace, fp.plan, fp.actions)
        self._take_plan(replace(fp, next_op=next_op, has_moves=has_moves))

    def _adopt_retimed(self, r: Retimed) -> None:
        """The plan's prediction made again from its first followed iterations (see
        runtime/retime.py): the trace, machine model and figures the run reports from
        now on. The plan is not changed."""
        self.stats.predicted_step_time_s = r.prediction.time_s
        self.stats.ideal_step_time_s = r.trace.ideal_s
        self.stats.outside_handler_s = r.outside_s
        self._take_plan(replace(self._followed, trace=r.trace, hardware=r.hardware, prediction=r.prediction))

    def _make_plan(self, trace: Trace, own_host_steps: bool = True) -> bool:
        """Plan from ``trace``; False if the trace cannot be planned from yet (the
        budget, only now known, splits the optimizer step into chunks the profiled
        iteration did not run: the next iteration is profiled with them).
        ``own_host_steps`` False: tierflow's planner does not choose host steps
        (``Run._plan_for_signature``)."""
        from ..policies import min_working_set
        from ..simulate import simulate

        hw = self._machine.hardware(self.budget)  # (runtime/machine_model.py)
        self.stats.plan_error = None
        if self._budget_share is not None:
            self.budget = self._budget_share * trace.peak_live_bytes
            self.stats.budget_bytes = self.budget
            # NOTE: a share is of the first profiled iteration's unconstrained peak, and
            # stays that many bytes: a later profile (a new shape, a departure) runs under
            # the budget, and its peak is no base for a share (50% of a 50% peak)
            self._budget_bytes, self._budget_share = self.budget, None
        held = 0
        if math.isfinite(self.stats.budget_bytes):
            # NOTE: the budget is what torch.cuda.max_memory_allocated may reach; part of
            # that is memory no tracked storage holds (cuBLAS's workspaces, the caching
            # allocator rounding blocks up): measured while profiling, it is kept free.
            untracked = int(self._untracked_seen) if self._cuda else 0
            self.budget = self.stats.budget_bytes - untracked
            self.stats.untracked_device_bytes = untracked
            # So is, for the plan, what the loop holds beside the iteration (see
            # _build_trace); the runtime counts those storages itself.
            held = self._profiled_held[1]
            if held:
                # a plan fills its budget to the byte: a loop that keeps its batches holds
                # more as it meets new ones, so this much more is left for them before
                # the iteration is profiled again (see _check_held)
                held += int(_HELD_MARGIN * self.stats.budget_bytes)
            self.stats.held_device_bytes = held
        plan_budget = self.budget - held  # (what the trace's own tensors may have)
        if self._chunker is not None and math.isfinite(plan_budget) and self._chunker.fit(plan_budget):
            return False  # the profiled step ran whole: profile the chunked one
        need, op = min_working_set(trace)
        if need > plan_budget:
            reserve = self.stats.untracked_device_bytes
            outside = " and ".join(
                ([f"{fmt_bytes(reserve)} of device memory in use outside tierflow's tensors (cuBLAS's "
                  "workspaces, the allocator's rounding)"] if reserve else [])
                + ([f"{fmt_bytes(held)} the loop holds beside the iteration (batches it keeps)"] if held else []))
            left = (f"budget {fmt_bytes(self.stats.budget_bytes)} ({int(self.stats.budget_bytes)} bytes), less "
                    f"{outside}, leaves {fmt_bytes(plan_budget)}, which"
                    if outside else f"budget {fmt_bytes(plan_budget)} ({int(plan_budget)} bytes)")
            raise BudgetError(
                f"{left} is below the minimum working set: "
                f"op {op} ({trace.ops[op].name}) alone needs {fmt_bytes(need)} ({need} bytes)"
            )
        budget = plan_budget if math.isfinite(plan_budget) else None
        # follow="hooks": the plan is made from the trace coarsened to its ticks, where it
        # can be (runtime/hook_follow.py); else from the trace itself, followed op by op
        coarse, why = self._coarse_for(trace, plan_budget)
        plan = self._policy_plan(coarse.trace if coarse is not None else trace, hw, plan_budget, budget,
                                 moves_only=coarse is not None, own_host_steps=own_host_steps)
        if coarse is not None and (plan.recomputes or plan.host_steps or plan.reactive):
            why = ("the plan recomputes" if plan.recomputes else "the plan steps the optimizer on the host"
                   if plan.host_steps else "the plan is reactive")
            coarse = None
            self.stats.plan_error = None
            plan = self._policy_plan(trace, hw, plan_budget, budget, own_host_steps=own_host_steps)
        hook = None
        self.stats.follow = "hooks" if coarse is not None else "ops" + (f" ({why})" if why else "")
        sigs = self._trace_sigs_next
        if coarse is not None:
            from .hook_follow import HookFollower, coarse_sigs

            sigs = coarse_sigs(coarse, sigs)
            hook = HookFollower(self, coarse, list(trace.meta.get("ticks", ())), plan)
            trace = coarse.trace
        start_away: dict[str, str] = {}
        if not plan.reactive:
            try:
                residency = validate(plan, trace, hw)
            except PlanError as e:
                # A policy bug, not a reason to stop training: the executor fetches whatever
                # a plan gets wrong on demand and keeps the budget by itself. Say so.
                self.stats.plan_error = str(e)
            else:
                # NOTE: a tensor whose last move is a prefetch issued late in the
                # iteration starts the next one *coming* (the validator names the tier
                # it comes from): it is not to be evicted at the start (vit-tiny at 30%:
                # the patch embedding's weight was, then fetched on demand at op 0)
                last: dict[int, Any] = {}
                for m in sorted(plan.moves, key=lambda m: (m.after_op, m.kind != "evict")):
                    last[m.tensor] = m
                for tid, tier in residency.start_tier.items():
                    key = trace.tensors[tid].key
                    coming = tid in last and last[tid].kind == "prefetch"
                    if tier != hw.device and key and not coming:
                        # NOTE: the runtime tier by this plan's machine model (it was
                        # the previous plan's, None at the first plan: a tensor the plan
                        # starts on the SSD started on the host)
                        start_away[key] = _runtime_tier(hw, tier)
        try:
            sim = simulate(trace, hw, plan, check_plan=False)
            self.stats.predicted_step_time_s = sim.time_s if math.isfinite(sim.time_s) else None
            prediction = sim  # the simulator's view of the plan, for reports
        except TierflowError:
            self.stats.predicted_step_time_s = None
            prediction = None
        self.stats.ideal_step_time_s = trace.ideal_s
        self.stats.policy = plan.policy
        from .distributed import plan_digest

        self.stats.plan_digest = plan_digest(plan)
        self.stats.replans += 1
        # CPU mode: the prediction again from the first followed iterations (runtime/retime.py),
        # where this run's machine model is its own; not where the plan is followed at ticks
        # (its op-by-op timing has no ops to time)
        due = (not self._cuda and self._hardware_arg is None and not plan.reactive
               and self.stats.predicted_step_time_s is not None and hook is None)
        retimer = Retimer(trace, hw, plan, due)
        self.stats.predicted_step_time_s_at_plan = self.stats.predicted_step_time_s
        layout = self._lay_out(trace, plan, hw)
        layout = self._fit_tiers(trace, plan, hw, layout)  # (OffloadError where the host cannot hold the plan)
        # the follower's per-op tables (see executor._follow_op, _bind, _check_outs)
        funcs = [f for f, *_ in sigs]
        # (collectives: the general path; a merged segment has no op: runtime/hook_follow.py)
        fast_funcs = [None if f is None or _op_kind(f, _op_name(f)) else f for f in funcs]
        out_sizes = [out_sizes for *_, out_sizes in sigs]
        flat_args = [f is not None and _flat_tensor_args(f) for f in fast_funcs]
        write_spots = [_write_spots(f) if f is not None else () for f in fast_funcs]
        if math.isfinite(self.budget) or plan.moves or plan.recomputes or plan.host_steps:
            # (a temporary the plan moves is bound too: _fire moves it by its trace id)
            named = {t for r in plan.recomputes for t in r.tensors}
            named |= {m.tensor for m in plan.moves if not trace.tensors[m.tensor].persistent}
            bind_in, bind_out = _bindings(trace, sigs, named)
        else:  # no budget and nothing planned: no tensor will ever be moved or ranked, so
            # none is identified (a departure is still caught by op and result sizes)
            bind_in = bind_out = [None] * len(sigs)
        recomputer = self._recomputer.for_plan(trace, plan)  # its chains (runtime/recompute.py)
        levers_at = recomputer.levers_at
        # ops whose results are views, with nothing of theirs bound: the lean path skips
        # their results (same storages as their arguments, no bytes)
        views_only = [f is not None and _returns_views(f) and b is None and not write_spots[i]
                      for i, (f, b) in enumerate(zip(fast_funcs, bind_out))]
        actions = self._move_table(trace, plan, hw, layout)
        self._follower.forget_pending()  # (no prefetch of the last plan left queued)
        born = [0] * (trace.n_ops + 1)
        for t in trace.tensors:
            if not t.persistent and not t.external:  # (an external tensor is there before op 0)
                born[int(trace.birth[t.id])] += t.bytes
        if self._chunker is not None:
            self.stats.optimizer_chunks = self._chunker.chunks
        held_baseline = self._profiled_held[0]
        # the plan's host steps, if any (runtime/host_step.py); the moves after an op the
        # host runs move to the op before
        next_op, has_moves = self._host_step_tables(trace, plan, actions)
        # ops the lean path only runs: metadata over a storage, nothing planned there
        trivial = [f in METADATA_ONLY and bind_in[i] is None and bind_out[i] is None
                   and not levers_at[i] and not has_moves[i] and not born[i]
                   for i, f in enumerate(fast_funcs)]
        self._take_plan(FollowedPlan(
            trace=trace, plan=plan, hardware=hw, prediction=prediction, hook=hook,
            actions=actions, start_away=start_away,
            external_tids=frozenset(t.id for t in trace.tensors if t.external),
            held_baseline=held_baseline, retimer=retimer, recomputer=recomputer,
            n_ops=len(sigs), n_tensors=trace.n_tensors, funcs=funcs, out_sizes=out_sizes, bind_in=bind_in,
            bind_out=bind_out, op_labels=[f"{o.name}#{i}" for i, o in enumerate(trace.ops)], next_op=next_op,
            has_moves=has_moves, key_tid={t.key: t.id for t in trace.tensors if t.persistent and t.key},
            born=born,
            # the lean path's per-op row (executor._follow_op), in its order
            optab=list(zip(fast_funcs, trivial, next_op, flat_args, bind_in, levers_at, born, views_only,
                           out_sizes, write_spots, bind_out, has_moves))))
        return True
