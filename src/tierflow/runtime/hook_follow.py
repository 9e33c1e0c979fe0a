"""Following a plan at ticks, with no dispatch mode on the stack through forward and
backward: the steady state decided in docs/runtime.md ("The steady state on a GPU").
``offload(..., follow="hooks")``.

Why. A followed iteration that runs every aten op through the runtime's Python handler
is host-bound on a GPU (the H200 timelines: GPU busy 25-44% of a planned step). Here the
plan is made from the trace coarsened to segments (:mod:`.segments`: one op per stretch
of ops between two ticks, no gap for a tensor no tick can reach), so every move it
makes falls between two segments, and the runtime acts only at the ticks PyTorch calls
anyway: module forward pre- and post-hooks, the saved-tensor pack and unpack hooks, and
the parameters' post-accumulate-grad hooks. The optimizer step runs through the
dispatch mode as before (it is one op per segment there; on a GPU its multi-tensor
kernels make few ops).

At each tick :class:`HookFollower` checks it is the tick the profile had next (its
kind and its module, saved-tensor ordinal, storage key or parameter; anything else is
a departure: the dispatch mode goes back on the stack and the iteration finishes on the
pager, as a departure always has), binds what the hook hands it (a saved activation to
its trace id by its ordinal, a gradient by its parameter; parameters and optimizer
state are bound by key when the iteration starts), and when the tick starts a later
segment: fires the plan's moves after each segment passed (the follower's move table,
``Follower.fire``) and makes the new segment's tensors resident (the compute stream waits for
their copies in, as before an op).

Accounting. The storages a tick binds are counted from their tick (the pack hook runs
right after the op that saved the tensor), the rest are not seen here at all: their
bytes come from the trace, each segment's share of the tensors no tick reaches (and of
the others before their tick), so ``stats.peak_device_bytes_planned`` is the runtime's
count of what it moved and bound plus the trace's count of the rest, at segment
granularity. CPU mode has no other count; on CUDA ``torch.cuda.max_memory_allocated``
is the check.

Not followed this way (the plan is made from the fine trace and followed op by op, and
``stats.follow`` says why): plans with recompute or host steps, reactive plans, a trace
without ticks, a budget below the coarse trace's minimum working set, another dispatch
mode above the runtime's, tensor subclasses and collectives (DDP, FSDP).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from .segments import MERGED_PHASES, Coarse
from .storages import RESIDENT

FOLLOW_CHOICES = ("ops", "hooks")


def coarse_sigs(coarse: Coarse, sigs: list[tuple]) -> list[tuple]:
    """The follower's per-op signatures for the coarse trace: a single-op segment keeps
    its op's (the optimizer's ops, followed op by op); a merged one has none (no op of it
    reaches the runtime)."""
    starts, n = coarse.starts, len(sigs)
    out = []
    for k, s in enumerate(starts):
        e = starts[k + 1] if k + 1 < len(starts) else n
        out.append(sigs[s] if e - s == 1 and coarse.trace.ops[k].phase not in MERGED_PHASES
                   else (None, [], [], [], []))
    return out


class HookFollower:
    """Follows one plan made from ``coarse`` at its ticks (see the module docstring).

    Args:
        run: the :class:`~tierflow.runtime.executor.Run` whose plan it follows.
        coarse: the coarsened trace the plan was made from.
        ticks: the profiled iteration's ticks, ``[op, kind, ident]`` (fine op indices).
    """

    def __init__(self, run: Any, coarse: Coarse, ticks: list[Any], plan: Any):
        self.run = run
        self.coarse = coarse
        trace = coarse.trace
        # NOTE: only what the plan moves is bound and checked at ticks; everything else
        # is the trace's to count (a bind per saved tensor cost more than the rest of a
        # tick: 1,026 binds a step on HF GPT-2 24 x 64 with nothing planned)
        moved = {m.tensor for m in plan.moves}
        n_fine, self.n_seg = len(coarse.segment_of), trace.n_ops
        seg = coarse.segment_of
        self.expected = [(kind, ident, int(seg[op]) if op < n_fine else self.n_seg) for op, kind, ident in ticks]
        self.opt_start = next((k for k, o in enumerate(trace.ops) if o.phase not in MERGED_PHASES), self.n_seg)
        self.key_tid = {t.key: t.id for t in trace.tensors if t.key}
        self.tensors = trace.tensors
        self.moved = frozenset(moved)
        # NOTE: where the plan moves nothing from the optimizer's first op on, the step
        # runs without the dispatch mode too, its tensors made resident when it begins:
        # a foreach AdamW still dispatches an op or two per parameter (the step counters'
        # .item(): 584 a step on HF GPT-2, each through the runtime's Python on a GPU's host)
        self.native_optimizer = not any(m.after_op >= self.opt_start for m in plan.moves)
        # per segment, the tensors of it the plan moves: what may be away at its start
        self.seg_tensors = [tuple(x for x in dict.fromkeys(o.inputs + o.outputs) if x in moved) for o in trace.ops]
        # the trace's count of what no tick binds: per segment, the bytes of the tensors
        # live in it that no tick reaches, or that are not bound yet
        unseen = np.zeros(self.n_seg + 1, dtype=np.int64)
        first, last = trace.birth, trace.death
        for t in trace.tensors:
            if t.persistent or t.external:
                continue
            a, b = int(first[t.id]), int(last[t.id])
            if t.id in moved and t.id in coarse.bound_at:  # (counted by its entry once its tick binds it)
                b = min(b, coarse.bound_at[t.id] - 1)
            if not self.native_optimizer:
                b = min(b, self.opt_start - 1)  # (the optimizer's ops are followed, and counted, op by op)
            if b >= a:
                unseen[a:b + 1] += t.bytes
        self.unseen = unseen  # (index n_seg: 0, the iteration's end)
        self._handles: list[Any] = []
        self._paths: dict[int, str] = {}
        for name, mod in run.model.named_modules():
            self._paths.setdefault(id(mod), name)
        self.active = False  # following at ticks (planned moves fire)
        self.off_mode = False  # the dispatch mode is off the stack (taken by begin)
        self.degraded = False  # after a departure off the loop's thread: ticks only fetch

    # -- the iteration -------------------------------------------------------------------
    @staticmethod
    def usable(run: Any) -> bool:
        """The runtime's dispatch mode is the innermost one (it can be taken off the stack
        and put back), and no rank syncs: the hooks can run this iteration."""
        stack = _get_current_dispatch_mode_stack()
        return bool(stack) and stack[-1] is run._mode and run._sync is None

    def begin(self) -> None:
        """The iteration starts (inside the model's forward pre-hook): the dispatch mode
        off the stack, the module hooks on, persistent tensors bound by key, segment 0's
        tensors resident."""
        run = self.run
        run._mode.__exit__(None, None, None)
        self.off_mode, self.degraded, self.thread = True, False, threading.get_ident()
        self.active = True
        self.j = 0  # next expected tick
        self.seg = 0
        self.pack_seq = 0
        start_away = run._start_away
        for t in self.tensors:
            if t.persistent and t.key:
                e = run._by_key.get(t.key)
                if e is not None:
                    run._storages.bind(t.id, e)
                    # NOTE: the pager may have evicted model state the plan keeps (in the
                    # optimizer's ops, followed op by op); no op here would fetch it back,
                    # so the plan's start state is made whole first (vit-tiny at 30%: a
                    # LayerNorm weight left away, read by its module unfetched)
                    if e.state is not RESIDENT and t.key not in start_away:
                        run._ensure_resident(e)
        run._ledger.add(int(self.unseen[0]))
        self._handles = [register_module_forward_pre_hook(self._enter), register_module_forward_hook(self._leave)]
        self._arrive(0)
        run._note_peak()

    def to_optimizer(self) -> None:
        """The optimizer step begins (on the loop's thread): every tick seen, the moves
        up to its first op fired, the dispatch mode back for its ops (followed op by op
        from there)."""
        if self.active:
            if self.j != len(self.expected):
                self.depart(f"{len(self.expected) - self.j} ticks of the profile did not come before the "
                            "optimizer step")
            else:
                self._advance(self.opt_start)
                self.run._followed_to(self.opt_start)
                if self.native_optimizer and not self.run._stale:
                    for k in range(self.opt_start + 1, self.n_seg):  # (all of the step's, resident now)
                        if self.seg_tensors[k]:
                            self._arrive(k)
                    return  # (the mode stays off through the step: finish() at its end)
        self.restore()

    def finish(self) -> None:
        """The iteration ends with the follower still on (no optimizer step, or one run
        without the mode)."""
        if self.active and self.j == len(self.expected):
            self._advance(self.n_seg)
            self.run._followed_to(self.n_seg)
        self.restore()

    def depart(self, why: str) -> None:
        """The iteration left its trace: no more planned moves. On the loop's thread the
        dispatch mode comes back at once and the rest runs on the pager, as any departure
        does. On another (autograd's backward thread on CUDA) the mode cannot be put
        back for the loop's thread: until it can, ticks only bring back what they touch
        (an unpacked tensor, a module's parameters), and nothing leaves."""
        if not self.active:
            return
        run = self.run
        run._ledger.remove(int(self.unseen[min(self.seg, self.n_seg)]))
        self.active = False
        run._depart("departure at a tick")
        run._mark_stale(why)
        if threading.get_ident() == self.thread:
            self.restore()
        else:
            self.degraded = True

    def close(self) -> None:
        """The block closes mid-iteration (an exception): the mode back where it was."""
        self.restore()

    def restore(self) -> None:
        """The dispatch mode back on the stack and the module hooks off (the loop's
        thread; idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.active = self.degraded = False
        if self.off_mode:
            self.off_mode = False
            self.run._mode.__enter__()

    # -- ticks ---------------------------------------------------------------------------
    def tick(self, kind: str, ident: str | None) -> bool:
        """A tick fired: True if it is the one expected (the segment it starts reached),
        False after a departure. ``ident`` None: not checked (an unpacked storage the
        follower did not bind: it cannot say which saved tensor it is)."""
        if self.j >= len(self.expected):
            self.depart(f"a {kind} tick ({ident}) after the last the profile had")
            return False
        want_kind, want_ident, seg = self.expected[self.j]
        if kind != want_kind or (ident is not None and ident != want_ident):
            self.depart(f"tick {self.j}: {kind} {ident!r}, the profile had {want_kind} {want_ident!r}")
            return False
        self.j += 1
        if seg > self.seg:
            self._advance(seg)
        return True

    def _advance(self, seg: int) -> None:
        """Segments ``self.seg .. seg - 1`` are done: their moves fired, ``seg`` begins."""
        run = self.run
        if run._dead or run._tiers.frees or run._mover.writes or run._ledger.leaving:
            run._mover.reap()
        for k in range(self.seg, min(seg, self.n_seg)):
            if run._has_moves[k]:
                run._follower.fire(run._actions, k)
                if run._stale:
                    return
        delta = int(self.unseen[min(seg, self.n_seg)]) - int(self.unseen[self.seg])
        run._ledger.add(delta)
        self.seg = seg
        run._followed_to(seg)
        if seg < self.n_seg and self.seg_tensors[seg]:
            self._arrive(seg)
        if run._pending:
            run._follower.issue_pending(run._hinted)
        if delta > 0:
            run._note_peak()

    def _arrive(self, seg: int) -> None:
        """Segment ``seg``'s bound tensors resident before its ops run."""
        run = self.run
        entries = run._iter_entries
        for tid in self.seg_tensors[seg]:
            e = entries[tid]
            if e is not None and (e.state is not RESIDENT or e.arrival is not None):
                run._ensure_resident(e)

    def _enter(self, mod: Any, _args: Any) -> None:
        path = self._paths.get(id(mod))
        if path is None:
            return
        if self.active:
            self.tick("enter", path)
        elif self.degraded:  # (after a departure off the loop's thread: its parameters back)
            run = self.run
            for p in mod.parameters(recurse=False):
                e = run._entries.get(p.untyped_storage()._cdata)
                if e is not None and e.state is not RESIDENT:
                    run._ensure_resident(e)

    def _leave(self, mod: Any, _args: Any, _out: Any) -> None:
        path = self._paths.get(id(mod))
        if path is not None and self.active:
            self.tick("leave", path)

    def pack(self, t: torch.Tensor) -> None:
        """The pack hook: the ``pack_seq``-th saved tensor, bound as the profile saw it."""
        if not self.active:
            return
        seq = self.pack_seq
        self.pack_seq = seq + 1
        if not self.tick("pack", str(seq)):
            return
        self._bind(t, f"saved:{seq}", "activation", f"saved{seq}")

    def unpack(self, t: torch.Tensor) -> None:
        """The unpack hook: right before the backward node that reads ``t``."""
        run = self.run
        e = run._entries.get(t.untyped_storage()._cdata) if getattr(t, run._dev_attr) is True else None
        if self.active:
            self.tick("unpack", e.key if e is not None and e.key else None)
        if e is not None and (e.state is not RESIDENT or e.arrival is not None):
            run._ensure_resident(e)

    def grad(self, name: str, g: torch.Tensor) -> None:
        if self.active and self.tick("grad", name):
            self._bind(g, f"grad:{name}", "gradient", f"{name}.grad")

    def _bind(self, t: torch.Tensor, key: str, kind: str, name: str) -> None:
        """``t`` is trace tensor ``key``: bound (counted from now) if its size is the
        trace's; a departure if not."""
        tid = self.key_tid.get(key)
        if tid is None or tid not in self.moved or self.tensors[tid].external or self.tensors[tid].bytes == 0:
            # (not a tensor of the trace, or one the plan never moves: the loop's, made
            # before the block and not the budget's)
            return
        run = self.run
        e = run._storages.entry(t, name)
        if e is None:
            return
        if e.nbytes != self.tensors[tid].bytes and not e.foreign:
            self.depart(f"{key} has {e.nbytes} bytes, the trace has {self.tensors[tid].bytes}")
            return
        table = run._storages
        table.label(e, kind, key, name)
        table.bind(tid, e)
        table.note_peak()  # (counted from here: see the module docstring)


__all__ = ["FOLLOW_CHOICES", "HookFollower", "coarse_sigs"]
