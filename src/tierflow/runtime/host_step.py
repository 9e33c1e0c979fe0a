"""Host-side optimizer steps: executing a plan's :class:`~tierflow.plan.HostStep` records.

What the contract asks (see :class:`tierflow.plan.HostStep`): for a host-stepped
parameter the optimizer state lives on the host for good, the gradient goes to the
host as soon as the last backward op that writes it ends (and leaves the device), the
update runs on the host, and the updated parameter is back on the device before its
next use. ZeRO-Offload does this with its own optimizer (DeepSpeed's
``DeepSpeedCPUAdam`` over its own fp32 partitions, ``deepspeed/runtime/zero/
stage_1_and_2.py``); torchao's ``CPUOffloadOptimizer`` (pytorch/ao
``torchao/optim/cpu_offload.py``) replaces the user's optimizer by one optimizer per
parameter over host copies, so its ``state_dict()`` has another layout and its
``param_groups`` are one per parameter (an LR scheduler sees as many groups). Here the
user's optimizer object stays the one they made:

* **The state** of a host-stepped parameter is moved, at the moment the plan is
  adopted, into host tensors that replace the tensors in ``optimizer.state[p]`` (the
  same per-parameter dict object): ``state_dict()`` returns them (host tensors on CUDA),
  ``load_state_dict()`` puts device tensors back, which the next update finds and moves
  to the host again; when the ``offload`` block closes (or the run profiles again) the
  state goes back to the device. In CPU mode the host tensors are the runtime's own
  storages, never counted in the device budget.
* **The gradient** is copied into a host buffer by a post-accumulate-grad hook (on
  CUDA, a copy on the side stream after the backward kernel that made it), and its
  device storage is shrunk to nothing: the gradient tensor stays a valid object, away
  in its *home* (tier ``"home"`` of the entry), and code that reads ``p.grad`` later
  (clipping, logging) fetches it back as any away tensor.
* **The update** runs the optimizer's own step function (the class's ``step`` without
  the hooks ``Optimizer`` wraps it in) on a shallow proxy of the user's optimizer whose
  only param group is a copy of ``p``'s group holding the parameter's host master copy
  (its ``.grad`` the host gradient buffer) and whose ``state`` maps that master copy to
  the user's own state dict for ``p``. The same code (``foreach``/``fused`` as the group
  says) on the same values: in CPU mode the result is bitwise that of plain PyTorch;
  on CUDA it is the CPU kernel, equal to the CUDA one up to floating-point rounding of
  the update's arithmetic (a few ulp per step for Adam; tests state the tolerance).
  Updates run one after another on one worker thread, overlapped with the rest of
  backward and with the device-side step (which leaves the host-stepped parameters
  out: :class:`~tierflow.runtime.optim_chunks.ChunkedStep` ``skip``).
* **The parameter**'s device bytes are obsolete once its update is under way: they are
  dropped (the storage shrinks to nothing, like an eviction without a copy) and its
  home becomes the master copy. ``optimizer.step()`` waits for every update before it
  returns and copies the parameters the plan holds on the device at the start of an
  iteration back there (the others come back by the plan's prefetch or on demand,
  which waits for the update first). Waiting in ``step()`` rather than at the next
  forward costs little overlap and keeps what a training loop reads after
  ``step()`` — parameters, ``state_dict()``, a scheduler's view — exactly as without
  tierflow.

When a gradient leaves and its update starts. The gradient leaves at its hook if the
iteration follows its trace and the trace has no device op using the gradient after
that point (a loop that clips or unscales gradients after ``backward()`` has such ops:
its gradients leave and its updates start when ``optimizer.step()`` ends, as the loop
left them); otherwise when the step ends. The update starts with it unless the trace
also reads the parameter after that point (a loop that logs or averages weights before
``step()``): then at the step, the parameter fetched back for the read meanwhile (from
its master copy, not yet updated) and dropped again when its update starts.

Why an update begun in backward is exact. An update reads the gradient, the parameter,
its optimizer state and its group's settings, and writes the last three. When it
begins at the hook: the gradient's last write is done (the hook fires after the last
accumulation, and the trace says no later device op touches it); the trace has no
later device op reading the parameter either, whose bytes are in its master copy and
whose device storage is dropped (a read the trace did not foresee fetches it back,
which waits for the update, and is reported at the step); its state is read by no one
but this update before ``step()`` returns, which waits for every update. The update is the optimizer's own code on the same values, so beginning
it earlier changes when it runs, not what it computes. The trace describes the
iteration it profiled, not this one, so what the trace cannot promise (a gradient or a
setting changed between ``backward()`` and ``step()``) is checked when the step ends. With ``offload(..., host_step_overlap=False)``
gradients still leave at their hook, and an update starts when the step ends (a
gradient changed after it left is sent again). Under ``torch.distributed`` everything
waits for the step (DDP reduces gradients after their hooks). An iteration that
departs from its trace takes back the updates still queued. One that changes a
gradient after backward although its profile did not (clipping on some steps only)
after that gradient's update began cannot be made right, nor one that reads a
parameter before ``step()`` although its profile did not (the update has already
changed it): ``optimizer.step()`` raises :class:`~tierflow.runtime.OffloadError`
saying so (``host_step_overlap=False`` is the remedy); gradients accumulated over more backward passes than the profile had raise
it at the extra pass. A parameter whose master
copy may be stale (an op wrote the parameter on the device since its last update, e.g.
a checkpoint restored into the model) is copied to the host before its update.

The user's step hooks (the runtime's own, which end the iteration, among them) run
once per ``optimizer.step()`` on the caller's thread: the proxy a host update runs on
has none (a subclass whose ``step`` calls ``super().step()`` reaches the parent
class's wrapped step, which would run them for each update, on the worker).

Limits: parameters and gradients must own their storage whole (a view into a larger
buffer cannot be shrunk alone): a plan whose host steps name such a parameter is
followed without its host steps (``run.stats.plan_error`` says why). Group settings are
read when each update starts: a setting changed between ``backward()`` and
``optimizer.step()`` (an LR scheduler stepped before the optimizer) after some updates
began raises :class:`~tierflow.runtime.OffloadError` at the step, as a gradient changed
then does, and ``state_dict()``/``load_state_dict()`` called between ``backward()``
and ``step()`` once updates began raises at the call (the state is half updated)
(``host_step_overlap=False`` is the remedy for each). ``capturable`` optimizers cannot run on the host.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ..plan import Plan
from ..trace import Trace
from .errors import OffloadError
from .storages import _PLAIN, AWAY, RESIDENT, _Entry, _plain, _u8, _written_args
from .streams import Copier


@dataclass(eq=False)
class _HostParam:
    """One host-stepped parameter and its host buffers."""

    name: str
    param: torch.nn.Parameter
    last_op: int  # its gradient's last device op in the trace: sent after it
    last_read: int  # ... and the parameter's: its update starts in backward only after both
    master: torch.Tensor  # the parameter's master copy on the host
    grad_buf: torch.Tensor  # its gradient's buffer on the host
    moved: dict[str, torch.device] = field(default_factory=dict)  # state keys moved to the host: from where
    held: list[torch.Tensor] = field(default_factory=list)  # its host state (keeps the ids in _host_held valid)
    future: Future | None = None  # the update in flight
    read: Any = None  # CUDA: event of the copy back to the device reading the master copy
    sent: bool = False  # its gradient went to the host in this iteration
    started: bool = False  # its update started in this iteration
    early: bool = False  # ... by its gradient's hook, in backward
    peeked: bool = False  # read, in a departed iteration, after its update began in backward
    grad_entry: _Entry | None = None  # the gradient sent (to its home)
    events: list = field(default_factory=list)  # CUDA: copies the update must wait for
    settings: dict | None = None  # its group's settings (lr, ...) its update started with

    @property
    def nbytes(self) -> int:
        return self.master.numel() * self.master.element_size()


def _settings(group: dict) -> dict:
    """A param group's settings (``lr``, ``betas``, ``weight_decay``...), copied: what an
    update started with, to compare with what the group says when the step runs."""
    out = {}
    for k, v in group.items():
        if k == "params":
            continue
        if isinstance(v, torch.Tensor):  # (a tensor lr: its value, not the object)
            with torch._C._DisableTorchDispatch():
                v = v.detach().clone()
        out[k] = v
    return out


def _same_settings(a: dict, group: dict) -> bool:
    """Whether ``group`` still has the settings ``a`` (from :func:`_settings`)."""
    if a.keys() != group.keys() - {"params"}:
        return False
    for k, v in a.items():
        w = group[k]
        if isinstance(v, torch.Tensor) or isinstance(w, torch.Tensor):
            if not (isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor)):
                return False
            with torch._C._DisableTorchDispatch():
                if not torch.equal(v, w.detach().to(v.device)):
                    return False
        elif v != w:
            return False
    return True


def _raw_step(optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
    """The optimizer class's own ``step``, without the wrapper ``Optimizer`` puts around
    it to run step hooks (the runtime's hooks end the iteration: they must run once per
    ``optimizer.step()``, not once per host update)."""
    fn = type(optimizer).step
    if getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _proxy(optimizer: torch.optim.Optimizer, group: dict, master: torch.Tensor, state: dict) -> Any:
    """A shallow stand-in for ``optimizer`` whose only group steps ``master`` with the
    user's state dict (the same object: what the update writes is the user's)."""
    proxy = object.__new__(type(optimizer))
    proxy.__dict__.update(optimizer.__dict__)
    g = dict(group)
    g["params"] = [master]
    proxy.param_groups = [g]
    proxy.state = {master: state}
    # the user's step hooks (the runtime's among them, which end the iteration) run once
    # per optimizer.step(), on the caller's thread: not again for each host update, which
    # a subclass whose step calls super().step() would do (the parent's step is wrapped
    # by Optimizer to run them)
    proxy._optimizer_step_pre_hooks = OrderedDict()
    proxy._optimizer_step_post_hooks = OrderedDict()
    return proxy


def _update(step: Callable[..., Any], proxy: Any, events: list[Any]) -> float:
    """The host update (on the worker thread): wait for the copies it reads, run the
    optimizer's step on the proxy. Its seconds."""
    for ev in events:
        Copier.synchronize(ev)
    t0 = time.perf_counter()
    step(proxy)
    return time.perf_counter() - t0


