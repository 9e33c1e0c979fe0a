"""The user's optimizer step in chunks of parameters that fit the budget.

Why. ``foreach`` optimizers (the default on CUDA for ``torch.optim.AdamW`` and ``SGD``)
and ``fused=True`` ones update every parameter of a param group with one kernel per
operation: one aten op that reads every parameter, gradient and state tensor of the
group at once. Under a budget smaller than the model's whole state that op cannot run,
whatever the plan, and ``offload`` would refuse the budget. Those kernels are
elementwise per tensor, so running the same step over consecutive slices of each param
group gives bitwise the same parameters and state; each slice is then a separate op in
the trace, which the planner can fit.

How. While the ``offload`` block is open and a finite budget is known,
``optimizer.step`` (the instance attribute; the class's hooked step is untouched) swaps
``param_groups`` for *chunk groups* (shallow copies of each group, each with a slice of
its ``params``) and calls the step the optimizer had, once: the step's pre- and post-hooks
(the runtime's own among them) run once, and the optimizer's own loop over groups runs
the chunks one after another, so the temporaries of one chunk are freed before the next
starts. The groups come back in a ``finally``, so an exception inside the step leaves
the optimizer as it was.

The chunk size. Nothing is chunked without a budget, or while every multi-tensor
group's whole update (parameters, gradients, state) fits in half of it. Otherwise a
chunk holds consecutive parameters of one group while their parameter, gradient and
state bytes stay within a quarter of the budget (a single larger parameter is a chunk
alone): the multi-tensor kernels make temporaries about the size of one state tensor
per chunk, and the rest of the budget keeps room for the plan's prefetches of the next
chunk. Fewer, larger chunks mean fewer kernel launches on a GPU: the quarter is the
trade-off.

Host steps. The same machinery leaves out the parameters a plan updates on the host
(:mod:`.host_step`): ``skip`` holds them while a plan with host steps is followed, and
their chunks are dropped (a chunk is one op of the trace, host-stepped whole or not at
all). The chunk layout is then frozen as profiled (``freeze``): the host-stepped
parameters' state has left the device, which must not change the chunks of the rest.

Limitations. Group settings a step pre-hook changes on a chunk group are copied back
from the group's first chunk. A closure is passed to the step once, as usual. Groups
with ``foreach=False`` (one parameter at a time already) are never chunked.
"""

from __future__ import annotations

from typing import Any

import torch


def _multi_tensor(group: dict[str, Any], cuda: bool) -> bool:
    """Whether the group's step runs one kernel over all its tensors: ``fused``, or
    ``foreach`` (asked for, or left to torch, which picks it for CUDA tensors)."""
    if group.get("fused") or group.get("foreach"):
        return True
    return cuda and group.get("foreach", False) is None and not group.get("fused")


def _nbytes(t: torch.Tensor) -> int:
    # from the shape, not the storage: a tensor the runtime has moved away has a storage
    # of zero bytes, and the chunks must not change with where tensors are
    return t.numel() * t.element_size()


def _state_bytes(opt: torch.optim.Optimizer, p: torch.Tensor) -> int:
    """Bytes one parameter's update touches: it, its gradient, its state on its device."""
    n = _nbytes(p)
    if p.grad is not None:
        n += _nbytes(p.grad)
    for v in opt.state.get(p, {}).values():
        if isinstance(v, torch.Tensor) and v.device == p.device:
            n += _nbytes(v)
    return n


