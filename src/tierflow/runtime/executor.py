"""Execute a plan in real PyTorch training: ``with tierflow.offload(model, opt, budget=...)``.

How it works, in one paragraph. While the ``with`` block is open, a light
``TorchDispatchMode`` sees every aten op. The first iteration (from the model's first
forward to ``optimizer.step()`` returning) is *profiled*: each op is recorded with the
storages it reads and writes, exactly as :mod:`tierflow.capture` records a trace, and
timed on the real device. The trace goes to a policy, the plan comes back, and every
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
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from ..errors import PlanError, PolicyError, TierflowError
from ..hardware import Compute, Hardware, Link, Tier, load_hardware
from ..plan import Plan, validate
from ..trace import Op, TensorInfo, Trace
from ..units import fmt_bytes, parse_bytes
from .errors import BudgetError, OffloadError, SSDError
from .streams import Copier
from .tiers import HostPool, SSDStore

RESIDENT, AWAY, INCOMING = "resident", "away", "incoming"
OWNED = ("parameter", "gradient", "optimizer_state", "activation")
_RANK = {"parameter": 0, "optimizer_state": 1, "gradient": 2, "input": 3, "activation": 4, "temporary": 5}
PolicyArg = str | Callable[[Trace, Hardware, float], Plan]


@dataclass(eq=False)
class _Entry:
    """One storage the runtime has seen (never a strong reference to it)."""

    cdata: int
    nbytes: int
    ref: Any  # weakref.ref to the UntypedStorage; its callback reports the death
    kind: str = "temporary"
    key: str | None = None
    name: str = ""
    resizable: bool = True
    state: str = RESIDENT
    tier: str | None = None
    slot: int = -1  # offset in the host pool or the SSD file while away
    bounce: int = -1  # SSD: bounce slot holding the bytes (write in flight, or read landed)
    io: Any = None  # SSD: the Future of the write or read in flight
    arrival: Any = None  # CUDA: event of the copy that brought it back
    pins: int = 0  # collectives in flight that read or write it: not to be moved
    touched: bool = False  # an op used it after the collective that pinned it
    foreign: bool = False  # resized by someone else (FSDP's unsharded parameters): never moved
    top: int = 0  # largest size seen (a foreign storage's size changes under us)

    @property
    def persistent(self) -> bool:
        return self.kind in ("parameter", "optimizer_state")

    @property
    def label(self) -> str:
        return self.key or self.name or f"storage {self.cdata:#x}"


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
        moved_bytes: bytes copied per tier, both directions (``host``, ``ssd``).
        transfers: bytes per direction (``device->host``, ``ssd->device``, ...).
        moves_by_kind: count of evictions per ``(tensor kind, tier)``, as ``"kind@tier"``.
        stalls: on-demand fetches (a tensor was away when an op needed it).
        stall_s: host time spent waiting for them.
        planned_moves: plan moves executed; skipped_moves: plan moves with nothing to do
            (a tensor the runtime cannot identify or move, or already where asked).
        unplanned_evictions: evictions the budget forced beyond the plan.
        tier_fallbacks: moves sent to host because the plan's tier is missing or full.
        planned_slots: evictions placed at the offset the pool planner laid out for
            them in the host pool or SSD file (the rest took the first free slot: a move
            the plan did not make, or a slot still held by a late tensor).
        stale_plans: iterations that departed from the trace; replans: plans made.
        stale_reasons: the first few departures, in words.
        plan_error: why the current plan failed :func:`tierflow.plan.validate`, if it did
            (it is executed anyway: what it gets wrong is fetched on demand).
        predicted_step_time_s: the simulator's step time for the current plan.
        ideal_step_time_s: the trace's sum of op times (no transfers).
        policy: the policy that made the current plan.
        host_pool_bytes, ssd_file_bytes: the tiers' pre-allocated sizes.
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
    moved_bytes: dict[str, int] = field(default_factory=lambda: {"host": 0, "ssd": 0})
    transfers: dict[str, int] = field(default_factory=dict)
    moves_by_kind: dict[str, int] = field(default_factory=dict)
    stalls: int = 0
    stall_s: float = 0.0
    planned_moves: int = 0
    skipped_moves: int = 0
    unplanned_evictions: int = 0
    tier_fallbacks: int = 0
    planned_slots: int = 0
    stale_plans: int = 0
    replans: int = 0
    stale_reasons: list[str] = field(default_factory=list)
    predicted_step_time_s: float | None = None
    plan_error: str | None = None
    ideal_step_time_s: float | None = None
    policy: str = ""
    host_pool_bytes: int = 0
    ssd_file_bytes: int = 0
    host_pool_peak: int = 0
    rank: int = 0
    world_size: int = 1
    plan_digest: str | None = None
    collectives: int = 0
    busy_refusals: int = 0
    foreign_storages: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["step_times_s"] = list(self.step_times_s)
        return d


def _budget_spec(budget: str | int | float | None) -> tuple[float | None, float | None]:
    """``(bytes, share)``: one of them set, or both None for no budget."""
    if budget is None:
        return None, None
    if isinstance(budget, str) and budget.strip().endswith("%"):
        try:
            share = float(budget.strip()[:-1]) / 100
        except ValueError:
            raise PolicyError(f"budget {budget!r}: not a percentage") from None
        if not 0 < share:
            raise PolicyError(f"budget {budget!r}: must be positive")
        return None, share
    try:
        return float(parse_bytes(budget)), None
    except ValueError as e:
        raise PolicyError(f"budget: {e}") from None


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_COMM_NS = ("c10d::", "_c10d_functional::", "c10d_functional::")
_MANAGED_NS = ("fsdp::",)  # FSDP2's copy-in/copy-out ops: what they write, FSDP resizes


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds ``t``'s bytes: ``t`` itself, or for a wrapper subclass
    with one inner tensor (a DTensor: its local shard) that tensor."""
    while type(t) not in _PLAIN and is_traceable_wrapper_subclass(t):
        inner = _inner(t)
        if len(inner) != 1:
            break
        t = inner[0]
    return t


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a wrapper subclass flattens to (a DTensor also names its mesh)."""
    attrs, _ = t.__tensor_flatten__()
    return [x for x in (getattr(t, a) for a in attrs) if isinstance(x, torch.Tensor)]


def _unwrap(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensor subclasses replaced by the plain tensors inside them (all of them)."""
    out: list[torch.Tensor] = []
    stack = list(reversed(ts))
    while stack:
        t = stack.pop()
        if type(t) not in _PLAIN and is_traceable_wrapper_subclass(t):
            stack += reversed(_inner(t))
        else:
            out.append(t)
    return out