def _whole(t: torch.Tensor, nbytes: int | None = None) -> bool:
    """Whether ``t`` is its storage, whole (what a host step can shrink and restore);
    ``nbytes``: the storage's size when it is away (its storage has none then)."""
    n = t.untyped_storage().nbytes() if nbytes is None else nbytes
    return t.is_contiguous() and t.storage_offset() == 0 and n == t.numel() * t.element_size()


def _key_name(key: str | None) -> str | None:
    """The parameter a runtime key names (``param:N``, ``grad:N``, ``opt:N:KEY``)."""
    if not key:
        return None
    kind, _, rest = key.partition(":")
    if kind in ("param", "grad"):
        return rest
    if kind == "opt":
        return rest.rsplit(":", 1)[0]
    return None


def update_groups(trace: Trace) -> list[tuple[list[int], set[str]]]:
    """The optimizer ops of ``trace`` in units of work, each with the parameters it
    updates (by name): ops sharing a tensor are one unit; an op without tensors joins
    the unit of the next op with some (a step counter kept on the CPU, read with
    ``.item()``), a profiler range's op excepted (it stays on the device); units that touch only a parameter's optimizer state (its step counter
    on the device, in CPU mode) join the unit of that parameter. What the runtime runs
    on the host for a set of parameters is the units whose parameters all are in it:
    the whole of their update, counter included, as the optimizer's step does it."""
    ops = trace.ops
    opt = [i for i, o in enumerate(ops) if o.phase == "optimizer"]
    links: list[tuple[int, int]] = []
    nxt = None
    for i in reversed(opt):
        if len(trace.op_tensors[i]):
            nxt = i
        elif nxt is not None and not ops[i].name.startswith("profiler::"):
            links.append((i, nxt))  # (a profiler range, as a subclass's super().step() opens, is no update's)
    tensors = trace.tensors
    units = {unit[0]: unit for unit in trace.op_groups(opt, links)}
    named: dict[int, set[str]] = {}
    for root, unit in units.items():
        names = set()
        for i in unit:
            for t in trace.op_tensors[i]:
                nm = _key_name(tensors[t].key)
                if nm is not None:
                    names.add(nm)
        named[root] = names
    # a unit of state alone (no parameter, no gradient) joins its parameter's unit
    owner: dict[str, int] = {}
    for root, unit in units.items():
        for i in unit:
            for t in trace.op_tensors[i]:
                key = tensors[t].key or ""
                if key.startswith(("param:", "grad:")):
                    owner.setdefault(_key_name(key), root)
    joined = False
    for root, unit in units.items():
        keys = [tensors[t].key or "" for i in unit for t in trace.op_tensors[i]]
        if keys and all(k.startswith("opt:") for k in keys if k) and not any(
                k.startswith(("param:", "grad:")) for k in keys):
            homes = {owner.get(n) for n in named[root]}
            if len(homes) == 1 and None not in homes:
                links.append((root, homes.pop()))
                joined = True
    groups = trace.op_groups(opt, links) if joined else list(units.values())
    root_of = {i: root for root, unit in units.items() for i in unit}
    return [(g, set().union(*(named[r] for r in {root_of[i] for i in g}))) for g in groups]


