"""Execute a plan in real PyTorch training: ``with tierflow.offload(model, opt, budget=...)``.

How it works, in one paragraph. While the ``with`` block is open, a light
``TorchDispatchMode`` sees every aten op. The first iteration (from the model's first
forward to ``optimizer.step()`` returning) is *profiled*: each op is recorded with the
storages it reads and writes, its module scope and its ``rng``/``pure`` flags, exactly
as :mod:`tierflow.capture` records a trace (:mod:`.opfacts`), and timed on the real
device. The trace goes to a policy, the plan comes back, and every
later iteration *follows* it: the mode counts ops, and when op ``k`` ends it issues the
plan's moves "after op ``k``". A move acts on a *storage*: eviction copies its bytes to
the host pool or the SSD file and shrinks the storage to zero bytes
(``untyped_storage().resize_(0)``, as FSDP frees parameters), so every tensor and view
that shares it (a parameter, the transposed weight autograd saved, a gradient, an Adam
moment, a saved activation) stays a valid Python object with its shape, and the memory
is gone; a fetch grows the storage back and copies the bytes in. Identity across
iterations comes from the trace's runtime keys (``param:NAME``, ``opt:NAME:KEY``) for
persistent tensors, and from the order of first use within the iteration (the trace's
tensor ids) for the rest: activations (labelled by the saved-tensor pack hook,
``saved:SEQ``) and gradients (labelled by post-accumulate-grad hooks, ``grad:NAME``).

Why it is never wrong. The same mode checks every op's inputs before the op runs: a
storage that is away is fetched on demand, whatever the plan said (a *stall*, counted).
So a plan can only make training slow, never incorrect. An iteration that departs from
the trace (another op, other shapes, more or fewer ops) switches the rest of that
iteration to the *reactive* mode (no plan; least recently used tensors are evicted when
the budget would be exceeded, everything fetched on demand), and the next iteration is
profiled again and re-planned.

The device budget. Before each op the executor makes room for what the op will create
(the bytes the trace says it allocates; in reactive mode the largest allocation seen so
far), evicting least recently used tensors the runtime owns (parameters, gradients,
optimizer state, saved activations; never the user's own tensors), so the peak stays
within the budget unless the op's own working set exceeds it. In CPU mode "device"
bytes are *accounted*: the sum of the live storages the runtime has seen that are
resident on the device (a storage's death is seen through a weak reference); on CUDA
``torch.cuda.max_memory_allocated`` is reported as well.

CUDA and CPU run the same code: :class:`~tierflow.runtime.streams.Copier` puts copies on
a side stream with events on CUDA and runs them at once on CPU.

Under torch.distributed (DDP, FSDP2) each rank runs its own executor. Collectives are
ops too: their inputs are made resident before they start, and what they read or write
is pinned while they are in flight (until their ``Work`` completes, or the program uses
a result). Tensor subclasses (FSDP2's DTensors) are seen through the plain tensors
inside them. Storages someone else resizes (FSDP2's unsharded parameters) are left to
their owner. The ranks plan together: :mod:`tierflow.runtime.distributed`.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..budget import Budget
from ..hardware import Hardware
from ..plan import Plan
from ..trace import Trace
from .backend import backend_for, sized_by
from .collectives import InFlight
from .errors import OffloadError, SSDError
from .follow import Follower, PlanFollowing
from .followed_plan import FollowedPlan
from .homecoming import bring_home
from .host_costs import measure_host_costs
from .host_step import HostSteps
from .kernel_times import mark
from .ledger import DeviceLedger
from .machine_model import MachineModel
from .moves import HomeTier, Mover, Moves
from .opfacts import OpFacts
from .optim_chunks import ChunkedStep
from .outside import CheckpointGuard, OutsideWork
from .profile_record import ProfileRecord
from .profile_schedule import ProfileSchedule
from .profiling import Profiling
from .recompute import Recomputer, rng_states
from .retime import Retimer
from .signatures import DEFAULT_MAX_PLANS, PlanCache, restore_stats, signature_of, snapshot
from .stats import RunStats
from .step_clock import StepClock, StepNesting
from .storages import (
    _PLAIN,
    RESIDENT,
    StorageTable,
    StorageTracking,
    _Entry,
    _leaves,
    _new_result_bytes,
    _op_kind,
    _op_name,
    _plain,
    _storage_bytes,
    _storage_id,
    _unwrap,
    _write_spots,
    _written_args,
    _written_at,
)
from .tier_set import Tiers

PolicyArg = str | Callable[[Trace, Hardware, float], Plan]


def _budget_spec(budget: str | int | float | None) -> tuple[float | None, float | None]:
    """``(bytes, share)``: one of them set, or both None for no budget (rules: :mod:`tierflow.budget`)."""
    parsed = Budget.parse(budget)
    return (None if parsed.bytes is None else float(parsed.bytes)), parsed.share


_PLAIN_TYPES: dict[tuple, bool] = {}
_NO_OUTS: list = []  # (a view op's new storages: none; never appended to)


_DETACH = torch.ops.aten.detach.default
_set_eval_frame = torch._C._dynamo.eval_frame.set_eval_frame


def _storage_id_of(t: Any, types: tuple) -> int | None:
    """The storage id of ``t`` (the plain tensor inside a subclass), None if no tensor."""
    if not isinstance(t, torch.Tensor):
        return None
    if types and type(t) not in _PLAIN:
        t = _plain(t)
    return _storage_id(t)


def _plain_types(types: tuple) -> bool:
    """Whether every tensor type an op saw is a plain tensor or a Parameter (cached:
    most ops of a step see one of a few type tuples)."""
    ok = _PLAIN_TYPES.get(types)
    if ok is None:
        ok = _PLAIN_TYPES[types] = all(t in _PLAIN for t in types)
    return ok


def _dispatch(self, func, types, args=(), kwargs=None):
    """``_Mode.__torch_dispatch__``: every aten op the model runs comes here."""
    prior = _set_eval_frame(None)  # (no Dynamo in the runtime's frames: see _Mode)
    try:
        run = self.run
        if run._quiet:  # an op of our own, from a hook or from planning: not the user's
            return func(*args, **(kwargs or {}))
        if prior is not None:
            # NOTE: Dynamo's frame hook is set only while torch.compile'd code runs; an op
            # reaching us with it set is an op of a compiled region that Dynamo ran eagerly
            # (it compiles nothing while a non-infra dispatch mode is on the stack)
            run._ran_eager_under_compile()
        # NOTE: the steady state (an iteration following its plan that still matches its
        # trace, plain tensors) takes the lean path. It needs no _quiet: while a
        # __torch_dispatch__ runs, torch has popped the mode, so the copies and resizes
        # it makes never come back here.
        if run._fast and not run._untracked and (not types or _PLAIN_TYPES.get(types) or _plain_types(types)):
            # NOTE: a flag read here, not a method swapped on the run for one iteration
            # (an instance attribute shadowing a method, set and deleted again)
            if run._timing:  # (the first followed iteration of a plan: see retime)
                return run._timed_follow_op(func, args, kwargs or {})
            return run._follow_op(func, args, kwargs or {})
        run._quiet = True
        t0 = time.perf_counter() if run._timing else 0.0
        try:
            return run._handle(func, args, kwargs or {}, types)
        finally:
            run._quiet = False
            if run._timing:  # (a collective in a timed followed iteration: see retime)
                run._retimer.add_handler_s(time.perf_counter() - t0)
    finally:
        _set_eval_frame(prior)


def _skip_dynamo(code: Any) -> bool:
    """Tell Dynamo never to trace frames of ``code`` (True if it could be told)."""
    try:
        ef = torch._C._dynamo.eval_frame
        ef.set_code_exec_strategy(code, ef._FrameExecStrategy(ef._FrameAction.SKIP, ef._FrameAction.DEFAULT))
    except (AttributeError, TypeError, RuntimeError):
        return False
    return True


# NOTE: torch wraps a dispatch mode's __torch_dispatch__ in torch._dynamo.disable, so that
# Dynamo never traces the mode's frames: about 3 us of Python per op, a third of what the
# whole lean path costs. The runtime does the same more cheaply: Dynamo is told to skip
# _dispatch's frames, and _dispatch turns Dynamo's frame hook off for the frames it calls
# (two calls into C). Where that cannot be done, torch's wrapper stays.
_LEAN_DISPATCH = _skip_dynamo(_dispatch.__code__)


class _Mode(TorchDispatchMode):
    def __init__(self, run: Run):
        super().__init__()
        self.run = run

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return not _LEAN_DISPATCH

    __torch_dispatch__ = _dispatch


class Run(StorageTracking, Moves, PlanFollowing, HostSteps, Profiling):
    """The context manager :func:`offload` returns; ``run.stats`` reports what happened.

    See :func:`offload` for the arguments.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        budget: str | int | float | None = None,
        policy: PolicyArg = "tierflow",
        ssd_dir: str | os.PathLike | None = None,
        *,
        hardware: str | Hardware | None = None,
        host_bytes: int | str | None = None,
        ssd_bytes: int | str | None = None,
        io_workers: int = 2,
        policy_options: dict[str, Any] | None = None,
        sync_ranks: bool = True,
        host_step_overlap: bool = True,
        host_steps: bool | None = None,
        follow: str = "ops",
        max_plans: int = DEFAULT_MAX_PLANS,
    ):
        from .hook_follow import FOLLOW_CHOICES

        try:  # plans kept, one per iteration signature (runtime/signatures.py)
            self._plans = PlanCache(max_plans)
        except ValueError as e:
            raise OffloadError(f"offload: {e}") from None
        # when the next iteration is profiled, and why (runtime/profile_schedule.py)
        self._schedule = ProfileSchedule()
        self._pager_iteration = False  # this iteration runs on the pager, unplanned (signatures)
        self._dominated = False  # this iteration follows a larger signature's plan (signatures)

        if follow not in FOLLOW_CHOICES:
            raise OffloadError(f"offload: follow={follow!r}; expected one of {', '.join(map(repr, FOLLOW_CHOICES))}")
        self._follow = follow
        self._hook: Any = None  # runtime/hook_follow.HookFollower of the plan, where follow="hooks" applies
        self.model, self.optimizer = model, optimizer
        p = next(model.parameters(), None)
        self.device = p.device if p is not None else torch.device("cpu")
        if self.device.type not in ("cpu", "cuda"):
            raise OffloadError(f"offload: the model is on {self.device}; expected cpu or cuda")
        self._cuda = self.device.type == "cuda"
        self._budget_bytes, self._budget_share = _budget_spec(budget)
        self.budget = math.inf if self._budget_bytes is None else self._budget_bytes
        self._policy_arg = policy
        self._policy_options = dict(policy_options or {})
        if isinstance(policy, str):
            # refuse an unknown policy or a bad option now, not after the profiled step
            from ..policies import check_options

            self._policy_options = check_options(policy, self._policy_options)
        self._ssd_dir = ssd_dir
        self._hardware_arg = hardware
        self._host_bytes, self._ssd_bytes = host_bytes, ssd_bytes
        self._io_workers = io_workers
        self._sync_ranks = sync_ranks
        self._host_overlap = host_step_overlap  # [host steps] start updates in backward
        self._host_steps = host_steps  # [host steps] may the planner choose them (see _plan_hardware)
        self._sync: Any = None  # a distributed.RankSync while the block is open, with >1 ranks
        self.stats = RunStats(budget_bytes=self.budget)
        self.trace: Trace | None = None
        self.prediction: Any = None  # SimResult of the plan being followed
        self.plan: Plan | None = None
        self.hardware: Hardware | None = None
        # the plan being followed, one record (runtime/followed_plan.py): None until the
        # first plan; the attributes above and the per-op tables are its fields, set by
        # _take_plan only
        self._followed: FollowedPlan | None = None
        # CPU mode: the plan's first followed iterations timed, its prediction made again
        # from them (runtime/retime.py); _timing: this iteration is (the lean path reads it)
        self._retimer = Retimer.idle()
        self._timing = False
        self._opfacts = OpFacts()  # the profiled iteration's scopes, flags and ticks (runtime/opfacts.py)
        self._open = False

    def __enter__(self) -> Run:
        model_bytes = sum(_storage_bytes(t) for t in self._state_tensors())
        # the tiers and the copies: one component owns them (runtime/tier_set.py)
        # (the device's one back-end: the block's tiers, shared with a compiled run; runtime/backend.py)
        self.backend = backend_for(self.device)
        self._tiers = self.backend.attach(self, lambda: Tiers.open(
            self.device, budget=self.budget, model_bytes=model_bytes, host_bytes=self._host_bytes,
            ssd_dir=self._ssd_dir, ssd_bytes=self._ssd_bytes, io_workers=self._io_workers), sized=sized_by(
            self._host_bytes, self._ssd_dir))
        self.stats.blocking_waits = self._tiers.copier.waits  # (the same dict: counted as they happen)
        # (the tiers' queue of slots waiting for their copies, read on every op: an alias)
        self._frees = self._tiers.frees
        self._ledger = DeviceLedger()  # accounted device bytes, copies out in flight, the peak (runtime/ledger.py)
        self._dev_attr = "is_cuda" if self.device.type == "cuda" else "is_cpu"
        # the storage records: one component owns them (runtime/storages.py). Its
        # containers are read on every op: aliases of the component's, never reassigned
        # (it changes them in place, and only it)
        self._storages = StorageTable(self._ledger, self._dev_attr, gone_away=self._storage_gone,
                                      op_now=lambda: self._op)
        table = self._storages
        self._entries, self._lru, self._by_key, self._dead = table.entries, table.lru, table.by_key, table.dead
        self._foreign, self._iter_entries, self._iter_tid = table.foreign, table.iter_entries, table.iter_tid
        self._freed_at = table.freed_at  # profiling: trace id -> last op its storage was alive
        self._untracked_seen = 0  # CUDA: most device bytes in use untracked, seen while profiling
        self._external_tids: frozenset[int] = frozenset()  # the plan's trace: external tensors
        self._held_baseline = 0  # bytes the loop held when the plan's iteration was profiled
        self._untracked_base = 0  # CUDA: device bytes in use, untracked, when the block opened
        # the profiled iteration's ops, their times, what the loop held (runtime/profile_record.py)
        self._recorder = ProfileRecord(self.device)
        self._hooks_off = False  # our saved-tensor hooks are off the stack (a followed iteration)
        self._quiet = False
        self._untracked = 0
        self._in_iter = False
        self._outside_ran = False  # an op ran between iterations (see _begin)
        self._fast = False
        self._recording = self._planned = self._hinted = False
        self._schedule.profile()  # (the first iteration the block runs is profiled)
        self._iters_begun = 0
        # collectives in flight and what they pin (runtime/collectives.py); the list is
        # read on every op: an alias of the component's, never reassigned
        self._collectives = InFlight()
        self._inflight = self._collectives.records
        # the bytes' moves between the device and the tiers, and what is in flight: the
        # back-end's mover (runtime/moves.py); its SSD writes in flight, read on every op:
        # an alias, never reassigned
        self._mover = Mover(self._tiers, self._ledger, self._storages, self._collectives, self.stats,
                            HomeTier(evict=self._host_evict, wait=self._host_wait, read=self._host_read))
        self._writes = self._mover.writes
        # following the plan op by op: the follower (runtime/follow.py); its queue of
        # prefetches waiting for room, read on every op: an alias, never reassigned
        self._follower = Follower(self._storages, self._mover, self._ledger, self.stats, room=lambda: self.budget,
                                  make_room=self._make_room, evict_beyond_plan=self._evict_beyond_plan,
                                  retire_leaving=self._retire_leaving)
        self._pending = self._follower.pending
        self._mover.tiers_sized()  # (stats.host_pool_bytes, ssd_file_bytes, pinned_bytes, ssd_bounce_bytes)
        from .distributed import RankSync, world

        self.stats.rank, self.stats.world_size = world()
        if self._sync_ranks and self.stats.world_size > 1:
            self._sync = RankSync()
        # the machine plans are made for, from what is measured here (runtime/machine_model.py)
        # NOTE: measure_host_costs runs the run's own lean path on scratch tensors: it
        # needs the run, so the model gets it as a callable
        self._machine = MachineModel(self.device, self.stats, preset=self._hardware_arg, sync=self._sync,
                                     tier_limits=self._tier_limits, has_ssd=self._tiers.ssd is not None,
                                     probe_move_s=self._probe_move_s, measure_costs=lambda: measure_host_costs(self))
        self._max_out = 0
        self._clock = StepClock(self.device, self.stats)
        self._step_nesting = StepNesting()  # is optimizer.step() running (runtime/step_clock.py)
        self._names = {id(p): n for n, p in self.model.named_parameters()}
        for n, p in self.model.named_parameters():
            table.label(table.entry(p), "parameter", f"param:{n}", n)
        for n, b in self.model.named_buffers():
            table.label(table.entry(b), "parameter", f"buffer:{n}", n)
        self._label_opt_state()
        self._hooks = [self.model.register_forward_pre_hook(self._on_forward, prepend=True, with_kwargs=True)]
        for n, p in self.model.named_parameters():
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad(n)))
        # the plan's recompute chains (runtime/recompute.py): one per plan, none yet
        self._recomputer = Recomputer(self._storages, self._ledger, self._tiers.copier, self.stats, self.device,
                                      make_room=self._make_room, ensure_resident=self._ensure_resident)

        # the optimizer's step in chunks (runtime/optim_chunks.py): installed for
        # foreach/fused groups, stepped in chunks that fit the budget, and by host steps
        self._chunker = ChunkedStep(self.optimizer, cuda=self._cuda) if self.optimizer is not None else None
        self._host_init()  # [host steps] (runtime/host_step.py)
        if self.optimizer is not None:
            if self._chunker.wanted:
                self._chunker.install()
                if math.isfinite(self.budget):
                    self._chunker.fit(self.budget)
            self._hooks.append(self.optimizer.register_step_pre_hook(self._on_step_pre))
            self._hooks.append(self.optimizer.register_step_post_hook(self._on_step_post))
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            # what was on the device before the block (another model, the data) is not
            # the run's: untracked memory is counted above this
            self._untracked_base = torch.cuda.memory_allocated(self.device) - self._ledger.used
        # (state dicts taken inside the block never hold an away tensor: runtime/outside.py)
        self._checkpoints = CheckpointGuard(self)
        self._checkpoints.install(self.model, self.optimizer)
        self._outside = OutsideWork()
        self._mode = _Mode(self)
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._mode.__enter__()
        self._saved.__enter__()
        self._open = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._open:
            return
        self._open = False
        self._quiet = True
        self._tiers.stop_counting_waits()  # (bringing everything home waits by design)
        errors: list[str] = []
        try:
            if self._hook is not None:  # (an iteration followed at ticks, cut short: the mode back)
                self._hook.close()
            self._opfacts.end_scopes()  # (a profiled iteration cut short: its scope tracker's hooks)
            self._opfacts.end_ticks()  # (and its tick log's)
            self._recorder.close()  # (and its kernel timer)
            self._hooks_on()
            self._saved.__exit__(None, None, None)
            self._mode.__exit__(None, None, None)
            for h in self._hooks:
                h.remove()
            self._checkpoints.remove()
            self._host_close()  # [host steps] updates finished, state back where it was
            if self._chunker is not None:
                self._chunker.uninstall()
            # the model and optimizer whole again after the block: on the device where
            # they fit, else on the host (runtime/homecoming.py)
            self.stats.state_after_block = bring_home(self.model, self.optimizer, self.device, storages=self._storages,
                                                      mover=self._mover, ledger=self._ledger, errors=errors)
            self._mover.drain_writes()
            self._tiers.copier.drain()
            self._mover.reap()
            if not self._in_iter and self._outside_ran:  # (validation after the last step)
                self._fold_outside_peak()
            self.stats.checkpoint_copies = self._checkpoints.copies
            if self.device.type == "cuda":
                self._clock.collect(wait=True)
                self.stats.cuda_max_allocated = int(torch.cuda.max_memory_allocated(self.device))
        finally:
            if self._sync is not None:
                self._sync.close()
                self._sync = None
            self._mover.tiers_sized()
            self.stats.host_pool_peak = self.backend.detach(self)  # (the tiers close with the last user)
            self._storages.clear()
            self._collectives.clear()
        if errors and exc is None:
            raise SSDError("offload: could not bring every tensor back: " + "; ".join(errors[:3]))
        if exc is None:
            self._mover.raise_failure()  # (an SSD write of the last iteration, or after it)

    def _on_forward(self, module, args, kwargs=None):
        # a forward inside untracked(), or under no_grad / inference_mode between
        # iterations (validation, generation, a metric), begins no iteration: it trains
        # nothing, its ops run on the general path within the budget, and the plan stays
        # in force for the next training forward (runtime/outside.py)
        if self._outside.is_outside(self._in_iter, self._untracked > 0):
            if not self._untracked:
                self._outside.note()
                self.stats.outside_forwards = self._outside.forwards
            return
        if not self._in_iter:
            self._mover.raise_failure()  # (an SSD write that failed between iterations)
            self._quiet = True
            try:
                if self.plan is not None and not self._schedule.need_profile:
                    self._check_held()  # the loop holds more than when profiled: profile again
                self._choose_plan(signature_of(args, kwargs or {}, module.training))
                self._begin()
                if self._dominated:  # (its op times are not the plan's trace's to re-time it with)
                    self._timing = False
                table = self._storages
                for i, x in enumerate(t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)):
                    e = table.entry(x, counted=False)
                    if e is not None and e.kind == "temporary":
                        table.label(e, "input", f"input:{i}", f"input{i}")
            finally:
                self._quiet = False

    def _choose_plan(self, sig: Any) -> None:
        """Before an iteration of signature ``sig`` begins: follow its cached plan,
        profile it (a new signature), or run it on the pager (runtime/signatures.py)."""
        cache, st = self._plans, self.stats
        self._pager_iteration = self._dominated = False
        if self.plan is None or cache.current is None:  # (no plan yet: the first profile)
            cache.switch(sig)
            return
        if sig == cache.current:
            return
        if self._sync is not None:
            # NOTE: ranks plan together (runtime/distributed.py): one rank following a
            # cached plan while another profiles would leave the other waiting in the
            # planning collectives. Under several ranks a new signature is profiled again.
            cache.restart(sig)
            self._schedule.profile("new signature")
            return
        if self._schedule.need_profile:  # the current signature's plan departed: not to be followed again
            cache.discard_current()
        elif cache.current in cache.plans:  # (its retimed trace and figures, as they are now)
            cache.refresh_current(snapshot(self))
        decision = cache.decide(sig)
        if isinstance(decision, tuple):  # ("dominated", the larger signature whose plan it follows)
            decision, sig = decision
            self._dominated = True
            st.dominated_steps += 1
        if decision in ("follow", "dominated"):
            # NOTE: host steps own live state (master copies, the state on the host,
            # hooks): given up for the plan being left, taken up again for the one restored
            self._host_release()
            cached = cache.plans[sig]
            self._take_plan(cached.state)
            restore_stats(self.stats, cached)
            if self.plan.host_steps:
                self._adopt_host_steps()
            if not self._dominated:
                cache.followed(sig)
            cache.switch(sig)
            self._schedule.follow_cached()  # (its start state: what it wants on the device, and away)
            st.signature_hits += not self._dominated
        elif decision == "profile":
            cache.switch(sig)
            self._schedule.profile("new signature")
        else:  # a first sighting while the cache churns: the pager keeps the budget
            self._pager_iteration = True
            self._schedule.after_pager()  # (the next planned iteration restores its start state)
            st.reactive_signature_steps += 1

    def _take_plan(self, fp: FollowedPlan) -> None:
        """Follow ``fp`` from now on (a plan just made, or one the plan cache kept). The
        one writer of the plan's attributes: each is a field of ``fp``, kept on ``self``
        because the lean path reads them on every op (one lookup, not two)."""
        self._followed = fp
        self.trace, self.plan, self.hardware, self.prediction = fp.trace, fp.plan, fp.hardware, fp.prediction
        self._hook, self._actions, self._start_away = fp.hook, fp.actions, fp.start_away
        self._external_tids, self._held_baseline = fp.external_tids, fp.held_baseline
        self._retimer, self._recomputer = fp.retimer, fp.recomputer
        self._n_ops, self._n_tensors, self._funcs, self._out_sizes = fp.n_ops, fp.n_tensors, fp.funcs, fp.out_sizes
        self._bind_in, self._bind_out, self._op_labels = fp.bind_in, fp.bind_out, fp.op_labels
        self._next_op, self._has_moves, self._key_tid, self._born = fp.next_op, fp.has_moves, fp.key_tid, fp.born
        self._optab = fp.optab

    def _plan_for_signature(self, trace: Trace) -> bool:
        """Plan from ``trace`` (see ``_make_plan``) for the current signature and cache
        the plan. NOTE: a plan made while other signatures' plans are cached does
        without host steps where the choice is tierflow's own (``host_steps=None``): a
        host-step plan holds the optimizer state on the host, and each switch between it
        and another plan moved all of it back and forth (a 3-length bucketing loop: its
        host-step bucket's steps 2.2x those of the same length alone)."""
        others = self._schedule.why == "new signature"  # (other signatures' plans are cached)
        planned = self._make_plan(trace, own_host_steps=not others)
        if planned:
            self._plan_made()
        return planned

    def _plan_made(self) -> None:
        """A plan was just made for the current signature: count why, and cache it."""
        st, cache = self.stats, self._plans
        why = self._schedule.plan_made()  # (the next profile of this signature: "departure", unless said otherwise)
        st.plans_by_reason[why] = st.plans_by_reason.get(why, 0) + 1
        if self.plan is not None and cache.current is not None:
            cache.store(cache.current, snapshot(self))
        st.signatures_cached, st.signatures_evicted = len(cache.plans), cache.evicted

    def _fold_outside_peak(self) -> None:
        """The peak of the ops run since the last iteration ended (validation, a state
        dict, logging) into the run's figures."""
        st = self.stats
        if math.isfinite(self.budget):  # (a share budget is known from the first plan on)
            st.peak_device_bytes_outside = max(st.peak_device_bytes_outside, self._ledger.peak)
            st.peak_device_bytes = max(st.peak_device_bytes, self._ledger.peak)

    def _begin(self) -> None:
        if self._outside_ran:
            self._fold_outside_peak()
        self._in_iter = True
        self._step_nesting.reset()  # (a step that raised left its count behind)
        self._op = 0
        self._follower.begin_iteration()  # (no gradient held past its last use yet)
        self._first_in: set[int] = set()  # profiling: trace ids first seen as an op's input
        self._recording = (self._schedule.need_profile or self.plan is None) and not self._pager_iteration
        following = not self._recording and self.plan is not None and not self._pager_iteration
        self._planned = following and not self.plan.reactive
        self._hinted = following and self.plan.reactive
        if self._recording and self._host_active:  # [host steps] a profile sees the whole step on the device
            self._host_release()
        # following a plan, only the tensors the plan names are identified (by _bind):
        # their trace ids index _iter_entries; profiling, every tensor in order of first use
        self._storages.begin_iteration(self._recording, 0 if self._recording else self._n_tensors)
        self._stale = False
        # the lean per-op path (a planned plan, or a reactive one's hints), until the
        # iteration departs from the trace
        self._fast = self._planned or self._hinted
        hooked = self._fast and self._planned and self._hook is not None and self._hook.usable(self)
        if self._fast and not hooked:  # (following at ticks needs the saved-tensor hooks)
            self._hooks_off_for_iteration()
        self._timing = self._retimer.begin(self._planned, getattr(self, "_n_ops", 0),
                                           (self.stats.recompute_s, self.stats.recomputed_ops))
        # (an optimizer still without state after one step keeps none: SGD without momentum)
        self._warmup = self.optimizer is not None and not any(self.optimizer.state.values()) and self._iters_begun == 0
        # DDP rebuilds its gradient buckets in its second forward (other ops, other
        # tensors): profile after that
        if getattr(self.model, "_has_rebuilt_buckets", None) is False and self._iters_begun < 2:
            self._warmup = True
        self._iters_begun += 1
        # CUDA: the profiled iteration's op times are its kernels' (kernel_times), if the
        # torch profiler can run here; the events around each op stay as the fallback
        self._recorder.begin(self._recording, self._times_kernels() and not self._warmup)
        if self._recording:  # ops' scopes and flags, for the trace (see opfacts)
            self._opfacts.begin_scopes(self.model)
        # (profiling: the ticks a hook-driven follower could act at, runtime/segments.py)
        self._opfacts.begin_ticks(self.model, self._recording, self._recorded_ops)
        if self._planned:
            self._follower.leave_start_away(self._start_away)  # (persistent tensors the plan starts the iteration without)
            # (after a profile, or after ops between iterations moved what the plan
            # starts with: validation, a state dict; runtime/outside.py)
            if self._schedule.take_start_state() or self._outside_ran:
                self._follower.enter_start_state(self._start_away)
        self._outside_ran = False
        self._mover.reap()  # (storages that died since, e.g. state moved to the host, are not counted)
        if self._recording:
            self._recorder.hold(self._held_entries())
        self._ledger.start_peak()
        self._budgeted = math.isfinite(self.budget)
        self._clock.start()
        if hooked:  # follow at ticks: the dispatch mode off the stack until the optimizer step
            self._hook.begin()

    def end_iteration(self) -> None:
        """Mark the end of an iteration. Called for you when ``optimizer.step()`` returns;
        call it yourself only when training without an optimizer."""
        wall = self._clock.wall() if self._timing else 0.0
        if self._hook is not None and self._hook.off_mode:  # (no optimizer step: the ticks end here)
            self._hook.finish()
        self._hooks_on()
        self._host_finish()  # [host steps] every host update done, parameters back
        if not self._in_iter:
            return
        self._opfacts.end_scopes()
        self._opfacts.end_ticks()
        if not self._fast:  # (a clean planned iteration made no state the profile did not see)
            self._label_opt_state()
        self._in_iter = False
        self._storages.end_iteration()
        self._fast = False
        self._step_nesting.ended()
        if self._foreign:
            self.stats.foreign_storages = sum(1 for e in self._foreign.values() if e.ref() is not None)
        st = self.stats
        st.steps += 1
        kind = "planned" if ((self._planned or self._hinted) and not self._stale) else "other"
        st.step_kinds.append(kind if kind == "planned" else ("warmup" if self._warmup else "profiled")
                             if self._recording else "reactive")
        self._clock.stop(kind)
        if self._budgeted or (self._budget_bytes is None and self._budget_share is None):
            st.peak_device_bytes = max(st.peak_device_bytes, self._ledger.peak)
        else:  # a share budget: the profile iteration that measured the peak ran without one
            st.peak_device_bytes_unconstrained = max(st.peak_device_bytes_unconstrained, self._ledger.peak)
        if self._planned and not self._stale and self._op != self.trace.n_ops:
            self._mark_stale(f"the iteration ran {self._op} ops, the trace has {self.trace.n_ops}")
        want = self._recording and not self._warmup
        if self._sync is not None:
            # the ranks plan together or not at all (planning calls collectives): one
            # that profiled while another followed its plan makes them all profile again
            self._quiet = True
            try:
                every, some = self._sync.agree(want)
            finally:
                self._quiet = False
            if some and not every:
                want = False
                self._schedule.profile()
        if self._recording:
            st.profiled_steps += 1
            self._quiet = True  # planning allocates (a bandwidth probe): not the user's ops
            try:
                trace = self._build_trace()
                if want:
                    if self._sync is not None:
                        trace = self._agree_trace(trace)
                    planned = self._plan_for_signature(trace)
                    if planned and self._sync is not None:
                        self._sync.check_same(
                            "made different plans", self.stats.plan_digest or "",
                            f" from the same trace with policy {self.stats.policy!r}: the policy is not a pure "
                            "function of the trace and hardware (a wall-clock limit?); pass sync_ranks=False "
                            "to let each rank follow its own plan")
                    if not planned:
                        self._schedule.not_planned()
            finally:
                self._quiet = False
        elif (self._planned or self._hinted) and not self._stale:
            st.planned_steps += 1
            st.peak_device_bytes_planned = max(st.peak_device_bytes_planned, self._ledger.peak)
        else:
            st.reactive_steps += 1
        if self._timing:
            self._timing = False
            followed = not self._stale and self._op == self.trace.n_ops
            retimed = self._retimer.end(wall, followed, getattr(self, "_host_costs", None),
                                        (st.recompute_s, st.recomputed_ops))
            if retimed is not None:
                self._adopt_retimed(retimed)
        if self._stale and not self._dominated:  # (a dominated iteration's departure says nothing of its plan)
            self._schedule.profile()
        self._storages.forget_iteration()
        # (from here: the peak of the ops between iterations, _fold_outside_peak; not what
        # the iteration left, above a share budget after the unconstrained profile)
        self._ledger.clear_peak()
        self._recomputer.reset()  # (what a chain holds is released with the iteration)
        self._mover.raise_failure()  # (a failed SSD write: the step is whole, counted in stats.steps)

    def _handle(self, func, args, kwargs, types=()):
        if not self._in_iter:  # (an op between iterations: the plan's start state is restored at _begin)
            self._outside_ran = True
        # profiling: every op the model dispatches is asked its scope (that is what ties
        # the autograd nodes it makes to its module, for backward's scopes)
        scope = self._opfacts.scope()
        unpacked = self._storages.take_unpacked()  # (see _unpack, _build_trace)
        if self._dead or self._frees or self._writes or self._inflight:
            self._mover.reap()
        if self._pending:
            self._follower.issue_pending(self._hinted)
        tensors = _leaves(args) + (_leaves(list(kwargs.values())) if kwargs else [])
        if types:  # tensor subclasses (DTensor): the plain tensors inside hold the bytes; the
            # subclass runs its own ops on them below this mode, unseen, so they are made
            # resident here
            tensors = _unwrap(tensors)
        if self._untracked:
            for t in tensors:
                e = self._entries.get(t.untyped_storage()._cdata) if t.device.type == self.device.type else None
                if e is not None:
                    self._make_room(e.nbytes if e.state != RESIDENT else 0, [e])
                    self._ensure_resident(e)
                    if e.home is not None and _write_spots(func):  # [host steps] (a master copy gone stale?)
                        self._host_written(func, args, kwargs)
            return func(*args, **kwargs)
        name = _op_name(func)
        special = _op_kind(func, name)
        table = self._storages
        if special == 2 and self._foreign:  # FSDP has just re-allocated what this op fills
            table.sync_foreign()
        ins = [e for e in (table.entry(t, counted=False) for t in tensors) if e is not None]
        in_iter = self._in_iter
        i = self._op if in_iter else -1
        following = in_iter and self._follows()
        if following and func is _DETACH and self._hooks_off and (i >= self._n_ops or self._funcs[i] is not func):
            return func(*args, **kwargs)  # (autograd's, without our hooks: see _follow_op)
        if following and (i >= self._n_ops or self._funcs[i] is not func):
            self._mark_stale(f"op {i}: ran {name}, the trace has "
                             + (self.trace.ops[i].name if i < self._n_ops else "the end of the iteration"))
            following = False
        if following and self._bind_in[i] is not None and not self._bind(i, self._bind_in[i], ins):
            following = False
        if following:
            expect = self._born[i]
        else:
            # NOTE: the pager makes room before the op runs, so it needs the bytes the op
            # will make. Under a budget the op's meta kernel says (a profiled iteration
            # costs a few tens of microseconds more per op); else, or where it cannot,
            # the largest an op has made so far: in the first iteration that can be too
            # little (gpt-tiny at a 1.3 MB budget overshot by 9% at its logits)
            expect = self._max_out
            if self.budget < math.inf and not types and not special:
                est = _new_result_bytes(func, args, kwargs)
                if est is not None:
                    expect = est
        away = sum(e.nbytes for e in ins if e.state != RESIDENT)
        self._make_room(away + expect, ins)
        for e in ins:
            self._ensure_resident(e)
            if e.pins and not special:
                e.touched = True
        timed = self._recording and in_iter and not following
        if timed and self._cuda:  # the op's GPU time: events around it, read at the trace
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
            with mark(self._recorder.timer, len(self._recorder)):  # (this op's index once recorded)
                out = func(*args, **kwargs)
            ev1.record()
            dur = 0.0
        else:
            t0 = time.perf_counter() if timed else 0.0
            out = func(*args, **kwargs)
            dur = time.perf_counter() - t0 if timed else 0.0
        label = f"{name}#{i}"
        leaves = _leaves(out)
        outs = [e for e in (table.entry(t, label) for t in (_unwrap(leaves) if types else leaves)) if e is not None]
        written = _written_args(func, args, kwargs)
        n_fresh = len(outs)
        new_bytes = self._account_written(_unwrap(written) if types else written, outs, label)
        if special:
            self._on_special(special, out, ins, outs, outs[n_fresh:])
        table.touch(ins + outs)
        if following and not self._stale:
            self._check_outs(i, outs)
        elif in_iter and not following:
            n_before = len(self._iter_entries)
            in_ids = [table.tid(e) for e in ins]
            if self._recording and len(self._iter_entries) > n_before:
                # first seen as an op's input: made before the iteration (model state,
                # the batch, its targets), not by one of its ops
                self._first_in.update(range(n_before, len(self._iter_entries)))
                for e in self._iter_entries[n_before:]:
                    table.mark_external(e)
            out_ids = [table.tid(e) for e in outs]
            new_bytes += sum(e.nbytes for e in self._iter_entries[n_before:] if e.kind not in ("parameter",))
            self._max_out = max(self._max_out, new_bytes)
            if self._recording:
                phase = "backward" if torch._C._current_graph_task_id() != -1 else self._phase()
                j = self._recorder.add(func, name, phase, dur, in_ids, out_ids, [e.nbytes for e in ins],
                                     [e.nbytes for e in outs], (ev0, ev1) if self._cuda else None)
                if self._cuda:
                    # device memory in use that no tracked storage explains (library
                    # workspaces, the allocator's rounding, the user's other tensors)
                    seen = self._untracked_now()
                    if seen > self._untracked_seen:
                        self._untracked_seen = seen
                self._opfacts.note(j, scope, func, args, kwargs, self._written_tid)
                if unpacked is not None and func is _DETACH and _storage_id_of(args[0], types) == unpacked:
                    self._recorder.add_hook_op(j)  # autograd's, after our unpack hook
        table.note_peak()
        if in_iter:
            if following and not self._stale:
                self._follower.fire(self._actions, i, self._hinted)
            self._op = self._next_op[i] if following else self._op + 1  # [host steps] past host ops
        return out

    def _recorded_ops(self) -> int:
        """Ops recorded so far in the profiled iteration (where a tick falls)."""
        return len(self._recorder)

    def _written_tid(self, t: Any) -> int | None:
        """The trace id of a tensor an op just wrote (None: off the device, no storage)."""
        e = self._storages.entry(t)
        return self._iter_tid.get(e.cdata) if e is not None else None

    def _followed_to(self, op: int) -> None:
        """The iteration has been followed at ticks up to op ``op`` (runtime/hook_follow.py:
        a segment's end, with no dispatch mode to count the ops): counting resumes there."""
        self._op = op

    def _mark_stale(self, why: str) -> None:
        """The iteration departed from its plan's trace (``why``): the rest of it runs on
        the general path, and the next is profiled again."""
        self._stale = True
        self._fast = False
        self._hooks_on()  # (the general path labels what is saved from here on)
        self.stats.stale_plans += 1
        if len(self.stats.stale_reasons) < 5:
            self.stats.stale_reasons.append(why)
        if self._host_active:  # host updates not yet begun wait for the step (runtime/host_step.py)
            self._host_departed()

    def _follows(self) -> bool:
        """Whether this iteration is following a plan (planned, or a reactive plan's
        hints) and has not departed from its trace."""
        return (self._planned or self._hinted) and not self._stale

    def _bind(self, i: int, binds: tuple, ents: list[_Entry]) -> bool:
        """Tensors op ``i`` uses first in the iteration, that the plan names: bind each
        to its trace id (its position among the op's inputs or outputs says which) and
        check it is the tensor the trace saw there: a parameter or optimizer state by
        its key, anything else by its size. False (and the plan stale) if not."""
        table = self._storages
        for pos, tid, want, label in binds:
            if pos >= len(ents):
                self._mark_stale(f"op {i}: {self.trace.ops[i].name} used fewer tensors than the trace has")
                return False
            e = ents[pos]
            if want.__class__ is str:
                if e.key != want:
                    self._mark_stale(f"op {i}: tensor {tid} is {e.label}, the trace has {want}")
                    return False
            elif e.nbytes != want and self._size_departs(e, want):
                self._mark_stale(f"op {i}: tensor {tid} has {e.nbytes} bytes, the trace has {want}")
                return False
            table.bind(tid, e)
            if label is not None and e.key is None:  # an activation or gradient, as profiled
                table.label(e, *label)
            elif tid in self._external_tids:
                table.mark_external(e)
        return True

    def _size_departs(self, e: _Entry, want: int) -> bool:
        """Whether ``e``, whose size is not the trace's ``want`` (the caller compares
        first: sizes are equal on nearly every op), departs from the trace: not a foreign
        storage (its size is FSDP's, accounted when looked at, ``StorageTable.sync_foreign``), and not
        a smaller tensor of an iteration following a larger signature's plan
        (runtime/signatures.py)."""
        return not e.foreign and not (self._dominated and e.nbytes <= want)

    def _check_outs(self, i: int, outs: list[_Entry]) -> None:
        """Op ``i``'s results against the trace: as many, of the same sizes (what the
        budget depends on); then the ones the plan names are bound."""
        sizes = self._out_sizes[i]
        # (a foreign storage's size is its owner's, FSDP's: it changes when FSDP frees or
        # gathers it, not with the op, and is accounted when looked at, StorageTable.sync_foreign)
        if len(outs) != len(sizes) or any(e.nbytes != n and self._size_departs(e, n) for e, n in zip(outs, sizes)):
            self._mark_stale(f"op {i}: {self.trace.ops[i].name} made {[e.nbytes for e in outs]} bytes, "
                             f"the trace has {self._out_sizes[i]}")
        elif self._bind_out[i] is not None:
            self._bind(i, self._bind_out[i], outs)

    def _timed_follow_op(self, func, args, kwargs):
        """``_follow_op`` with the time spent inside it counted (the handler's share, see
        retime)."""
        t0 = time.perf_counter()
        try:
            return self._follow_op(func, args, kwargs)
        finally:
            self._retimer.add_handler_s(time.perf_counter() - t0)

    def _follow_op(self, func, args, kwargs):
        """The steady state: op ``self._op`` of an iteration following its plan, that
        matches its trace so far. What :meth:`_handle` does for such an op, and nothing
        else: no timing, no LRU upkeep while a planned plan picks victims by next use,
        the room it makes is the trace's, tensors are identified only where the plan
        names them (by their position in the op, from the profiled iteration), and the
        moves after it come from a per-op table."""
        i = self._op
        row = self._optab[i] if i < self._n_ops else None
        if row is None or row[0] is not func:
            if func is _DETACH and self._hooks_off:
                # NOTE: without saved-tensor hooks autograd detaches some tensors it
                # saves (the profile's pack hook did that below the mode): metadata
                # over a storage, not in the trace, harmless to run as it is
                return func(*args, **kwargs)
            return self._handle(func, args, kwargs)  # a departure, or a collective: the general path
        # (one row of per-op facts, see _make_plan: one lookup instead of a dozen)
        _f, trivial, next_op, flat, binds, levers, born, views_only, sizes, spots, bind_out, moves = row
        if trivial:  # (metadata only, nothing planned here: storages.METADATA_ONLY)
            out = self._retimer.call(i, func, args, kwargs) if self._timing else func(*args, **kwargs)
            self._op = next_op  # (i + 1, past ops the host runs)
            return out
        table = self._storages
        entries, dev, entry = self._entries, self._dev_attr, table.entry
        if self._dead:  # storages that died: forget them (then no entry of a dead storage is
            table.retire_dead()  # left to confuse a lookup by address below)
        if self._frees or self._writes or self._inflight:
            self._mover.reap()
        if self._pending:
            self._follower.issue_pending(self._hinted)
        # NOTE: the loops below are written out, not shared helpers: they run for every
        # op, and in CPython a call and a list per op cost as much as the work itself
        ins = []
        away = 0
        fix = False  # an input is away, arriving, or pinned by a collective
        # (flat: the schema has no tensor lists and no keyword-only tensors, so the
        # tensors are plain positional arguments)
        for t in args if flat else _leaves(args) + _leaves(list(kwargs.values())):
            if not isinstance(t, Tensor) or getattr(t, dev) is not True:  # (is_cpu / is_cuda)
                continue
            try:
                e = entries.get(_storage_id(t))
            except (RuntimeError, NotImplementedError):  # no storage
                continue
            if e is None:
                e = entry(t, None, False)  # first sight: made before the block (see StorageTable.entry)
            ins.append(e)
            if e.state is not RESIDENT:
                away += e.nbytes
                fix = True
            elif e.arrival is not None or e.pins:
                fix = True
        if binds is not None and not self._bind(i, binds, ins):
            return self._handle(func, args, kwargs)  # (stale now: the general path runs it)
        if levers:  # (this op re-makes, records for, or drops a chain: runtime/recompute.py)
            rc = self._recomputer
            if rc.remakes[i]:  # recompute chains due before this op
                rc.remake_before(i)
                fix = True  # (a chain's replay may have moved an input)
                # (and has re-made the dropped ones: no room to make for them again)
                away = sum(e.nbytes for e in ins if e.state is not RESIDENT)
        need = away + born
        ledger = self._ledger
        if ledger.used + need > self.budget:
            self._make_room(need, ins)
        if fix:
            for e in ins:
                if e.state is not RESIDENT or e.arrival is not None:
                    self._ensure_resident(e)
                if e.pins:
                    e.touched = True
        chains = rc.chain_ops[i] if levers else ()
        states = rng_states(self.device) if chains and torch.Tag.nondeterministic_seeded in func.tags else None
        # (the first followed iterations time each op: see retime)
        out = self._retimer.call(i, func, args, kwargs) if self._timing else func(*args, **kwargs)
        if views_only:  # (views of the arguments: no new storage, nothing to check)
            outs = _NO_OUTS
        else:
            outs = []
            same = True  # the results have the trace's sizes so far
            for t in (out,) if out.__class__ is Tensor else _leaves(out):
                if getattr(t, dev) is not True:
                    continue
                try:
                    st = t.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                e = entries.get(st._cdata)
                if e is None:  # a new storage
                    e = table.new_entry(st, st._cdata, self._op_labels[i])
                elif e.ref() is None:  # (a new storage at the address of one that died in the op)
                    e = entry(t, self._op_labels[i])
                k = len(outs)
                if same and (k >= len(sizes) or (sizes[k] != e.nbytes and self._size_departs(e, sizes[k]))):
                    same = False
                outs.append(e)
            if spots:  # (most ops write no argument; in place ones write one, ``self``)
                k0 = len(outs)
                v = args[spots[0][0]] if len(spots) == 1 and spots[0][0] < len(args) else None
                if (v.__class__ is Tensor or v.__class__ is Parameter) and getattr(v, dev) is True:
                    e = entries.get(_storage_id(v))
                    if e is None or e.ref() is None:
                        e = entry(v, self._op_labels[i])
                    outs.append(e)
                    if e.state is RESIDENT and e.ref().nbytes() != e.nbytes:  # (resized by the op)
                        table.resized(e)
                else:
                    written = _written_at(spots, args, kwargs)
                    if written:
                        self._account_written(written, outs, self._op_labels[i])
                for k in range(k0, len(outs)):  # (the trace's results include what it wrote)
                    if k >= len(sizes) or (sizes[k] != outs[k].nbytes and self._size_departs(outs[k], sizes[k])):
                        same = False
            if not same or len(outs) != len(sizes):
                self._check_outs(i, outs)  # (a departure: it says how)
            elif bind_out is not None:
                self._bind(i, bind_out, outs)
        if levers and not self._stale:
            t0 = time.perf_counter() if self._timing else 0.0
            if chains:
                rc.record(i, func, args, kwargs, out, states)
            if rc.drops[i]:
                rc.drop(i)
            if self._timing:  # (what recompute costs forward: see retime)
                self._retimer.add_record_s(time.perf_counter() - t0)
        if self._hinted:  # a reactive plan's pager evicts least recently used first
            # (the op's inputs: a result enters the LRU order at its end when it is bound)
            table.touch(ins)
        if ledger.used > ledger.peak:
            table.note_peak()
        if moves and not self._stale:
            self._follower.fire(self._actions, i, self._hinted)
        self._op = next_op  # [host steps] (i + 1, past ops the host runs)
        return out

    def _account_written(self, written: list[torch.Tensor], outs: list[_Entry], label: str) -> int:
        """Add the storages an op wrote in place (``out=``, ``self``) to ``outs``, and
        account those the op resized. The bytes it grew them by."""
        grown = 0
        table = self._storages
        for t in written:
            e = table.entry(t, label)
            if e is None:
                continue
            outs.append(e)
            if e.home is not None:  # [host steps] a host-stepped parameter's master copy is stale now
                e.synced = False
            st = e.ref()
            if st is not None and e.state == RESIDENT and st.nbytes() != e.nbytes:  # resized by the op
                grown += table.resized(e)
        return grown

    @property
    def _in_step(self) -> bool:
        """Whether ``optimizer.step()`` is running (its nesting: ``StepNesting``)."""
        return self._step_nesting.in_step

    def _phase(self) -> str:
        return "optimizer" if self._step_nesting.in_step else "forward"

    def _times_kernels(self) -> bool:
        """Whether a profiled iteration times its ops by their kernels (CUDA)."""
        return self._cuda

    def _ran_eager_under_compile(self) -> None:
        """An op of a ``torch.compile``'d model or function reached the mode: Dynamo ran
        that code eagerly (it compiles nothing while a dispatch mode like ours is on the
        stack). Counted, and said once per run: the user asked for compiled code."""
        st = self.stats
        st.compiled_ops_run_eager += 1
        if st.compiled_ops_run_eager == 1:
            warnings.warn("tierflow.offload: torch.compile'd code ran eagerly under the runtime (Dynamo compiles "
                          "nothing while the runtime's dispatch mode is active); "
                          "run.stats.compiled_ops_run_eager counts its ops", RuntimeWarning, stacklevel=2)

    @contextlib.contextmanager
    def _own_ops(self) -> Iterator[None]:
        """Ops issued inside are the runtime's own (a hook labelling a gradient, a fetch
        for the unpack hook, a host step's copies, a state dict's copy): the dispatch
        mode runs them as they are, neither counted nor planned. The one place that
        says so (``_quiet``), so that a hook that raises cannot leave it set."""
        prior, self._quiet = self._quiet, True
        try:
            yield
        finally:
            self._quiet = prior

    @contextlib.contextmanager
    def untracked(self) -> Iterator[None]:
        """Run ops outside the iteration's bookkeeping: tensors they read are brought to
        the device as usual, but they are not counted as ops of the iteration and their
        results are not accounted against the budget. For what GPU code would copy to
        the host (logging, checkpoints, checks); in CPU mode their results stand for
        those host copies.

        Example:
            >>> # with tierflow.offload(model, opt, budget="50%") as run:
            >>> #     ...; loss.backward()
            >>> #     with run.untracked():
            >>> #         norms = [p.grad.norm() for p in model.parameters()]
        """
        # (following at ticks the dispatch mode is off the stack: it comes back for the
        # block, so that what the ops read is brought back first; runtime/hook_follow.py)
        hooked = self._hook is not None and self._hook.off_mode and self._untracked == 0
        if hooked:
            self._mode.__enter__()
        self._untracked += 1
        try:
            yield
        finally:
            self._untracked -= 1
            if hooked:
                self._mode.__exit__(None, None, None)

    @property
    def tier_usage(self) -> dict[str, int]:
        """Bytes in use right now: ``device`` (accounted), ``host`` (pool slots),
        ``ssd`` (file slots), ``bounce`` (SSD staging)."""
        return {"device": self._ledger.used, **self._tiers.usage()}

    @property
    def device_bytes(self) -> int:
        """Bytes the runtime accounts as resident on the device right now."""
        return self._ledger.used


