"""The profiled iteration's record, owned by one component.

While an iteration is profiled, the executor's general path hands each op it ran to
:class:`ProfileRecord` (its name, phase, host time, the trace ids it read and wrote,
its signature for the follower, on CUDA the events around it); the CUDA kernel timer
(:mod:`.kernel_times`) runs under it. When the iteration ends the profiler
(:mod:`.profiling`) takes the record with :meth:`ProfileRecord.finish`: the ops with
their best measured times, less the ops the runtime's own saved-tensor hooks caused.
Nothing else writes the record: the executor adds to it, the profiler reads it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .kernel_times import KernelTimer, KernelTimes

#: One recorded op: (name, phase, seconds, trace ids read, trace ids written).
RecordedOp = tuple[str, str, float, list[int], list[int]]


@dataclass(frozen=True)
class Recorded:
    """A profiled iteration's ops, as :meth:`ProfileRecord.finish` hands them over.

    ``ops``: each kept op with its best measured time (kernel time, else the events
    around it on CUDA, else the host's clock; ``timing`` says which). ``sigs``: each kept
    op's ``(func, ins, outs, in sizes, out sizes)``, for the follower's tables. ``kept``:
    the recorded index of each kept op; ``last_kept(j)``: the index among the kept ops
    of the last one at or before recorded op ``j``. ``kernels``: the kernel timer's
    result (CUDA), or None.
    """

    ops: list[RecordedOp]
    sigs: list[tuple]
    kept: list[int]
    dropped: bool
    last_kept: Callable[[int], int]
    kernels: KernelTimes | None
    timing: str


class ProfileRecord:
    """The ops of the iteration being profiled, and the storages the loop held when it
    began.

    Args:
        device: the run's device (CUDA: ops are timed by their kernels or by events).

    Example:
        >>> rec = ProfileRecord(torch.device("cpu"))
        >>> rec.begin(recording=True, time_kernels=False)
        >>> rec.add(None, "mm", "forward", 0.001, [0, 1], [2], [64, 64], [32])
        0
        >>> done = rec.finish()
        >>> [op[0] for op in done.ops], done.timing
        (['mm'], 'measured')
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._ops: list[RecordedOp] = []
        self._sigs: list[tuple] = []
        self._events: list[tuple[Any, Any]] = []  # CUDA: (start, end) per recorded op
        self._hook_ops: list[int] = []  # recorded ops our saved-tensor hooks caused (see _unpack)
        self._timer: KernelTimer | None = None  # CUDA: the torch profiler timing kernels
        self._held: list[Any] = []  # storage records the loop held when the iteration began

    def begin(self, recording: bool, time_kernels: bool) -> None:
        """An iteration begins: forget the last record; ``recording`` and
        ``time_kernels`` (CUDA, not a warm-up): start the kernel timer, where the torch
        profiler can run here (else each op's events are the fallback)."""
        self.close()  # (a profiled iteration that never ended)
        self._timer = KernelTimer.start() if recording and time_kernels else None
        self._ops, self._sigs, self._events, self._hook_ops = [], [], [], []

    @property
    def timer(self) -> KernelTimer | None:
        """The kernel timer of the iteration being profiled (for ``kernel_times.mark``)."""
        return self._timer

    @property
    def ops(self) -> list[RecordedOp]:
        """The ops recorded so far (read only: :meth:`add` adds to them)."""
        return self._ops

    def __len__(self) -> int:
        return len(self._ops)

    def add(self, func: Any, name: str, phase: str, seconds: float, in_ids: list[int], out_ids: list[int],
            in_sizes: list[int], out_sizes: list[int], events: tuple[Any, Any] | None = None) -> int:
        """Record an op the iteration ran; its index. ``in_ids``/``out_ids``: the trace
        ids of what it read and wrote, in the op's order (repeats kept: the follower
        binds by position); ``events``: CUDA, the events recorded around it."""
        self._ops.append((name, phase, seconds, list(dict.fromkeys(in_ids)), list(dict.fromkeys(out_ids))))
        self._sigs.append((func, in_ids, out_ids, in_sizes, out_sizes))
        if events is not None:
            self._events.append(events)
        return len(self._ops) - 1

    def add_hook_op(self, j: int) -> None:
        """Recorded op ``j`` was autograd's, caused by our unpack hook: it is left out of
        the trace (the iterations that follow the plan run without the hooks)."""
        self._hook_ops.append(j)

    def hold(self, entries: list[Any]) -> None:
        """The storage records the loop held on the device as the iteration began."""
        self._held = entries

    def take_held(self) -> list[Any]:
        """What :meth:`hold` was given, once (then forgotten)."""
        held, self._held = self._held, []
        return held

    def close(self) -> None:
        """Stop the kernel timer, if one runs (a profiled iteration cut short)."""
        if self._timer is not None:
            self._timer.close()
            self._timer = None

    def finish(self) -> Recorded:
        """The record of the iteration that just ended (then forgotten, but for its
        ops, which :attr:`ops` still shows)."""
        kernels = None
        if self._timer is not None:  # CUDA: each op's kernel time (kernel_times)
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
            kernels, self._timer = self._timer.stop(len(self._ops)), None
        kernel_s = kernels.op_s if kernels is not None and kernels.usable else []
        n_recorded = len(self._ops)
        kept, last_kept, dropped = self._drop_hook_ops()
        ops, events = self._ops, self._events
        if dropped and len(events) == n_recorded:
            events = [events[j] for j in kept]
        if dropped and len(kernel_s) == n_recorded:
            kernel_s = [kernel_s[j] for j in kept]
        timing = "measured"
        if kernel_s and len(kernel_s) == len(ops):
            # CUDA: the GPU time of the kernels each op launched (the torch profiler's
            # CUDA activity; runtime/kernel_times.py), without the launch gaps events see
            ops = [(n, ph, d, i, o) for (n, ph, _d, i, o), d in zip(ops, kernel_s)]
            timing = "measured: kernel time (torch profiler)"
        elif events and len(events) == len(ops):
            # CUDA: each op's time on the compute stream between events recorded around
            # it (the host's time around a launch says nothing of the kernel); gaps where
            # the GPU waited for the launch are in it, the runtime's own work between ops
            # is not
            torch.cuda.synchronize(self._device)
            ops = [(n, ph, a.elapsed_time(b) / 1e3, i, o) for (n, ph, _d, i, o), (a, b) in zip(ops, events)]
        sigs = self._sigs
        self._events, self._hook_ops, self._sigs = [], [], []
        return Recorded(ops, sigs, kept, dropped, last_kept, kernels, timing)

    def _drop_hook_ops(self) -> tuple[list[int], Callable[[int], int], bool]:
        """Leave out the ops our saved-tensor hooks caused (autograd's ``detach`` of what
        the unpack hook returned): the iterations that follow the plan run without the
        hooks (``_hooks_off_for_iteration``), so they do not have them. Returns the kept
        ops' recorded indices, the map from a recorded op's index to the index of the
        last op kept at or before it, and whether any op was left out."""
        drop = set(self._hook_ops)
        n = len(self._ops)
        if not drop:
            return list(range(n)), (lambda j: j), False
        keep = [j for j in range(n) if j not in drop]
        self._ops = [self._ops[j] for j in keep]
        self._sigs = [self._sigs[j] for j in keep]
        # an op index of the recorded iteration -> the last kept op at or before it
        return keep, (lambda j: bisect.bisect_right(keep, j) - 1), True


__all__ = ["ProfileRecord", "Recorded", "RecordedOp"]