def _storage_bytes(t: torch.Tensor) -> int:
    return _plain(t).untyped_storage().nbytes()


def _works(out: Any) -> list[Any]:
    """The ``Work`` handles a c10d op returned (its completion frees what it pinned)."""
    found = []
    for x in pytree.tree_leaves(out):
        if isinstance(x, torch.ScriptObject):
            try:
                found.append(torch._C._distributed_c10d.Work.unbox(x))
            except (AttributeError, RuntimeError, TypeError):
                pass
    return found


_KIND: dict[Any, int] = {}  # op -> 0 plain, 1 collective, 2 FSDP-managed copy


def _op_kind(func, name: str) -> int:
    k = _KIND.get(func)
    if k is None:
        k = _KIND[func] = 1 if name.startswith(_COMM_NS) else 2 if name.startswith(_MANAGED_NS) else 0
    return k


def _u8(st: torch.UntypedStorage, n: int) -> torch.Tensor:
    """A flat byte view of a whole storage (shares it; no autograd, own version counter)."""
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (n,), (1,))


_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}
_NAMES: dict[Any, str] = {}


def _op_name(func) -> str:
    name = _NAMES.get(func)
    if name is None:
        name = _NAMES[func] = func._schema.name
    return name


def _written_args(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensor arguments the op writes (in-place ``self``, ``out=``), from its schema
    (positions cached per op: this runs for every op)."""
    spots = _WRITES.get(func)
    if spots is None:
        spots = _WRITES[func] = tuple(
            (i, a.name) for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        )
    if not spots:
        return []
    out: list[torch.Tensor] = []
    for i, name in spots:
        v = args[i] if i < len(args) else kwargs.get(name)
        out += _leaves(v)
    return out


def _leaves(obj: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or result (tensors, and lists/tuples of them: all
    that aten schemas allow), faster than a general pytree walk."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        out: list[torch.Tensor] = []
        for x in obj:
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif isinstance(x, (list, tuple)):
                out += [y for y in x if isinstance(y, torch.Tensor)]
        return out
    if isinstance(obj, dict):
        return _leaves(list(obj.values()))
    return []


class _Mode(TorchDispatchMode):
    def __init__(self, run: Run):
        super().__init__()
        self.run = run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.run._on_op(func, args, kwargs or {}, types)


def _measure_copy_bw(device: torch.device) -> float:
    """Bytes/s of one 16 MiB device-to-host copy (the CPU-mode "link")."""
    n = 16 << 20
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty(n, dtype=torch.uint8)
    b.copy_(a)
    t0 = time.perf_counter()
    for _ in range(3):
        b.copy_(a)
    return 3 * n / max(time.perf_counter() - t0, 1e-9)


class Run:
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
    ):
        self.model, self.optimizer = model, optimizer
        p = next(model.parameters(), None)
        self.device = p.device if p is not None else torch.device("cpu")
        if self.device.type not in ("cpu", "cuda"):
            raise OffloadError(f"offload: the model is on {self.device}; expected cpu or cuda")
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
        self._sync: Any = None  # a distributed.RankSync while the block is open, with >1 ranks
        self._copy_bw: float | None = None  # agreed by the ranks before planning
        self.stats = RunStats(budget_bytes=self.budget)
        self.trace: Trace | None = None
        self.prediction: Any = None  # SimResult of the plan being followed
        self._layout: dict[tuple[int, int, str], int] = {}  # planned pool/file offsets
        self.plan: Plan | None = None
        self.hardware: Hardware | None = None
        self._open = False

    # == lifecycle ==========================================================================
    def __enter__(self) -> Run:
        model_bytes = sum(_storage_bytes(t) for t in self._state_tensors())
        # Default pool sizes: weights, gradients and two Adam moments, plus the budget's
        # worth of activations. Enough for every plan whose host tier fits these sizes (the
        # planner is told them); pass host_bytes/ssd_bytes to trade memory for spilling.
        default = 4 * model_bytes + int(min(self.budget, 4 * model_bytes)) + (16 << 20)
        host = parse_bytes(self._host_bytes) if self._host_bytes is not None else default
        self._host = HostPool(host, pin=self.device.type == "cuda")
        self._ssd: SSDStore | None = None
        if self._ssd_dir is not None:
            cap = parse_bytes(self._ssd_bytes) if self._ssd_bytes is not None else default
            self._ssd = SSDStore(self._ssd_dir, cap, bounce_bytes=min(max(cap // 4, 16 << 20), 256 << 20),
                                 workers=self._io_workers)
        self.stats.host_pool_bytes = self._host.capacity
        self.stats.ssd_file_bytes = self._ssd.capacity if self._ssd else 0
        self._copier = Copier(self.device)
        self._entries: dict[int, _Entry] = {}
        self._lru: OrderedDict[int, _Entry] = OrderedDict()  # resident, owned, by last use
        self._by_key: dict[str, _Entry] = {}
        self._dead: deque[int] = deque()
        self._frees: deque[tuple[Any, Any, int, int]] = deque()  # (event, arena, off, n)
        self._writes: list[_Entry] = []
        self._pending: deque[_Entry] = deque()  # planned prefetches waiting for room
        self._device_bytes = 0
        self._quiet = False
        self._untracked = 0
        self._dev_attr = "is_cuda" if self.device.type == "cuda" else "is_cpu"
        self._in_iter = False
        self._recording = self._planned = self._hinted = False
        self._iter_peak = 0
        self._need_profile = True
        self._iters_begun = 0
        self._inflight: list[tuple[list[Any], list[_Entry], list[_Entry]]] = []  # (Works, pinned, written)
        self._foreign: dict[int, _Entry] = {}
        from .distributed import RankSync, world

        self.stats.rank, self.stats.world_size = world()
        if self._sync_ranks and self.stats.world_size > 1:
            self._sync = RankSync()
        self._max_out = 0
        self._step_kinds: list[str] = []
        self._in_step = False
        self._names = {id(p): n for n, p in self.model.named_parameters()}
        for n, p in self.model.named_parameters():
            self._label(self._entry(p), "parameter", f"param:{n}", n)
        for n, b in self.model.named_buffers():
            self._label(self._entry(b), "parameter", f"buffer:{n}", n)
        self._label_opt_state()
        self._hooks = [self.model.register_forward_pre_hook(self._on_forward, prepend=True)]
        for n, p in self.model.named_parameters():
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad(n)))
        if self.optimizer is not None:
            self._hooks.append(self.optimizer.register_step_pre_hook(self._on_step_pre))
            self._hooks.append(self.optimizer.register_step_post_hook(lambda *a: self.end_iteration()))
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
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
        errors: list[str] = []
        try:
            self._saved.__exit__(None, None, None)
            self._mode.__exit__(None, None, None)
            for h in self._hooks:
                h.remove()
            # bring everything home: the model and optimizer are whole again after the block
            for e in list(self._entries.values()):
                if e.state != RESIDENT:
                    try:
                        self._fetch(e)
                    except TierflowError as err:
                        errors.append(str(err))
            self._drain_writes(raise_errors=False)
            self._copier.drain()
            self._reap()
            if self.device.type == "cuda":
                self.stats.cuda_max_allocated = int(torch.cuda.max_memory_allocated(self.device))
        finally:
            if self._sync is not None:
                self._sync.close()
                self._sync = None
            self.stats.host_pool_peak = self._host.arena.peak
            self._host.close()
            if self._ssd is not None:
                self._ssd.close()
            self._entries.clear()
            self._lru.clear()
            self._by_key.clear()
            self._inflight.clear()
            self._foreign.clear()
        if errors and exc is None:
            raise SSDError("offload: could not bring every tensor back: " + "; ".join(errors[:3]))

    # == iterations ========================================================================
    def _on_forward(self, module, args):
        # a forward inside untracked() (evaluation) begins no iteration: otherwise the
        # data loading after it would become the first op of a planned iteration
        if self._untracked:
            return
        if not self._in_iter:
            self._quiet = True
            try:
                self._begin()
                for i, x in enumerate(t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)):
                    e = self._entry(x)
                    if e is not None and e.kind == "temporary":
                        self._label(e, "input", f"input:{i}", f"input{i}")
            finally:
                self._quiet = False

    def _begin(self) -> None:
        self._in_iter = True
        self._op = 0
        self._saved_seq = 0
        self._iter_tid: dict[int, int] = {}
        self._iter_entries: list[_Entry] = []
        self._recording = self._need_profile or self.plan is None
        self._planned = not self._recording and self.plan is not None and not self.plan.reactive
        self._hinted = not self._recording and self.plan is not None and self.plan.reactive
        self._stale = False
        # (an optimizer still without state after one step keeps none: SGD without momentum)
        self._warmup = self.optimizer is not None and not any(self.optimizer.state.values()) and self._iters_begun == 0
        # DDP rebuilds its gradient buckets in its second forward (other ops, other
        # tensors): profile after that
        if getattr(self.model, "_has_rebuilt_buckets", None) is False and self._iters_begun < 2:
            self._warmup = True
        self._iters_begun += 1
        self._rec: list[tuple[str, str, float, list[int], list[int]]] = []
        self._sigs: list[tuple] = []
        if self._planned:  # persistent tensors the plan starts the iteration without
            for key, tier in self._start_away.items():
                e = self._by_key.get(key)
                if e is not None and e.state == RESIDENT and self._evict(e, tier):
                    self.stats.planned_moves += 1
        self._iter_peak = self._device_bytes
        self._budgeted = math.isfinite(self.budget)
        self._t0 = time.perf_counter()

    def end_iteration(self) -> None:
        """Mark the end of an iteration. Called for you when ``optimizer.step()`` returns;
        call it yourself only when training without an optimizer."""
        if not self._in_iter:
            return
        self._label_opt_state()
        self._in_iter = False
        self._in_step = False
        self.stats.foreign_storages = sum(1 for e in self._foreign.values() if e.ref() is not None)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # once per step, for the step time
        dt = time.perf_counter() - self._t0
        st = self.stats
        st.steps += 1
        st.step_times_s.append(dt)
        if self._budgeted or (self._budget_bytes is None and self._budget_share is None):
            st.peak_device_bytes = max(st.peak_device_bytes, self._iter_peak)
        else:  # a share budget: the profile iteration that measured the peak ran without one
            st.peak_device_bytes_unconstrained = max(st.peak_device_bytes_unconstrained, self._iter_peak)
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
                self._need_profile = True
        if self._recording:
            st.profiled_steps += 1
            self._quiet = True  # planning allocates (a bandwidth probe): not the user's ops
            try:
                trace = self._build_trace()
                if want:
                    if self._sync is not None:
                        trace = self._agree_trace(trace)
                    self._make_plan(trace)
                    if self._sync is not None:
                        self._sync.check_same(
                            "made different plans", self.stats.plan_digest or "",
                            f" from the same trace with policy {self.stats.policy!r}: the policy is not a pure "
                            "function of the trace and hardware (a wall-clock limit?); pass sync_ranks=False "
                            "to let each rank follow its own plan")
                    self._need_profile = False
            finally:
                self._quiet = False
        elif (self._planned or self._hinted) and not self._stale:
            st.planned_steps += 1
            st.peak_device_bytes_planned = max(st.peak_device_bytes_planned, self._iter_peak)
        else:
            st.reactive_steps += 1
        if self._stale:
            self._need_profile = True
        self._step_kinds.append("planned" if ((self._planned or self._hinted) and not self._stale) else "other")
        planned = [t for t, k in zip(st.step_times_s, self._step_kinds) if k == "planned"]
        st.step_time_s = sum(planned) / len(planned) if planned else sum(st.step_times_s) / len(st.step_times_s)
        self._iter_tid, self._iter_entries = {}, []

    # == the op handler ====================================================================
    def _on_op(self, func, args, kwargs, types=()):
        if self._quiet:
            return func(*args, **kwargs)
        self._quiet = True  # our own copies and resizes below are not the user's ops
        try:
            return self._handle(func, args, kwargs, types)
        finally:
            self._quiet = False

    def _handle(self, func, args, kwargs, types=()):
        if self._dead or self._frees or self._writes or self._inflight:
            self._reap()
        if self._pending:
            self._issue_pending()
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
            return func(*args, **kwargs)
        name = _op_name(func)
        special = _op_kind(func, name)
        if special == 2 and self._foreign:  # FSDP has just re-allocated what this op fills
            self._sync_foreign()
        ins = [e for e in (self._entry(t) for t in tensors) if e is not None]
        in_iter = self._in_iter
        i = self._op if in_iter else -1
        sig = None
        if in_iter and (self._recording or self._planned):
            sig = (name, tuple((tuple(t.shape), t.dtype) for t in tensors))
            if self._planned and not self._stale and (i >= len(self._trace_sigs) or self._trace_sigs[i] != sig):
                want = self._trace_sigs[i][0] if i < len(self._trace_sigs) else "the end of the iteration"
                self._mark_stale(f"op {i}: ran {sig[0]} {[s for s, _ in sig[1]]}, the trace has {want}")
        expect = self._born[i] if (in_iter and self._planned and not self._stale) else self._max_out
        away = sum(e.nbytes for e in ins if e.state != RESIDENT)
        self._make_room(away + expect, ins)
        for e in ins:
            self._ensure_resident(e)
            if e.pins and not special:
                e.touched = True
        t0 = time.perf_counter() if self._recording else 0.0
        out = func(*args, **kwargs)
        dur = time.perf_counter() - t0 if self._recording else 0.0
        label = f"{name}#{i}"
        leaves = _leaves(out)
        outs = [e for e in (self._entry(t, label) for t in (_unwrap(leaves) if types else leaves)) if e is not None]
        new_bytes = 0
        written = _written_args(func, args, kwargs)
        n_fresh = len(outs)
        for t in (_unwrap(written) if types else written):
            e = self._entry(t, label)
            if e is None:
                continue
            outs.append(e)
            st = e.ref()
            if st is not None and e.state == RESIDENT and st.nbytes() != e.nbytes:  # resized by the op
                self._device_bytes += st.nbytes() - e.nbytes
                new_bytes += max(0, st.nbytes() - e.nbytes)
                e.top = max(e.top, e.nbytes)
                e.nbytes = st.nbytes()
        if special:
            self._on_special(special, out, ins, outs, outs[n_fresh:])
        for e in ins + outs:
            if e.cdata in self._lru:
                self._lru.move_to_end(e.cdata)
        if in_iter:
            n_before = len(self._iter_entries)
            in_ids = [self._tid(e) for e in ins]
            out_ids = [self._tid(e) for e in outs]
            new_bytes += sum(e.nbytes for e in self._iter_entries[n_before:] if e.kind not in ("parameter",))
            self._max_out = max(self._max_out, new_bytes)
            if self._recording:
                phase = "backward" if torch._C._current_graph_task_id() != -1 else self._phase()
                self._rec.append((name, phase, dur, list(dict.fromkeys(in_ids)), list(dict.fromkeys(out_ids))))
                self._sigs.append(sig)
            elif self._planned and not self._stale:
                for tid in range(n_before, len(self._iter_entries)):
                    want = self._trace_keys[tid] if tid < len(self._trace_keys) else None
                    got = self._iter_entries[tid]
                    if want is not None and want.split(":")[0] in ("param", "buffer", "opt") and want != got.key:
                        self._mark_stale(f"op {i}: tensor {tid} is {got.label}, the trace has {want}")
                        break
        self._note_peak()
        if in_iter:
            if self._planned and not self._stale:
                self._fire(i)
            elif self._hinted:
                self._fire(i, hints=True)
            self._op += 1
        return out

    def _on_special(self, kind: int, out: Any, ins: list[_Entry], outs: list[_Entry], wrote: list[_Entry]) -> None:
        """After a collective (``kind`` 1): every storage it reads or writes is pinned
        until its ``Work`` completes (a gloo thread or an NCCL kernel still uses the
        bytes after the op returns; no ``Work``: pinned for the storage's life). After
        one of FSDP2's copy ops (``kind`` 2): what it wrote is FSDP's to resize, never
        ours to move."""
        if kind == 1:
            self.stats.collectives += 1
            ents = list({e.cdata: e for e in ins + outs}.values())
            for e in ents:
                e.pins += 1
                e.touched = False
            works = _works(out)
            if works:
                self._inflight.append((works, ents, wrote))
        else:
            for e in wrote:
                self._make_foreign(e)

    def _unpin(self, e: _Entry) -> bool:
        """Try to free ``e`` of the collectives that pinned it: those that completed
        have; if the program used ``e`` since (a program waits on a collective before
        it uses the result), wait on them too: that returns at once. Whether ``e`` is
        free now."""
        self._inflight = [r for r in self._inflight
                          if not self._release(r, force=e.touched and any(x is e for x in r[1]))]
        return e.pins == 0

    def _make_foreign(self, e: _Entry) -> None:
        """``e`` is resized by someone else (FSDP frees and re-allocates its unsharded
        parameters with ``untyped_storage().resize_``): never move it, keep its size."""
        if e.foreign:
            return
        e.foreign, e.resizable = True, False
        self._lru.pop(e.cdata, None)
        self._foreign[e.cdata] = e

    def _sync_foreign(self) -> None:
        """Account foreign storages at the size their owner left them (looked at when
        the budget or the peak is in question: a storage FSDP grows again is then
        written by an op, which accounts it)."""
        for e in list(self._foreign.values()):
            st = e.ref()
            if st is None:
                continue
            n = st.nbytes()
            if n != e.nbytes and e.state == RESIDENT:
                self._device_bytes += n - e.nbytes
                e.top = max(e.top, e.nbytes, n)
                e.nbytes = n

    def _phase(self) -> str:
        return "optimizer" if getattr(self, "_in_step", False) else "forward"

    def _note_peak(self) -> None:
        if self._device_bytes > self._iter_peak:
            if self._foreign:  # (FSDP may have freed some since: count them as they are)
                self._sync_foreign()
            self._iter_peak = max(self._iter_peak, self._device_bytes)

    # == storages ==========================================================================
    def _entry(self, t: torch.Tensor, produced_by: str | None = None) -> _Entry | None:
        """The entry of ``t``'s storage (made on first sight), or None if it is not on the
        device or has no storage."""
        if getattr(t, self._dev_attr) is not True:  # is_cpu / is_cuda: cheaper than t.device
            return None
        if type(t) not in _PLAIN:
            t = _plain(t)
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        cdata = st._cdata
        e = self._entries.get(cdata)
        if e is not None and e.ref() is None:  # a storage died and a new one took its address
            self._retire(e)
            e = None
        if e is None:
            n = int(st.nbytes())
            e = _Entry(cdata, n, weakref.ref(st, lambda _r, c=cdata: self._dead.append(c)),
                       name=produced_by or "<pre-existing>", resizable=bool(st.resizable()))
            self._entries[cdata] = e
            self._device_bytes += n
        return e

    def _label(self, e: _Entry | None, kind: str, key: str, name: str) -> None:
        if e is None or (e.key is not None and _RANK[kind] >= _RANK[e.kind]):
            return
        e.kind, e.key, e.name = kind, key, name
        if e.persistent:
            self._by_key[key] = e
        if kind in OWNED and e.state == RESIDENT and e.resizable:
            self._lru[e.cdata] = e

    def _label_opt_state(self) -> None:
        if self.optimizer is None:
            return
        for p, state in self.optimizer.state.items():
            pn = self._names.get(id(p), f"<param {id(p):x}>")
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    self._label(self._entry(v), "optimizer_state", f"opt:{pn}:{k}", f"{pn}.{k}")

    def _on_grad(self, name: str):
        def hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                q, self._quiet = self._quiet, True
                try:
                    self._label(self._entry(p.grad), "gradient", f"grad:{name}", f"{name}.grad")
                finally:
                    self._quiet = q
        return hook

    def _tid(self, e: _Entry) -> int:
        tid = self._iter_tid.get(e.cdata)
        if tid is None:
            tid = self._iter_tid[e.cdata] = len(self._iter_entries)
            self._iter_entries.append(e)
        return tid

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        q, self._quiet = self._quiet, True
        try:
            if self._in_iter:
                seq = self._saved_seq
                self._saved_seq += 1
                e = self._entry(t, f"saved{seq}")
                if e is not None and e.kind == "temporary":
                    self._label(e, "activation", f"saved:{seq}", f"saved{seq}")
            return t.detach()  # not t: that would tie the graph and its output in a cycle
        finally:
            self._quiet = q

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        p = _plain(t) if type(t) not in _PLAIN else t
        e = self._entries.get(p.untyped_storage()._cdata) if p.device.type == self.device.type else None
        if e is not None and (e.state != RESIDENT or e.arrival is not None):
            q, self._quiet = self._quiet, True
            try:
                self._make_room(e.nbytes if e.state != RESIDENT else 0, [e])
                self._ensure_resident(e)
                self._note_peak()
            finally:
                self._quiet = q
        return t

    # == moves =============================================================================
    def _fire(self, op: int, hints: bool = False) -> None:
        assert self.plan is not None and self.trace is not None
        for m in self.plan.by_op.get(op, ()):
            info = self.trace.tensors[m.tensor]
            if info.persistent:
                e = self._by_key.get(info.key or "")
            else:
                e = self._iter_entries[m.tensor] if m.tensor < len(self._iter_entries) else None
            if e is None or e.ref() is None or e.kind not in OWNED or not e.resizable:
                self.stats.skipped_moves += 1
                continue
            if m.kind == "evict":
                rt = self._tier_of(m.tier)
                done = self._evict(e, rt, self._layout.get((m.tensor, op + 1, rt)))
            elif e.state == RESIDENT or e in self._pending:
                done = False
            elif hints:  # a UVM-style prefetch hint makes room, like a fault
                self._make_room(e.nbytes, [])
                done = self._prefetch(e)
            else:  # a planned prefetch never evicts: it waits for room (as simulated)
                self._pending.append(e)
                continue
            if done:
                self.stats.planned_moves += 1
            else:
                self.stats.skipped_moves += 1
        self._issue_pending()

    def _issue_pending(self) -> None:
        """Start queued planned prefetches, in order, while they fit the budget."""
        while self._pending:
            e = self._pending[0]
            if e.ref() is None or e.state != AWAY:
                self._pending.popleft()
                continue
            if self._device_bytes + e.nbytes > self.budget:
                return
            self._pending.popleft()
            if self._prefetch(e):
                self.stats.planned_moves += 1

    def _plan_layout(self, trace: Trace, plan: Any, hw: Any) -> dict[tuple[int, int, str], int]:
        """Offsets in the host pool and the SSD file for every stay a planned plan puts
        there, laid out ahead of time by the pool planner (``tierflow.pool``, greedy: it
        is fast and deterministic) so that the pool's layout follows the plan's
        lifetimes instead of the order moves happen to arrive in. Keyed by (tensor,
        first op of the stay, runtime tier). A reactive plan has no planned residency."""
        if plan.reactive:
            return {}
        from ..pool import from_trace, solve

        arenas = {"host": self._host.arena}
        if self._ssd is not None:
            arenas["ssd"] = self._ssd.arena
        layout: dict[tuple[int, int, str], int] = {}
        for tier in hw.offload_tiers:
            rt = self._tier_of(tier)
            if rt not in arenas:
                continue
            try:
                problem = from_trace(trace, plan, hw, tier=tier, alignment=arenas[rt].align)
            except TierflowError:
                continue  # a plan the walk rejects: its moves take first-fit slots
            if not problem.buffers:
                continue
            sol = solve(problem, "greedy")
            for b, off in zip(problem.buffers, sol.offsets.tolist()):
                layout[(int(b.id.split(".")[0]), b.lower, rt)] = int(off)
        return layout

    def _tier_of(self, name: str | None) -> str:
        """The runtime tier (``host`` or ``ssd``) for a plan's tier name."""
        if name is None or self.hardware is None or not self.hardware.has_tier(name):
            return "host"
        return "ssd" if self.hardware.tier(name).kind == "ssd" else "host"

    def _make_room(self, need: int, keep: list[_Entry]) -> None:
        """Evict least recently used owned tensors (not those in ``keep``) until ``need``
        more bytes fit the budget."""
        if self._device_bytes + need <= self.budget:
            return
        if self._foreign:  # storages FSDP freed still count at their old size until looked at
            self._sync_foreign()
            if self._device_bytes + need <= self.budget:
                return
        if self._in_step:  # state the optimizer created in this step is evictable too
            self._label_opt_state()
        pinned = {e.cdata for e in keep}
        for e in self._victims(pinned):
            if self._device_bytes + need <= self.budget:
                break
            if self._evict(e, "host"):
                self.stats.unplanned_evictions += 1

    def _victims(self, pinned: set[int]) -> list[_Entry]:
        """Owned resident tensors in eviction order: following a plan, the one the trace
        uses furthest in the future first (Belady); otherwise least recently used first."""
        cands = [e for c, e in self._lru.items() if c not in pinned]
        if not (self._in_iter and self._planned and not self._stale):
            return cands
        trace, now, n = self.trace, self._op, self.trace.n_ops

        def next_use(e: _Entry) -> float:
            tid = self._key_tid.get(e.key) if e.persistent else self._iter_tid.get(e.cdata)
            if tid is None:
                return math.inf
            uses = trace.uses(tid)
            j = int(np.searchsorted(uses, now, side="right"))
            if j < len(uses):
                return float(uses[j])
            return float(uses[0] + n) if e.persistent else math.inf

        return sorted(cands, key=next_use, reverse=True)

    def _evict(self, e: _Entry, tier: str, slot: int | None = None) -> bool:
        st = e.ref()
        if st is None or e.state != RESIDENT or not e.resizable or e.nbytes == 0:
            return False
        if e.pins and not self._unpin(e):
            self.stats.busy_refusals += 1
            return False
        if st.nbytes() != e.nbytes:  # resized behind our back: its owner manages it
            self._make_foreign(e)
            self._sync_foreign()
            return False
        n = e.nbytes
        if tier == "ssd" and self._ssd is None:
            tier = "host"
            self.stats.tier_fallbacks += 1
        if tier == "host":
            off = self._host.arena.alloc_at(slot, n) if slot is not None else None
            if off is not None:
                self.stats.planned_slots += 1
            else:
                off = self._host.arena.alloc(n)
            if off is None:
                self._reap(wait=True)
                off = self._host.arena.alloc(n)
            if off is None:
                if self._ssd is None:
                    raise OffloadError(
                        f"host pool full: {e.label} needs {fmt_bytes(n)}, {fmt_bytes(self._host.arena.free)} free "
                        f"of {fmt_bytes(self._host.capacity)} (pass a larger host_bytes, or an ssd_dir to spill to)"
                    )
                tier = "ssd"
                self.stats.tier_fallbacks += 1
        if e.arrival is not None:  # it is still arriving: the copy out must follow the copy in
            self._copier.wait(e.arrival)
            e.arrival = None
        src = _u8(st, n)
        if tier == "host":
            self._copier.copy(self._host.view(off, n), src, src)
            e.slot = off
        else:
            assert self._ssd is not None
            foff = self._ssd.alloc_file(n, e.label, at=slot)
            if slot is not None and foff == slot:
                self.stats.planned_slots += 1
            boff = self._bounce_alloc(n)
            ev = self._copier.copy(self._ssd.bounce_view(boff, n), src, src)
            before = (lambda ev=ev: ev.synchronize()) if ev is not None else None
            e.slot, e.bounce = foff, boff
            e.io = self._ssd.submit(True, boff, foff, n, before)
            self._writes.append(e)
        del src
        st.resize_(0)
        e.state, e.tier = AWAY, tier
        self._device_bytes -= n
        self._lru.pop(e.cdata, None)
        self._count(f"device->{tier}", tier, n)
        k = f"{e.kind}@{tier}"
        self.stats.moves_by_kind[k] = self.stats.moves_by_kind.get(k, 0) + 1
        return True

    def _bounce_alloc(self, n: int) -> int:
        assert self._ssd is not None
        off = self._ssd.bounce.alloc(n)
        while off is None and self._writes:
            self._finish_write(self._writes[0], wait=True)
            off = self._ssd.bounce.alloc(n)
        if off is None:
            self._reap(wait=True)
            off = self._ssd.bounce.alloc(n)
        if off is None:
            raise OffloadError(
                f"SSD bounce buffer too small for a {fmt_bytes(n)} tensor ({fmt_bytes(self._ssd.bounce.capacity)}); "
                "pass a larger ssd_bytes"
            )
        return off

    def _prefetch(self, e: _Entry) -> bool:
        """Start bringing ``e`` back; an SSD read proceeds in the background."""
        if e.state != AWAY:
            return False
        if e.tier == "ssd" and e.bounce < 0:
            assert self._ssd is not None
            boff = self._bounce_alloc(e.nbytes)
            e.bounce = boff
            e.io = self._ssd.submit(False, boff, e.slot, e.nbytes)
            e.state = INCOMING
            return True
        self._fetch(e)
        return True

    def _ensure_resident(self, e: _Entry) -> None:
        if e.state != RESIDENT:
            # an SSD read that already landed in its bounce slot is a prefetch that worked
            landed = e.state == INCOMING and e.io is not None and e.io.done()
            t0 = time.perf_counter()
            self._fetch(e)
            if not landed:
                self.stats.stalls += 1
                self.stats.stall_s += time.perf_counter() - t0
        if e.arrival is not None:
            self._copier.wait(e.arrival)
            e.arrival = None

    def _fetch(self, e: _Entry) -> None:
        """Bring ``e`` back to the device now (an SSD read in flight is waited for)."""
        st = e.ref()
        n = e.nbytes
        if st is None:
            return
        if st.nbytes() != 0:  # its owner grew it again while it was away: the bytes are theirs now
            self._drop_away(e, st)
            return
        if e.tier == "host":
            st.resize_(n)
            dst = _u8(st, n)
            ev = self._copier.copy(dst, self._host.view(e.slot, n), dst)
            self._frees.append((ev, self._host.arena, e.slot, n))
        else:
            assert self._ssd is not None
            if e.state == AWAY and e.bounce >= 0:  # the write may be in flight: its bounce has the bytes
                self._finish_write(e, wait=True, keep_bounce=True)
            elif e.state == AWAY:
                e.bounce = self._bounce_alloc(n)
                e.io = self._ssd.submit(False, e.bounce, e.slot, n)
            if e.io is not None:  # a read
                try:
                    e.io.result()
                except OSError as err:
                    e.io = None
                    self._ssd.bounce.release(e.bounce, n)
                    e.bounce, e.state = -1, AWAY
                    raise SSDError(f"SSD read of {e.label} ({fmt_bytes(n)}) from {self._ssd.path} failed: "
                                   f"{err.strerror or err}; it stays in the file") from None
                e.io = None
            st.resize_(n)
            dst = _u8(st, n)
            ev = self._copier.copy(dst, self._ssd.bounce_view(e.bounce, n), dst)
            self._frees.append((ev, self._ssd.bounce, e.bounce, n))
            self._ssd.arena.release(e.slot, n)
            e.bounce = -1
        e.arrival = ev
        e.state, e.slot = RESIDENT, -1
        tier, e.tier = e.tier, None
        self._device_bytes += n
        self._count(f"{tier}->device", tier or "host", n)
        if e.kind in OWNED:
            self._lru[e.cdata] = e

    def _drop_away(self, e: _Entry, st: torch.UntypedStorage) -> None:
        """Forget the copy of an away storage that someone else re-allocated (and will
        fill): give back its slots, account it resident, never move it again."""
        self._give_back_slots(e)
        e.state, e.tier, e.slot, e.bounce = RESIDENT, None, -1, -1
        e.nbytes = int(st.nbytes())
        self._device_bytes += e.nbytes
        self._make_foreign(e)

    def _finish_write(self, e: _Entry, wait: bool = False, keep_bounce: bool = False) -> None:
        """Retire an SSD write: release its bounce slot, or on failure put the tensor back
        on the device from the bounce copy and raise :class:`SSDError`."""
        assert self._ssd is not None
        if e.io is None or (not wait and not e.io.done()):
            return
        try:
            e.io.result()
            err = None
        except OSError as x:
            err = x
        if e in self._writes:
            self._writes.remove(e)
        e.io = None
        if err is None:
            if not keep_bounce:
                self._ssd.bounce.release(e.bounce, e.nbytes)
                e.bounce = -1
            return
        # the write failed: nothing is lost, the bytes are still in the bounce slot
        n = e.nbytes
        self._ssd.arena.release(e.slot, n)
        st = e.ref()
        if st is not None:
            st.resize_(n)
            _u8(st, n).copy_(self._ssd.bounce_view(e.bounce, n))
            self._device_bytes += n
            if e.kind in OWNED:
                self._lru[e.cdata] = e
        self._ssd.bounce.release(e.bounce, n)
        e.bounce, e.slot, e.state, e.tier = -1, -1, RESIDENT, None
        raise SSDError(
            f"SSD write of {e.label} ({fmt_bytes(n)}) to {self._ssd.path} failed: {err.strerror or err}; "
            "it was restored to the device, model and optimizer state are intact"
        )

    def _drain_writes(self, raise_errors: bool = True) -> None:
        while self._writes:
            try:
                self._finish_write(self._writes[0], wait=True)
            except SSDError:
                if raise_errors:
                    raise

    def _count(self, direction: str, tier: str, n: int) -> None:
        st = self.stats
        st.transfers[direction] = st.transfers.get(direction, 0) + n
        st.moved_bytes[tier] = st.moved_bytes.get(tier, 0) + n

    def _reap(self, wait: bool = False) -> None:
        """Retire what finished: dead storages, completed copies (slots freed), SSD
        writes (bounce freed; a failed one raises). ``wait``: block on copies in flight."""
        while self._dead:
            e = self._entries.get(self._dead.popleft())
            if e is not None and e.ref() is None:  # (alive: the address holds a new storage)
                self._retire(e)
        if self._inflight:
            self._inflight = [r for r in self._inflight if not self._release(r)]
        while self._frees and (wait or Copier.done(self._frees[0][0])):
            ev, arena, off, n = self._frees.popleft()
            Copier.synchronize(ev)
            arena.release(off, n)
        for e in list(self._writes):
            self._finish_write(e, wait=wait)
        # SSD reads that completed stay in their bounce slot until the tensor is first used:
        # landing them earlier would spend device bytes the plan has not made room for

    def _give_back_slots(self, e: _Entry) -> None:
        """Give back what an away storage holds outside the device: its SSD write is
        waited for first (its bytes are being dropped, so an error no longer matters),
        then its bounce slot and its host or SSD slot."""
        if e.io is not None:
            try:
                e.io.result()
            except OSError:
                pass
            if e in self._writes:
                self._writes.remove(e)
            e.io = None
        if e.bounce >= 0 and self._ssd is not None:
            self._ssd.bounce.release(e.bounce, e.nbytes)
        if e.tier == "host":
            self._host.arena.release(e.slot, e.nbytes)
        elif self._ssd is not None:
            self._ssd.arena.release(e.slot, e.nbytes)

    def _retire(self, e: _Entry) -> None:
        """Forget a storage that died (its device bytes, or its slots while away)."""
        if self._entries.get(e.cdata) is not e:
            return
        del self._entries[e.cdata]
        self._lru.pop(e.cdata, None)
        self._iter_tid.pop(e.cdata, None) if self._in_iter else None
        if self._foreign.get(e.cdata) is e:
            del self._foreign[e.cdata]
        if e.state == RESIDENT:
            self._device_bytes -= e.nbytes
        else:  # died while away: give its slots back
            self._give_back_slots(e)
        if e.key and self._by_key.get(e.key) is e:
            del self._by_key[e.key]

    def _release(self, rec: tuple[list[Any], list[_Entry], list[_Entry]], force: bool = False) -> bool:
        """Unpin what an in-flight collective pinned, if it is over: its ``Work`` says
        it completed, or the program used a storage the collective writes (a program
        waits on a collective before it uses the result; gloo's reduce-scatter never
        says it completed), or ``force``: then wait on it (at once when it is done).
        Whether it was released."""
        works, ents, wrote = rec
        if not all(w.is_completed() for w in works):
            if not (force or any(x.touched for x in wrote)):
                return False
            for w in works:
                w.wait()
        for x in ents:
            x.pins -= 1
        return True

    # == stale plans, profiling, planning ==================================================
    def _mark_stale(self, why: str) -> None:
        self._stale = True
        self.stats.stale_plans += 1
        if len(self.stats.stale_reasons) < 5:
            self.stats.stale_reasons.append(why)

    def _on_step_pre(self, optimizer, args, kwargs) -> None:
        self._in_step = True
        if self._in_iter and self._recording and self._budget_bytes is not None:
            self._check_working_set()

    def _check_working_set(self) -> None:
        """Refuse, before the first optimizer step changes anything, a budget below what
        one op of forward/backward needs, or what the update of one parameter needs."""
        sizes = [e.nbytes for e in self._iter_entries]
        worst, where = 0, ""
        for j, (name, _ph, _d, ins, outs) in enumerate(self._rec):
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

    def _build_trace(self) -> Trace:
        ops = [Op(name, phase, max(0.0, d), tuple(ins), tuple(outs)) for name, phase, d, ins, outs in self._rec]
        tensors = []
        for i, e in enumerate(self._iter_entries):
            kind = e.kind
            if kind == "temporary" and e.name == "<pre-existing>" and e.ref() is not None:
                kind = "parameter"  # held across iterations outside any op: model state
            tensors.append(TensorInfo(i, int(max(e.nbytes, e.top)), kind, kind in ("parameter", "optimizer_state"),
                                      e.name, e.key))
        trace = Trace(ops, tensors, name=f"{type(self.model).__name__}@{self.device.type}",
                      meta={"source": "tierflow.runtime", "device": str(self.device), "timing": "measured"})
        self._trace_sigs_next = list(self._sigs)
        return trace

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
        if self.device.type == "cpu" and self._hardware_arg is None:
            self._copy_bw = sync.min(_measure_copy_bw(self.device))
        ops = tuple(replace(o, duration_s=d) for o, d in zip(trace.ops, slowest))
        return Trace(ops, trace.tensors, name=trace.name,
                     meta=dict(trace.meta, timing=f"measured, slowest of {sync.world_size} ranks"))

    def _hardware_for(self, trace: Trace) -> Hardware:
        if self.device.type == "cuda":
            base = load_hardware(self._hardware_arg or "h100-80g-pcie5-nvme")
            cap = float(torch.cuda.get_device_properties(self.device).total_memory)
            hw = base.with_tier(base.device, capacity=cap)
            host = next((t.name for t in hw.tiers if t.kind == "host"), None)
            if host is not None:
                hw = hw.with_tier(host, capacity=float(self._host.capacity))
            for t in hw.tiers:
                if t.kind == "ssd":
                    hw = hw.with_tier(t.name, capacity=float(self._ssd.capacity if self._ssd else 0))
            return hw
        if self._hardware_arg is not None:
            return load_hardware(self._hardware_arg)
        bw = self._copy_bw if self._copy_bw is not None else _measure_copy_bw(self.device)
        total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        if self._sync is not None:
            total = self._sync.min(total)
        tiers = [Tier("device", "device", max(total, self.budget if math.isfinite(self.budget) else 0)),
                 Tier("host", "host", float(self._host.capacity))]
        links = [Link("device->host", "device", "host", bw), Link("host->device", "host", "device", bw)]
        if self._ssd is not None:
            # NVMe-class rates; the runtime's own transfers are what stats report
            tiers.append(Tier("ssd", "ssd", float(self._ssd.capacity), read_bw=2e9, write_bw=1e9, latency_s=1e-4))
            links += [Link("device->ssd", "device", "ssd", bw), Link("ssd->device", "ssd", "device", bw)]
        return Hardware("cpu-runtime", "device", tuple(tiers), tuple(links), Compute(1e11, 1e11, 2e10),
                        description="CPU mode: device and host are both RAM, the budget accounted")

    def _make_plan(self, trace: Trace) -> None:
        from ..policies import make_plan, min_working_set
        from ..simulate import simulate

        hw = self._hardware_for(trace)
        self.stats.plan_error = None
        if self._budget_share is not None:
            self.budget = self._budget_share * trace.peak_live_bytes
            self.stats.budget_bytes = self.budget
        need, op = min_working_set(trace)
        if need > self.budget:
            raise BudgetError(
                f"budget {fmt_bytes(self.budget)} ({int(self.budget)} bytes) is below the minimum working set: "
                f"op {op} ({trace.ops[op].name}) alone needs {fmt_bytes(need)} ({need} bytes)"
            )
        budget = self.budget if math.isfinite(self.budget) else None
        arg = self._policy_arg
        if callable(arg):
            plan = arg(trace, hw, self.budget)
        else:
            name = arg
            options = dict(self._policy_options)
            if name == "tierflow":
                # this executor follows moves only: until it runs recompute chains and
                # host optimizer steps (issue 14's runtime side), tierflow plans moves
                options.setdefault("levers", "move")
            try:
                plan = make_plan(name, trace, hw, budget=budget, **options)
            except PlanError as e:
                # The policy cannot plan for this budget (the budget itself is above the
                # minimum working set: checked above). Training goes on with the reactive
                # pager, which needs no plan; stats.plan_error says why.
                plan = Plan(policy=f"lru (fallback from {name})", budget_bytes=self.budget, reactive=True)
                self.stats.plan_error = str(e)
        self._start_away: dict[str, str] = {}
        if not plan.reactive:
            try:
                residency = validate(plan, trace, hw)
            except PlanError as e:
                # A policy bug, not a reason to stop training: the executor fetches whatever
                # a plan gets wrong on demand and keeps the budget by itself. Say so.
                self.stats.plan_error = str(e)
            else:
                for tid, tier in residency.start_tier.items():
                    key = trace.tensors[tid].key
                    if tier != hw.device and key:
                        self._start_away[key] = self._tier_of(tier)
        try:
            sim = simulate(trace, hw, plan, check_plan=False)
            self.stats.predicted_step_time_s = sim.time_s if math.isfinite(sim.time_s) else None
            self.prediction = sim  # the simulator's view of the plan, for reports
        except TierflowError:
            self.stats.predicted_step_time_s = None
            self.prediction = None
        self.stats.ideal_step_time_s = trace.ideal_s
        self.stats.policy = plan.policy
        from .distributed import plan_digest

        self.stats.plan_digest = plan_digest(plan)
        self.stats.replans += 1
        self.trace, self.plan, self.hardware = trace, plan, hw
        self._layout = self._plan_layout(trace, plan, hw)
        self._trace_sigs = self._trace_sigs_next
        self._trace_keys = [t.key for t in trace.tensors]
        self._key_tid = {t.key: t.id for t in trace.tensors if t.persistent and t.key}
        self._pending.clear()
        born = [0] * (trace.n_ops + 1)
        for t in trace.tensors:
            if not t.persistent:
                born[int(trace.birth[t.id])] += t.bytes
        self._born = born

    def _state_tensors(self) -> list[torch.Tensor]:
        out = list(self.model.parameters()) + list(self.model.buffers())
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return out

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
        self._untracked += 1
        try:
            yield
        finally:
            self._untracked -= 1

    @property
    def tier_usage(self) -> dict[str, int]:
        """Bytes in use right now: ``device`` (accounted), ``host`` (pool slots),
        ``ssd`` (file slots), ``bounce`` (SSD staging)."""
        out = {"device": self._device_bytes, "host": self._host.arena.used}
        if self._ssd is not None:
            out["ssd"], out["bounce"] = self._ssd.arena.used, self._ssd.bounce.used
        return out

    @property
    def device_bytes(self) -> int:
        """Bytes the runtime accounts as resident on the device right now."""
        return self._device_bytes


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
            share of the profiled iteration's unconstrained peak (``"30%"``; the profile
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
        host_bytes: the pinned host pool's size (default four times the model state
            plus the budget, bounded by eight times the model state, plus 16 MiB).
            Pinned memory is not swappable: too much starves the host.
        ssd_bytes: the SSD file's size (same default), allocated up front.
        io_workers: SSD I/O threads (2: enough to keep one NVMe busy from Python).
        policy_options: extra options for the policy (``lookahead`` for deepum, ...).
        sync_ranks: under ``torch.distributed`` with more than one rank (DDP, FSDP2:
            each rank opens its own ``offload``), plan from one trace on every rank and
            check that the plans agree (see :mod:`tierflow.runtime.distributed`);
            ``False``: each rank plans alone, and the runtime calls no collective.

    Returns:
        A :class:`Run`; use it as a context manager.

    Raises:
        BudgetError: the budget is below the minimum working set.
        SSDError: the SSD file cannot be created (filesystem full) or I/O failed.
        OffloadError: the host pool is full and there is no SSD to spill to.
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