def offload(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    budget: str | int | float | None = None,
    policy: PolicyArg = "tierflow",
    ssd_dir: str | os.PathLike | None = None,
    **options: Any,
) -> Run:
    """Train ``model`` within a device memory budget, unchanged::

        with tierflow.offload(model, optimizer, budget="20GiB") as run:
            for x, y in data:
                loss = loss_fn(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        print(run.stats.step_time_s, run.stats.peak_device_bytes)

    The first iteration is profiled on the real device (in the reactive mode, so it
    already respects the budget), a policy plans from its trace, and every later
    iteration follows the plan. An iteration runs from the model's first forward call to
    ``optimizer.step()`` returning (gradient accumulation: several forwards, one step).
    If the optimizer has no state yet (Adam's first step creates it), that first
    iteration is a warm-up and the second is profiled.

    Args:
        model: the module, on ``cpu`` or ``cuda``.
        optimizer: its optimizer (``None``: call ``run.end_iteration()`` after each step).
        budget: device bytes the run may use: a size (``"20GiB"``, ``4_000_000``) or a
            share of the profiled iteration's unconstrained peak (``"30%"``, ``0.3``; the
            rules are :mod:`tierflow.budget`'s, shared with the compiled front-end; the profile
            iteration then runs unconstrained). ``None``: no limit (the plan only moves
            what the policy wants moved). A budget below the minimum working set raises
            :class:`BudgetError` before the first optimizer step.
        policy: a name from :func:`tierflow.policies.policy_names`, or a callable
            ``(trace, hardware, budget_bytes) -> Plan``.
        ssd_dir: directory for the SSD tier's file (none: no SSD tier; plans that name
            one send those moves to host and count ``tier_fallbacks``).
        hardware: the machine the planner and simulator assume: a preset or
            :class:`Hardware` (CUDA default: ``h100-80g-pcie5-nvme`` with the real
            device's capacity; CPU default: RAM as device and host with the measured
            copy bandwidth, an NVMe-class SSD).
        host_bytes: a fixed size for the (pinned, on CUDA) host pool, allocated up
            front and never grown. Default: the pool starts empty, grows by chunks as
            evictions need room and, after planning, to what the plan keeps on the host,
            up to the host memory available when the block opens less 10% (the host
            capacity the planner is told). Pinned memory is not swappable: too much
            starves the host.
        ssd_bytes: a fixed size for the SSD file, allocated up front. Default: it starts
            at four times the model state plus the budget (capped at four times the
            model state) plus 16 MiB and grows as needed, up to the disk's free space
            less 10%.
        io_workers: SSD I/O threads (2: enough to keep one NVMe busy from Python).
        policy_options: extra options for the policy (``lookahead`` for deepum, ...).
        sync_ranks: under ``torch.distributed`` with more than one rank (DDP, FSDP2:
            each rank opens its own ``offload``), plan from one trace on every rank and
            check that the plans agree (see :mod:`tierflow.runtime.distributed`);
            ``False``: each rank plans alone, and the runtime calls no collective.
        host_step_overlap: for plans that step the optimizer on the host: start a
            parameter's update as soon as backward has made its gradient, overlapped with
            the rest of backward (``True``), or when ``optimizer.step()`` runs
            (``False``: for loops that change gradients after ``backward()`` on some steps
            only, which an update already under way would miss; see
            :mod:`tierflow.runtime.host_step`).
        host_steps: may the plan update parameters with the optimizer on the host (it
            frees their optimizer state's device memory and overlaps backward)? The
            host's optimizer kernels are not the GPU's and can round differently, so on
            CUDA the parameters they update can differ from plain PyTorch's in their last
            bits (and later steps' losses with them). ``None`` (default): on CPU yes
            (the same kernels: bitwise equal); on CUDA only for a policy whose method is
            host updates (``zero_offload``, ``zero_infinity``), not for ``tierflow``'s
            own choice. ``True``: tierflow may choose them on CUDA too. ``False``: none;
            a policy that plans them anyway (the ZeRO peers) falls back to the reactive
            pager, and ``stats.plan_error`` says why. CLI: ``tierflow train --host-steps``.
        follow: how a planned iteration is followed. ``"ops"`` (default): every aten op
            through the runtime's dispatch mode. ``"hooks"``: the plan is made from the
            trace coarsened to the points where PyTorch calls hooks (module forward
            hooks, saved-tensor pack/unpack, gradient accumulation) and followed there,
            with no dispatch mode through forward and backward: far less Python per op
            (what a GPU's host needs), moves a little coarser. Plans with recompute or
            host steps, and runs with collectives, are followed op by op
            (``stats.follow`` says which and why). See :mod:`tierflow.runtime.hook_follow`.
        max_plans: plans kept, one per iteration *signature* (the shapes and dtypes of
            what the loop feeds the model at an iteration's first forward; like
            ``torch.compile``'s recompile limit), least recently used out. A bucketing
            loader's lengths are each profiled and planned once and followed from then
            on; shapes that never repeat run on the pager, within the budget, once the
            last plans made were never followed (:mod:`tierflow.runtime.signatures`).

    Inside the block the loop may also validate (a forward under ``torch.no_grad()`` or
    ``torch.inference_mode()``, with or without ``model.eval()``: it runs within the
    budget and the plan stays in force), log, and save or load checkpoints (a state dict
    never holds a tensor the plan has away: :mod:`tierflow.runtime.outside`).

    Returns:
        A :class:`Run`; use it as a context manager.

    Raises:
        BudgetError: the budget is below the minimum working set.
        SSDError: the SSD file cannot be created (filesystem full) or I/O failed.
        OffloadError: ``follow`` or ``max_plans`` is not one the runtime knows; the host
            pool is full and there is no SSD to spill to; raised at
            planning (after the profiled step) where the plan needs more host memory
            than the pool may hold.
        RankMismatchError: (an ``OffloadError``) the ranks profiled different iterations
            or made different plans; raised on every rank.

    Example:
        >>> import torch, tierflow
        >>> net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> with tierflow.offload(net, opt, budget="60%", policy="lru") as run:
        ...     for _ in range(3):
        ...         net(torch.ones(8, 32)).sum().backward(); opt.step(); opt.zero_grad()
        >>> run.stats.steps
        3
    """
    return Run(model, optimizer, budget, policy, ssd_dir, **options)


__all__ = ["Run", "RunStats", "offload"]