def follow_past_host_ops(n_ops: int, host_ops: frozenset[int], actions: list) -> tuple[list[int], list]:
    """The follower's op order and move table for a plan whose ops ``host_ops`` run on
    the host: after each op, the next op the device runs (``Run._next_op``), and the
    moves the plan issues after a host op issued after the device op before it
    (``actions``, one tuple of moves per op, is not changed: a new table is returned).

    Example:
        >>> follow_past_host_ops(4, frozenset({1, 2}), [(), ("a",), ("b",), ()])
        ([3, 3, 3, 4], [('a', 'b'), (), (), ()])
    """
    nxt = list(range(1, n_ops + 1))
    following = n_ops
    for i in range(n_ops - 1, -1, -1):
        nxt[i] = following
        if i not in host_ops:
            following = i
    moved = list(actions)
    prev = -1
    for i in range(n_ops):
        if i not in host_ops:
            prev = i
        elif moved[i] and prev >= 0:
            moved[prev] = tuple(moved[prev]) + tuple(moved[i])
            moved[i] = ()
    return nxt, moved


class HostSteps:
    """Host-side optimizer steps (a mixin of :class:`~tierflow.runtime.executor.Run`)."""

    _host_active = False
    _host_held: frozenset[int] | set[int] = frozenset()  # ids of state tensors kept on the host

    def _host_init(self) -> None:
        self._host_params: list[_HostParam] = []
        self._host_by_cdata: dict[int, _HostParam] = {}  # parameter storage -> its host step
        self._host_held = set()
        self._host_hooks: list[Any] = []
        self._host_worker: ThreadPoolExecutor | None = None
        self._host_active = False
        self._host_groups_seen: list | None = None
        self._host_groups_list: list = []
        self._host_group_of: dict[int, dict] = {}
        # under torch.distributed a gradient is final only when the step begins (DDP
        # reduces its buckets after the hooks): every update starts when the step ends
        self._host_late = self.stats.world_size > 1
        self._host_overlap = getattr(self, "_host_overlap", True)

    # -- adopting a plan ---------------------------------------------------------------

    def _host_adopt(self, trace: Trace, plan: Plan) -> tuple[str | None, frozenset[int]]:
        """Take up ``plan``'s host steps: host buffers, state to the host, hooks, the
        device step's skip set. Returns why they are not executed (None if they are: a
        plan whose host steps cannot be, a parameter that is not its storage whole or
        not found, is followed without them; the caller reports it, ``stats.plan_error``)
        and the trace's ops the host runs (the caller's follower skips them:
        :func:`follow_past_host_ops`)."""
        self._host_release()
        self.stats.host_stepped_params = 0
        if not plan.host_steps or plan.reactive or self.optimizer is None:
            return None, frozenset()
        named = dict(self.model.named_parameters())
        wanted: dict[str, tuple[int, int]] = {}  # parameter name -> its gradient's and its tensor ids
        for h in plan.host_steps:
            key = trace.tensors[h.param].key or ""
            name = key[len("param:"):] if key.startswith("param:") else None
            p = named.get(name) if name is not None else None
            why = None
            if p is None:
                why = f"tensor {h.param} ({key or 'no key'}) is not a parameter of the model"
            elif type(p) not in _PLAIN:
                why = f"parameter {name} is a {type(p).__name__} (a shard: its owner steps it)"
            elif (e := self._by_key.get(key)) is None or not e.resizable or e.foreign:
                why = f"parameter {name} is not a storage the runtime moves"
            elif not _whole(p, e.nbytes) or (p.grad is not None and not _whole(
                    p.grad, getattr(self._entry(p.grad), "nbytes", None))):
                why = f"parameter {name} or its gradient is a view into a larger storage"
            if why is not None:
                return f"host steps not executed: {why}", frozenset()
            wanted[name] = (h.grad, h.param)
        # what runs on the host: the units of the optimizer's work whose parameters are
        # all host-stepped (a unit shared with a parameter the device steps stays there,
        # with all its parameters: the device step leaves out whole parameters only)
        units = update_groups(trace)
        while True:
            mixed = {n for _, names in units if names & wanted.keys() and not names <= wanted.keys()
                     for n in names & wanted.keys()}
            if not mixed:
                break
            for n in mixed:
                del wanted[n]
        host_ops = {o for unit, names in units if names and names <= wanted.keys() for o in unit}
        if not wanted:
            return ("host steps not executed: each shares its optimizer op with a parameter the device steps",
                    frozenset())
        chosen: list[tuple[str, torch.nn.Parameter, int, int]] = []
        for name, (grad, param) in wanted.items():
            # (a device op reading the parameter after backward, a loop that logs or
            # averages weights before step(), must see it before its update)
            last_grad, last_param = (max((int(u) for u in trace.uses(t).tolist() if int(u) not in host_ops),
                                         default=-1) for t in (grad, param))
            chosen.append((name, named[name], last_grad, max(last_grad, last_param)))
        self._host_groups_seen = None
        if any(self._host_group(p) is None for _, p, _, _ in chosen):
            return "host steps not executed: a host-stepped parameter is in no param group", frozenset()
        cuda = self.device.type == "cuda"
        chunker = self._chunker
        chunker.install()  # (if it is not: the device step must leave the host-stepped parameters out)
        chunker.freeze()  # (before the state leaves: its sizes set the chunks, as profiled)
        for name, p, last, last_read in chosen:
            e = self._by_key[f"param:{name}"]
            self._make_room(e.nbytes if e.state != RESIDENT else 0, [e])
            self._ensure_resident(e)
            master = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=cuda)
            master.copy_(p.detach())
            g = p.grad
            grad_buf = torch.empty(p.shape, dtype=g.dtype if g is not None else p.dtype, device="cpu",
                                   pin_memory=cuda)
            master.grad = grad_buf
            hp = _HostParam(name, p, last, last_read, master, grad_buf)
            self._host_state_to_host(hp)
            e.home, e.synced = _u8(master.untyped_storage(), hp.nbytes), True
            self._host_params.append(hp)
            self._host_by_cdata[e.cdata] = hp
            self._host_hooks.append(p.register_post_accumulate_grad_hook(self._host_hook(hp)))
        chunker.leave_out({id(hp.param) for hp in self._host_params})
        self._host_hooks.append(self.optimizer.register_state_dict_pre_hook(self._host_state_read))
        self._host_hooks.append(self.optimizer.register_load_state_dict_pre_hook(self._host_state_read))
        if self._host_worker is None:
            self._host_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierflow-host-step")
        self._host_active = True
        self.stats.host_stepped_params = len(self._host_params)
        self.stats.host_step_bytes = sum(
            2 * hp.nbytes + sum(v.numel() * v.element_size() for v in hp.held) for hp in self._host_params)
        return None, frozenset(host_ops)

    def _host_group(self, p: torch.Tensor) -> dict | None:
        """The user's param group holding ``p`` now (``load_state_dict`` makes new group
        dicts; during a chunked step, the user's groups, not the chunk groups)."""
        chunker = self._chunker
        groups = chunker.user_groups if chunker is not None and chunker.user_groups is not None \
            else self.optimizer.param_groups
        if groups is not self._host_groups_seen or not all(
                a is b for a, b in zip(groups, self._host_groups_list)):
            self._host_group_of = {id(q): g for g in groups for q in g["params"]}
            self._host_groups_seen, self._host_groups_list = groups, list(groups)
        return self._host_group_of.get(id(p))

    def _host_state_to_host(self, hp: _HostParam) -> None:
        """Replace the tensors of ``optimizer.state[p]`` by host copies (state already on
        the host, such as Adam's CPU step counter on CUDA, stays as it is). Again after
        ``load_state_dict()`` put new tensors there: the old copies are let go."""
        state = self.optimizer.state[hp.param]
        cuda = self.device.type == "cuda"
        current = {id(v) for v in state.values() if isinstance(v, torch.Tensor)}
        kept = [v for v in hp.held if id(v) in current]
        for v in hp.held:
            if id(v) not in current:
                self._host_held.discard(id(v))
        hp.held = kept
        for k, v in list(state.items()):
            if not isinstance(v, torch.Tensor) or id(v) in self._host_held:
                continue
            if v.device.type == self.device.type:  # (CPU mode: the device's, counted in the budget)
                e = self._entry(v)
                if e is not None and e.state != RESIDENT:
                    self._make_room(e.nbytes, [e])
                    self._ensure_resident(e)
                h = torch.empty(v.shape, dtype=v.dtype, device="cpu", pin_memory=cuda and v.dim() > 0)
                h.copy_(v)
                hp.moved[k] = v.device
                state[k] = h
                v = h
            self._host_held.add(id(v))
            hp.held.append(v)

    def _host_release(self) -> None:
        """Give the host steps up (a new profile, a new plan, the end of the run): every
        update finished, parameters and gradients back on the device, the state moved
        back where it was, hooks and the device step's skip set gone."""
        if not self._host_active:
            return
        self._host_finish(copy_back=False, late=False)
        self._host_active = False
        for h in self._host_hooks:
            h.remove()
        self._host_hooks.clear()
        for hp in self._host_params:
            e = self._host_entry(hp)
            for t in (hp.param, hp.param.grad):
                x = self._entry(t) if t is not None else None
                if x is not None and x.state != RESIDENT and x.tier == "home":
                    self._make_room(x.nbytes, [x])
                    self._fetch(x)
                if x is not None:
                    x.home = None
            if e is not None:
                e.home = None
            state = self.optimizer.state.get(hp.param, {})
            back = [(k, v, dev) for k, dev in hp.moved.items() if isinstance(v := state.get(k), torch.Tensor)]
            # (it counts on the device again)
            self._make_room(sum(v.numel() * v.element_size() for _, v, _ in back), [])
            for k, v, dev in back:
                if v.device != dev:
                    state[k] = v.to(dev)
        self._host_params.clear()
        self._host_by_cdata.clear()
        self._host_held = set()
        if self._chunker is not None:
            self._chunker.leave_out(set())
            self._chunker.thaw()
        self._label_opt_state()  # (CPU mode: the state the host held is device state again)

    def _host_close(self) -> None:
        """At the end of the run: release, and stop the worker."""
        try:
            self._host_release()
        finally:
            if self._host_worker is not None:
                self._host_worker.shutdown(wait=True)
                self._host_worker = None

    # -- an iteration ------------------------------------------------------------------

    def _host_entry(self, hp: _HostParam) -> _Entry | None:
        return self._by_key.get(f"param:{hp.name}")

    def _host_hook(self, hp: _HostParam):
        def hook(p: torch.Tensor) -> None:
            if not (self._host_active and self._in_iter and self._planned and not self._stale) or self._host_late:
                return  # (sent and updated when optimizer.step() ends)
            if self._op <= hp.last_op:
                return  # not its last write yet (an earlier pass of an accumulation), or the
                # trace has device ops reading it after backward (clipping): at the step
            # (the trace reads the parameter after backward: sent now, updated at the step)
            if hp.future is not None or hp.started:
                raise OffloadError(
                    f"the gradient of {hp.name} was accumulated again after its host update began "
                    "(more backward passes than the profiled iteration had); profile with the same "
                    "number of backward passes per optimizer step, or pass host_step_overlap=False")
            t0 = time.perf_counter()
            try:
                with self._own_ops():
                    self._host_send(hp)
                    if self._host_overlap and self._op > hp.last_read:
                        self._host_start(hp)
                        hp.early = True
                        self.stats.host_steps_in_backward += 1
            finally:
                if self._timing:  # (the runtime's own work, not the model's: see retime)
                    self._retimer.add_handler_s(time.perf_counter() - t0)
        return hook

    def _host_state_read(self, optimizer: Any, *args: Any) -> None:
        """``state_dict()`` / ``load_state_dict()`` between ``backward()`` and ``step()``
        once updates began in backward: the state is half updated; refused."""
        early = [hp.name for hp in self._host_params if hp.early]
        if early:
            raise OffloadError(
                f"optimizer state read or loaded between backward() and optimizer.step() while the host "
                f"updates of {', '.join(early[:3])}{' ...' if len(early) > 3 else ''} had begun in backward: "
                "call state_dict()/load_state_dict() before backward() or after step(), or pass "
                "host_step_overlap=False")

    def _host_send(self, hp: _HostParam) -> None:
        """Send ``hp``'s gradient to its host buffer (and off the device), make sure the
        master copy holds the parameter's bytes, and drop those from the device: from
        here the parameter's home is its master copy."""
        p = hp.param
        g = p.grad
        e = self._host_entry(hp)
        if e is None or e.ref() is None:
            raise OffloadError(f"host step of {hp.name}: the runtime lost track of the parameter's storage")
        events = hp.events
        state = self.optimizer.state[p]
        if any(isinstance(v, torch.Tensor) and id(v) not in self._host_held for v in state.values()):
            self._host_state_to_host(hp)  # load_state_dict() put device tensors there
        self._host_sync(hp, e)
        # the gradient: to its host buffer, then off the device
        ge = self._entry(g)
        if ge is not None:
            if ge.state != RESIDENT:
                self._make_room(ge.nbytes, [ge])
                self._ensure_resident(ge)
            if ge.arrival is not None:
                self._tiers.copier.wait(ge.arrival)
                ge.arrival = None
            gst = ge.ref()
            n = ge.nbytes
            if _whole(g, n) and n == hp.grad_buf.numel() * hp.grad_buf.element_size():
                home = _u8(hp.grad_buf.untyped_storage(), n)
                src = _u8(gst, n)
                ev = self._tiers.copier.copy(home, src, src)
                events.append(ev)
                del src
                if ge.resizable and not ge.pins and not ge.foreign:
                    gst.resize_(0)
                    ge.state, ge.tier, ge.home, ge.slot = AWAY, "home", home, -1
                    self._leave(ev, n)  # (counted until the copy has read it)
                    self._storages.left_device(ge)
            else:  # (a view into a larger gradient buffer: copied, left where it is)
                events.append(self._tiers.copier.copy(hp.grad_buf, g.detach(), g))
            self._count("device->host", "host", hp.grad_buf.numel() * hp.grad_buf.element_size())
            ge.synced = True  # (an op that writes it from here on makes this copy stale)
        else:  # (not on the device: a CPU gradient of a CUDA model)
            hp.grad_buf.copy_(g)
        hp.grad_entry = ge
        hp.sent = True
        self._host_drop(e)

    def _host_sync(self, hp: _HostParam, e: _Entry) -> None:
        """Make the master copy hold the parameter's current bytes (an op wrote it since
        it was last copied) and have the next update wait for the copies reading it."""
        if hp.read is not None:  # (the update rewrites the master copy the copy back reads)
            hp.events.append(hp.read)
            hp.read = None
        if not e.synced and e.tier != "home":
            if e.state != RESIDENT:  # (away in the pool or the file: those bytes are the new ones)
                self._make_room(e.nbytes, [e])
                self._ensure_resident(e)
            if e.arrival is not None:
                self._tiers.copier.wait(e.arrival)
                e.arrival = None
            src = _u8(e.ref(), e.nbytes)
            hp.events.append(self._tiers.copier.copy(e.home, src, src))
            self._count("device->host", "host", e.nbytes)
            e.synced = True

    def _host_start(self, hp: _HostParam) -> None:
        """Start ``hp``'s update on the worker (its gradient sent)."""
        e = self._host_entry(hp)
        if e is not None and e.ref() is not None and not (e.state != RESIDENT and e.tier == "home"):
            # back on the device since its gradient was sent (read between backward()
            # and step()): the update makes those bytes obsolete, as at the send
            self._host_sync(hp, e)
            self._host_drop(e)
        opt = self.optimizer
        if getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None:
            raise OffloadError(
                f"host step of {hp.name}: the optimizer unscales gradients inside its step (AMP's GradScaler "
                "with a fused optimizer), which host steps do not support; use a policy without host steps")
        group = self._host_group(hp.param)
        if group is None:
            raise OffloadError(f"host step of {hp.name}: the parameter is in no param group of the optimizer any more")
        proxy = _proxy(opt, group, hp.master, opt.state[hp.param])
        hp.settings = _settings(group)
        events, hp.events = hp.events, []
        hp.future = self._host_worker.submit(_update, _raw_step(opt), proxy, events)
        hp.started = True

    def _host_grad_stale(self, hp: _HostParam) -> bool:
        """Whether the gradient sent for ``hp`` is not the one ``p.grad`` holds now (an op
        wrote it since, or another tensor took its place)."""
        g = hp.param.grad
        ge = hp.grad_entry
        if ge is None or g is None:
            return g is not None
        return not ge.synced or self._entries.get(_plain(g).untyped_storage()._cdata) is not ge

    def _host_drop(self, e: _Entry) -> None:
        """Let go of a host-stepped parameter's device bytes (no copy: the master copy
        is, or is about to be, newer)."""
        if e.state == RESIDENT:
            st = e.ref()
            if e.arrival is not None:
                self._tiers.copier.wait(e.arrival)
                e.arrival = None
            st.resize_(0)
            self._ledger.remove(e.nbytes)
            self._storages.left_device(e)
        elif e.tier != "home":  # away in the pool or the file: that copy is obsolete
            self._give_back_slots(e)
            e.slot, e.bounce = -1, -1
        e.state, e.tier = AWAY, "home"

    def _host_wait(self, e: _Entry) -> None:
        """Before ``e`` comes back from its home: its update must have finished. Read in
        an iteration that departed from its trace after its update began in backward,
        the parameter is already updated, which a loop reading it before ``step()``
        would not see in plain PyTorch: the step says so (see :meth:`_host_finish`)."""
        hp = self._host_by_cdata.get(e.cdata)
        if hp is None:
            return
        if hp.early and self._stale and self._in_iter:
            hp.peeked = True
        if hp.future is not None:
            self._host_collect(hp)

    def _host_departed(self) -> None:
        """The iteration departed from its trace: updates queued and not yet begun are
        taken back, to start when the step ends (with the gradients as they are then);
        those already begun are checked then (see :meth:`_host_finish`)."""
        for hp in self._host_params:
            if hp.future is not None and hp.future.cancel():
                hp.future, hp.started, hp.early = None, False, False

    def _host_written(self, func: Any, args: tuple, kwargs: dict) -> None:
        """An untracked op writes its arguments: a host-stepped parameter among them has
        a stale master copy now (tracked ops mark it where they account what they wrote)."""
        for t in _written_args(func, args, kwargs):
            e = self._entries.get(t.untyped_storage()._cdata) if t.device.type == self.device.type else None
            if e is not None and e.home is not None:
                e.synced = False

    def _host_evict(self, e: _Entry) -> bool:
        """Evict a host-stepped parameter whose master copy on the host is current: no
        copy, its home holds the bytes (a plan's eviction, or one the budget forces)."""
        if not (self._host_active and e.synced and e.state == RESIDENT and e.cdata in self._host_by_cdata):
            return False
        st = e.ref()
        if st is None or st.nbytes() != e.nbytes or e.pins:
            return False
        self._host_drop(e)
        self._count_move(e.kind, "host")
        return True

    def _host_read(self, e: _Entry, event: Any) -> None:
        """``e`` is being copied back from its home (``event`` completes the copy): the
        next update must not write the master copy before that."""
        hp = self._host_by_cdata.get(e.cdata)
        if hp is not None and event is not None:
            hp.read = event

    def _host_collect(self, hp: _HostParam, quiet: bool = False) -> None:
        """Wait for ``hp``'s update; its error (the optimizer's own, on the host) as an
        :class:`OffloadError`, or with ``quiet`` (giving the host steps up after an
        error was raised) not at all."""
        fut, hp.future = hp.future, None
        t0 = time.perf_counter()
        waited = not fut.done()
        try:
            dt = fut.result()
        except Exception as err:
            if quiet:
                return
            raise OffloadError(f"host step of {hp.name} failed: {type(err).__name__}: {err}") from err
        if waited:
            self.stats.host_step_wait_s += time.perf_counter() - t0
        self.stats.host_steps += 1
        self.stats.host_step_s += dt

    def _host_finish(self, copy_back: bool = True, late: bool = True) -> None:
        """When ``optimizer.step()`` ends: updates not started by a gradient hook start
        now; every update is waited for; the parameters the plan holds on the device at
        the start of an iteration are copied back (the rest come back when needed)."""
        if not self._host_active:
            return
        with self._own_ops():
            changed = [hp.name for hp in self._host_params if hp.early and self._host_grad_stale(hp)]
            peeked = [hp.name for hp in self._host_params if hp.peeked]
            # (and the settings: an LR set between backward() and step() after an update
            # had begun would reach only the updates that began later)
            retuned = [hp.name for hp in self._host_params if hp.early and hp.settings is not None
                       and (g := self._host_group(hp.param)) is not None and not _same_settings(hp.settings, g)]
            if late:  # (when a step ends, not when the host steps are given up)
                for hp in self._host_params:
                    if hp.started or hp.param.grad is None:
                        continue  # (an optimizer skips a parameter without a gradient; so do we)
                    if not hp.sent or self._host_grad_stale(hp):
                        self._host_send(hp)
                    self._host_start(hp)
            for hp in self._host_params:
                hp.sent = hp.started = hp.early = hp.peeked = False
                hp.grad_entry, hp.settings = None, None
                hp.events = []
                if hp.future is not None:
                    self._host_collect(hp, quiet=not late)
            if retuned and late:
                raise OffloadError(
                    f"the optimizer settings of {', '.join(retuned[:3])}{' ...' if len(retuned) > 3 else ''} "
                    "(lr, betas, ...) were changed between backward() and optimizer.step(), after their host "
                    "updates had begun with the old ones. Change them before backward(), or pass "
                    "host_step_overlap=False")
            if peeked and late:
                raise OffloadError(
                    f"the parameters {', '.join(peeked[:3])}{' ...' if len(peeked) > 3 else ''} were read between "
                    "backward() and optimizer.step() in an iteration whose profile did not read them, after their "
                    "host updates had begun: the read saw the updated values. Read parameters the same way on "
                    "every step (or after step()), or pass host_step_overlap=False")
            if changed and late:
                raise OffloadError(
                    f"the gradients of {', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''} were changed "
                    "after backward (clipping, unscaling) in an iteration whose profile did not change them, "
                    "after their host updates had begun: those updates used the gradients as backward left "
                    "them. Change gradients the same way on every step, or pass host_step_overlap=False")
            if copy_back:
                start_away = getattr(self, "_start_away", {})
                for hp in self._host_params:
                    e = self._host_entry(hp)
                    if e is None or e.state == RESIDENT or e.tier != "home" or f"param:{hp.name}" in start_away:
                        continue
                    self._make_room(e.nbytes, [e])
                    self._fetch(e)
            self._note_peak()


__all__ = ["HostSteps", "follow_past_host_ops", "update_groups"]
