"""Executing the plan's host-side optimizer steps (ZeRO-Offload's idea): for the
parameters the plan names, the optimizer state lives in host memory for good and the
update runs on the host, with the user's own optimizer class.

How. While a plan with host steps is followed:

- The state tensors of each host-stepped parameter are replaced, in the user's
  ``optimizer.state[p]``, by host copies (pinned on CUDA), and a host master copy of
  the parameter is kept. The user's optimizer object is the one they made:
  ``state_dict()`` returns the host state, ``load_state_dict`` and LR schedulers work on
  it (the reason torchao's ``CPUOffloadOptimizer`` keeps the user's API too).
- Each such parameter's gradient leaves the device as soon as backward has accumulated
  it (post-accumulate-grad hook: an eviction to the host pool, like a planned move).
  If the loop reads it before the step (gradient clipping, logging), it is fetched back
  on demand: the loop sees the same gradient as without tierflow.
- ``optimizer.step()`` runs the device-side update for the other parameters (the step
  wrapper of :mod:`.optim_chunks` leaves the host-stepped ones out of its groups) and, at
  the same time in a worker thread, the host-side update: a shadow of the user's
  optimizer (same class, the group's current settings, the same state dicts, no hooks)
  steps the master copies with the gradients copied out of the host pool. Then the
  updated parameters are copied back to the device before anything can use them.

Why at ``optimizer.step()`` and not while backward still runs: a loop may clip, scale
or inspect gradients, or change the learning rate, between ``backward()`` and
``step()``; an update started during backward would not see that, and the result would
differ from the user's loop. The overlap is therefore with the device-side update.

CPU mode runs the same CPU kernel on the same values: bitwise equal to plain PyTorch.
On CUDA the host update is the CPU implementation of the optimizer, so results differ
from the GPU kernel's in the last bits (fp32 rounding of a different summation order,
``foreach``/fused GPU kernels): the tolerance is that of two AdamW implementations, not
zero (measured by ``benchmarks/gpu_check.py`` when a GPU is lent).

While an iteration is profiled, the host steps are undone (state back on the device),
so the trace records the whole device step, as the planner expects.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .optim_chunks import ChunkedStep
from .storages import AWAY, RESIDENT, _Entry


class _HostParam:
    """One host-stepped parameter: its device tensor, master copy, gradient buffer."""

    def __init__(self, p: torch.Tensor, name: str, pin: bool):
        self.p, self.name = p, name
        self.moved: list[str] = []  # state keys moved to the host (to move back)
        with torch._C._DisableTorchDispatch():
            self.master = torch.empty(p.shape, dtype=p.dtype, pin_memory=pin)
            self.master.copy_(p.detach())
            self.grad = torch.empty(p.shape, dtype=p.dtype, pin_memory=pin)
        self.master.grad = self.grad


class HostStepping:
    """Host-side optimizer steps (a mixin of :class:`~tierflow.runtime.executor.Run`)."""

    def _host_step_tables(self, trace: Any, plan: Any) -> None:
        """From the plan: which parameters are host-stepped, which trace ops no longer
        run on the device."""
        names = {f"param:{n}": (n, p) for n, p in self.model.named_parameters()}
        self._host_plan: list[tuple[str, torch.Tensor]] = []
        skipped = [False] * trace.n_ops
        for hs in plan.host_steps:
            found = names.get(trace.tensors[hs.param].key or "")
            if found is None or self.optimizer is None:
                continue
            self._host_plan.append(found)
            for op in hs.ops:
                if 0 <= op < trace.n_ops:
                    skipped[op] = True
        # the plan lists each host step's ops; any other optimizer op that touches only
        # host-stepped parameters' tensors (and temporaries) does not run on the device
        # either (a step counter's increment, say), and is skipped the same way
        host = {n for n, _p in self._host_plan}
        mine = set()
        for t in trace.tensors:
            kind, _, rest = (t.key or "").partition(":")
            if (kind in ("param", "grad") and rest in host) or (kind == "opt" and rest.rpartition(":")[0] in host):
                mine.add(t.id)
        for i, op in enumerate(trace.ops):
            if op.phase != "optimizer" or skipped[i]:
                continue
            keyed = {t for t in op.inputs + op.outputs if trace.tensors[t].key}
            if keyed and keyed <= mine:
                skipped[i] = True
        self._host_skip = skipped if self._host_plan else None

    def _skip_host_ops(self, i: int) -> int:
        """Op ``i`` of the trace is a host-stepped parameter's device update, which no
        longer runs: move past it and its like (issuing the moves planned after them)."""
        skip, n = self._host_skip_now, self._n_ops
        while i < n and skip[i]:
            if self._has_moves[i] and not self._stale:
                self._fire(i, hints=self._hinted)
            i += 1
        self._op = i
        return i

    def _host_steps_begin(self) -> None:
        """At an iteration's start: host steps on while a plan with them is followed,
        undone while profiling (and when the plan has none)."""
        want = bool(getattr(self, "_host_plan", None)) and (self._planned or self._hinted)
        if want and not self._host_params:
            self._host_setup()
        elif not want and self._host_params:
            self._host_teardown()

    def _host_setup(self) -> None:
        opt = self.optimizer
        pin = self.device.type == "cuda"
        for name, p in self._host_plan:
            # NOTE: read below the dispatch mode, so first brought back if the plan moved
            # it (a storage moved away has no bytes to read)
            self._make_resident(p)
            st = opt.state.get(p)
            # every state tensor on the device (a step counter too: in CPU mode it is one)
            state = [(k, v) for k, v in (st or {}).items()
                     if isinstance(v, torch.Tensor) and v.device.type == self.device.type]
            for _k, v in state:
                self._make_resident(v)
            with torch._C._DisableTorchDispatch():
                hp = _HostParam(p, name, pin)
                for k, v in state:
                    st[k] = v.to("cpu", copy=True).pin_memory() if pin else v.clone()
                    hp.moved.append(k)
            self._host_params[id(p)] = hp
        if self._chunker is None:  # the step wrapper leaves the host-stepped parameters out
            self._chunker = ChunkedStep(opt, cuda=self.device.type == "cuda")
            self._chunker.install()
        self._chunker.exclude = set(self._host_params)
        self._chunker.host = self
        self._host_skip_now = self._host_skip
        self._host_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierflow-host-step")

    def _host_teardown(self) -> None:
        """State back on the device, as the user's optimizer had it."""
        opt = self.optimizer
        with torch._C._DisableTorchDispatch():
            for hp in self._host_params.values():
                st = opt.state.get(hp.p)
                if st is not None:
                    for k in hp.moved or [k for k, v in st.items() if isinstance(v, torch.Tensor)]:
                        v = st.get(k)
                        if isinstance(v, torch.Tensor):
                            st[k] = v.to(self.device, copy=True) if self.device.type == "cuda" else v.clone()
        self._host_params = {}
        self._host_skip_now = None
        if self._chunker is not None:
            self._chunker.exclude, self._chunker.host = set(), None
        pool, self._host_pool = getattr(self, "_host_pool", None), None
        if pool is not None:
            pool.shutdown(wait=True)

    def _host_grad_ready(self, p: torch.Tensor, e: _Entry | None) -> None:
        """A host-stepped parameter's gradient is complete: it leaves the device."""
        if e is not None and e.state is RESIDENT and self._evict(e, "host"):
            self.stats.planned_moves += 1

    # -- at optimizer.step(): called by the step wrapper ---------------------------------
    def host_update_start(self) -> Future | None:
        """Copy the gradients to the host buffers, start the host update in the worker."""
        if not self._host_params:
            return None
        # NOTE: this runs in optimizer.step(), outside any op: the fetches and copies below
        # are the runtime's own, not ops of the iteration (quiet), or the dispatch mode
        # would make room for them by evicting what is being read
        q, self._quiet = self._quiet, True
        try:
            return self._host_update_start()
        finally:
            self._quiet = q

    def _host_update_start(self) -> Future | None:
        t0 = time.perf_counter()
        ready = []
        for hp in self._host_params.values():
            g = hp.p.grad
            if g is None:
                continue
            e = self._entries.get(g.untyped_storage()._cdata)
            direct = (e is not None and e.state is AWAY and e.tier == "host" and g.is_contiguous()
                      and g.storage_offset() == 0 and e.nbytes == g.numel() * g.element_size())
            if not direct and e is not None and e.state is not RESIDENT:
                self._ensure_resident(e)
            self._make_resident(hp.p)
            with torch._C._DisableTorchDispatch():
                # straight from its host pool slot when it is there
                src = self._host.view(e.slot, e.nbytes).view(g.dtype).view(g.shape) if direct else g.detach()
                hp.grad.copy_(src)
                hp.master.copy_(hp.p.detach())  # (code between steps may have written the parameter)
            ready.append(hp)
        if not ready:
            return None
        # NOTE: the shadow optimizer is made here, in the main thread, before the device
        # step swaps the user's param_groups for its own (the worker must not read them)
        shadow = self._host_shadow(ready)
        self._host_copy_s = time.perf_counter() - t0
        return self._host_pool.submit(self._host_update, shadow)

    def _make_resident(self, p: torch.Tensor) -> None:
        if getattr(p, self._dev_attr) is not True:
            return
        e = self._entries.get(p.untyped_storage()._cdata)
        if e is not None and (e.state is not RESIDENT or e.arrival is not None):
            self._ensure_resident(e)

    def _host_shadow(self, ready: list[_HostParam]) -> torch.optim.Optimizer:
        """A shadow of the user's optimizer over the master copies: the same class and
        defaults, the groups' current settings, the user's state dicts, no hooks."""
        opt = self.optimizer
        by_group = []
        for g in opt.param_groups:
            ids = {id(q) for q in g["params"]}
            mine = [hp for hp in ready if id(hp.p) in ids]
            if mine:
                by_group.append((g, mine))
        shadow = copy.copy(opt)  # the same class and defaults; its own groups, state map, hooks
        shadow._optimizer_step_pre_hooks = OrderedDict()
        shadow._optimizer_step_post_hooks = OrderedDict()
        shadow.param_groups = [dict(g, params=[hp.master for hp in mine]) for g, mine in by_group]
        shadow.state = {hp.master: opt.state[hp.p] for _g, mine in by_group for hp in mine if hp.p in opt.state}
        for _g, mine in by_group:
            for hp in mine:
                if hp.p not in opt.state:  # the first step creates the state: in the user's dict
                    opt.state[hp.p] = shadow.state[hp.master] = {}
        return shadow

    def _host_update(self, shadow: torch.optim.Optimizer) -> float:
        """In the worker thread: the user's optimizer class steps the master copies
        (its unhooked step: the user's step hooks run once, around the whole step)."""
        t0 = time.perf_counter()
        step = type(shadow).step
        getattr(step, "__wrapped__", step)(shadow)
        return time.perf_counter() - t0

    def host_update_finish(self, task: Future | None) -> None:
        """Wait for the host update; copy the updated parameters back to the device."""
        if task is None:
            return
        q, self._quiet = self._quiet, True
        try:
            self._host_update_finish(task)
        finally:
            self._quiet = q

    def _host_update_finish(self, task: Future) -> None:
        worker_s = task.result()
        t0 = time.perf_counter()
        for hp in self._host_params.values():
            if hp.p.grad is None:
                continue
            self._make_resident(hp.p)
            with torch._C._DisableTorchDispatch():
                hp.p.detach().copy_(hp.master)
        self.stats.host_steps += len(self._host_params)
        self.stats.host_step_s += worker_s + self._host_copy_s + time.perf_counter() - t0


__all__ = ["HostStepping"]