class ChunkedStep:
    """Runs ``optimizer.step`` in parameter chunks (see the module docstring).

    Args:
        optimizer: the user's optimizer; its object, state and hooks stay its own.
        cuda: the parameters are on CUDA (where ``foreach=None`` means foreach).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, cuda: bool):
        self.opt = optimizer
        self.cuda = cuda
        self.cap: float | None = None  # bytes per chunk; None: the step runs whole
        self.chunks = 0  # chunk groups in the last chunked step
        self.skip: set[int] = set()  # ids of parameters the step leaves out (host steps)
        self.user_groups: list[dict] | None = None  # the user's param groups while chunk groups stand in
        self.frozen: list[list[list[int]]] | None = None  # the chunk layout, held (see freeze)
        self._inner = None
        self._installed = False

    @property
    def wanted(self) -> bool:
        """Whether any group steps all its tensors in one kernel."""
        return any(_multi_tensor(g, self.cuda) for g in self.opt.param_groups)

    def install(self) -> None:
        if self._installed:
            return
        # whatever ``step`` is now (the class's hooked step, or an LR scheduler's wrapper
        # on the instance) is what a step calls, once, with the chunk groups in place
        self._inner = self.opt.step
        self._had_own = "step" in self.opt.__dict__
        self._own = self.opt.__dict__.get("step")

        def step(*args, **kwargs):
            return self._step(*args, **kwargs)

        # what the inner step carries stays visible (an LR scheduler marks its wrapper
        # with ``_wrapped_by_lr_sched`` and warns when that mark is gone)
        step.__dict__.update(getattr(self._inner, "__dict__", {}))
        self._wrapper = step
        self.opt.step = step
        self._installed = True

    def uninstall(self) -> None:
        if not self._installed:
            return
        self._installed = False
        if self.opt.__dict__.get("step") is self._wrapper:  # (else someone wrapped us: keep theirs)
            if self._had_own:
                self.opt.step = self._own
            else:
                del self.opt.step

    def fit(self, budget: float) -> bool:
        """Chunk an installed step for ``budget`` unless it is chunked already (the first
        budget known keeps its chunks); True if the step now runs in chunks it did not
        run in before."""
        if not self._installed or self.cap is not None:
            return False
        self.cap = self.cap_for(budget)
        return self.cap is not None

    def leave_out(self, params: set[int]) -> None:
        """The step leaves out the parameters whose ids are ``params`` (their updates run
        on the host: runtime/host_step.py); an empty set: none."""
        self.skip = set(params)

    def cap_for(self, budget: float) -> float | None:
        """The chunk size for ``budget``: a quarter of it, if some multi-tensor group's
        whole update (its parameters, gradients and state) exceeds half of it; else
        None: every group fits whole, with room for its temporaries and the rest.

        Before the first step (no gradient, no state yet: a byte budget is known when the
        block opens) a parameter counts as what its first step will touch: itself, a
        gradient of its size and Adam's two moments (the first step makes them), so that
        the first step too runs in chunks where later ones will."""
        for g in self.opt.param_groups:
            if _multi_tensor(g, self.cuda) and sum(self._expected_bytes(p) for p in g["params"]) > budget / 2:
                return budget / 4
        return None

    def _expected_bytes(self, p: torch.Tensor) -> int:
        """What a parameter's update touches; before its first step (a byte budget is
        known when the block opens) also the gradient and Adam's two moments that step
        will make, so that the first step too runs in chunks where later ones will
        (without it the first step of gpt-tiny with AdamW(foreach=True) under a 2.5 MiB
        byte budget peaked 7% over it)."""
        n = _state_bytes(self.opt, p)
        if p.grad is None:
            n += _nbytes(p)
        if not self.opt.state.get(p):
            n += 2 * _nbytes(p)
        return n

    def freeze(self) -> None:
        """Hold the current chunk layout until :meth:`thaw` (while host steps keep some
        parameters' state off the device, which would otherwise change the sizes)."""
        self.frozen = self._slices(self.cap)

    def thaw(self) -> None:
        self.frozen = None

    def _slices(self, cap: float | None) -> list[list[list[int]]]:
        """Per group, the index ranges of its chunks (one range: not chunked)."""
        if self.frozen is not None:
            return self.frozen
        out = []
        for g in self.opt.param_groups:
            ps = g["params"]
            if cap is None or not _multi_tensor(g, self.cuda) or len(ps) < 2:
                out.append([list(range(len(ps)))])
                continue
            chunks, cur, size = [], [], 0
            for k, p in enumerate(ps):
                b = _state_bytes(self.opt, p)
                if cur and size + b > cap:
                    chunks.append(cur)
                    cur, size = [], 0
                cur.append(k)
                size += b
            chunks.append(cur)
            out.append(chunks)
        return out

    def _step(self, *args, **kwargs):
        inner = self._inner
        if not self._installed or (self.cap is None and not self.skip):
            return inner(*args, **kwargs)
        groups = self.opt.param_groups
        slices = self._slices(self.cap)
        skip = self.skip
        if all(len(c) == 1 for c in slices) and not skip:
            self.chunks = len(groups)
            return inner(*args, **kwargs)
        chunked, first = [], []
        for g, ranges in zip(groups, slices):
            first.append(None)
            for r in ranges:
                params = [g["params"][k] for k in r]
                if skip:
                    params = [p for p in params if id(p) not in skip]
                    if not params:  # host-stepped whole: not run here
                        continue
                c = dict(g)
                c["params"] = params
                chunked.append(c)
                if first[-1] is None:
                    first[-1] = c
        self.chunks = len(chunked)
        self.opt.param_groups = chunked
        self.user_groups = groups
        try:
            return inner(*args, **kwargs)
        finally:
            self.opt.param_groups = groups
            self.user_groups = None
            for g, c in zip(groups, first):  # settings a hook changed during the step
                if c is None:  # (no chunk of it ran here)
                    continue
                for k, v in c.items():
                    if k != "params" and g.get(k) is not v:
                        g[k] = v


__all__ = ["ChunkedStep"]
