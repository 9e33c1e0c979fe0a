"""Kernel-true op times on CUDA: each recorded op timed by the GPU time of the kernels it
launched, from the torch profiler's CUDA activity, not by CUDA events around it.

Why: events recorded on the compute stream before and after an op measure from the
first to the second *on the GPU's clock*, so every gap in which the GPU waited for the
host to launch the op's kernels is in the op's time. On an H100 (gpt2-medium b4 s512,
no budget) the step predicted from such op times was 250.6 ms against 147 ms measured
(1.70x): plans were made from launch gaps, not kernels.

How: while the profiled iteration runs, a ``torch.profiler`` session with CPU and CUDA
activity is open, and the dispatch mode runs op ``i`` inside a ``record_function`` range
named ``tierflow#i`` (:func:`mark`). The profiler links every device activity (kernel,
memcpy, memset) to the host op it was launched under (its *linked correlation id*, the
id of the innermost host op on the launching thread). That host op lies inside exactly
one ``tierflow#i`` range on its thread (the range around the aten op the mode ran; a
kernel launched under the range itself links to the range), so the kernel's time goes
to op ``i``. :func:`op_kernel_times` does that matching as a pure function over plain
records (unit-tested without a GPU); :class:`KernelTimer` runs the profiler and turns
its events into those records.

The check: activity linked to no op (a copy the runtime issued between ops, a library's
own launch) is counted apart. On the stream that ran most of the ops' kernels (the
compute stream) the attributed time must cover nearly all of that stream's busy time
(``COVERAGE``); otherwise the caller keeps its event timings and says so.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

MARK = "tierflow#"
COVERAGE = 0.9  # least share of the compute stream's kernel time the ops must explain


@dataclass(frozen=True)
class HostSpan:
    """An op or annotation the profiler saw on a host thread.

    Attributes:
        id: its correlation id (what device activity links to).
        name: ``aten::mm``, ``tierflow#12``, ...
        thread: the host thread it ran on.
        start_ns, end_ns: its span on the host's clock.
    """

    id: int
    name: str
    thread: int
    start_ns: int
    end_ns: int


@dataclass(frozen=True)
class DeviceSpan:
    """A kernel, memcpy or memset on the GPU.

    Attributes:
        name: the kernel's name.
        start_ns, end_ns: its span on the GPU (the profiler's clock).
        linked_id: the correlation id of the host op it was launched under (0: none).
        stream: the CUDA stream it ran on.
    """

    name: str
    start_ns: int
    end_ns: int
    linked_id: int
    stream: int


@dataclass
class KernelTimes:
    """Per-op GPU time and the check against the profiler's totals.

    Attributes:
        op_s: seconds of device activity per op, by op index.
        kernels: device activities seen; attributed: of which matched to an op.
        device_total_s: their total time; attributed_s: the part matched to ops.
        compute_stream: the stream with the most attributed time (-1: none).
        compute_stream_total_s: all activity on that stream (ops' or not);
        compute_stream_attributed_s: the part of it matched to ops.
        by_stream_s: activity per stream.
    """

    op_s: list[float]
    kernels: int = 0
    attributed: int = 0
    device_total_s: float = 0.0
    attributed_s: float = 0.0
    compute_stream: int = -1
    compute_stream_total_s: float = 0.0
    compute_stream_attributed_s: float = 0.0
    by_stream_s: dict[int, float] = field(default_factory=dict)

    @property
    def coverage(self) -> float:
        """Share of the compute stream's busy time the ops explain (0 if it has none)."""
        if self.compute_stream_total_s <= 0:
            return 0.0
        return min(1.0, self.compute_stream_attributed_s / self.compute_stream_total_s)

    @property
    def usable(self) -> bool:
        """Whether these times can replace event timings: the profiler saw device
        activity, and the ops explain at least :data:`COVERAGE` of the compute stream's."""
        return self.attributed > 0 and self.coverage >= COVERAGE

    def summary(self) -> dict[str, Any]:
        """The figures a trace's meta records (seconds, counts, the coverage)."""
        return {"kernels": self.kernels, "attributed": self.attributed,
                "device_total_s": self.device_total_s, "attributed_s": self.attributed_s,
                "compute_stream_total_s": self.compute_stream_total_s, "coverage": round(self.coverage, 4)}


def _mark_index(name: str, prefix: str, n_ops: int) -> int | None:
    if not name.startswith(prefix):
        return None
    tail = name[len(prefix):]
    if not tail.isdigit():
        return None
    i = int(tail)
    return i if i < n_ops else None


def op_kernel_times(n_ops: int, host: Iterable[HostSpan], device: Iterable[DeviceSpan], *,
                    prefix: str = MARK) -> KernelTimes:
    """Sum each op's device activity, by the host range ``prefix + str(i)`` around op ``i``.

    A device span belongs to op ``i`` when the host op it links to (``linked_id``) starts
    inside the range of op ``i`` on the same thread (the innermost such range, if ranges
    nest). Spans that link to nothing, or to a host op outside every range, are counted
    in the totals only.

    Args:
        n_ops: how many ops were marked (``op_s`` has this length; marks beyond are ignored).
        host: host spans (ops and annotations) with their correlation ids.
        device: device spans with the id of the host op they were launched under.
        prefix: the ranges' name prefix.

    Returns:
        :class:`KernelTimes`.
    """
    by_id: dict[int, HostSpan] = {}
    marks: dict[int, list[tuple[int, int, int]]] = {}  # thread -> [(start, end, op)], by start
    for h in host:
        if h.id:
            by_id[h.id] = h
        i = _mark_index(h.name, prefix, n_ops)
        if i is not None:
            marks.setdefault(h.thread, []).append((h.start_ns, h.end_ns, i))
    starts: dict[int, list[int]] = {}
    for th, ms in marks.items():
        ms.sort()
        starts[th] = [s for s, _e, _i in ms]
    out = KernelTimes(op_s=[0.0] * n_ops)
    per_stream: dict[int, float] = {}
    attributed_per_stream: dict[int, float] = {}
    for d in device:
        if d.name.startswith(prefix):
            # NOTE: the profiler projects each host range onto the GPU as a "user
            # annotation" spanning the range's kernels; counted as activity it doubled the
            # compute stream's time (an H200 run: coverage 0.47-0.50 on every row, so the
            # kernel times were thrown away for event timings that include launch gaps)
            continue
        dur = max(0, d.end_ns - d.start_ns) / 1e9
        out.kernels += 1
        out.device_total_s += dur
        per_stream[d.stream] = per_stream.get(d.stream, 0.0) + dur
        op = by_id.get(d.linked_id) if d.linked_id else None
        if op is None or op.thread not in marks:
            continue
        i = _enclosing(marks[op.thread], starts[op.thread], op.start_ns)
        if i is None:
            continue
        out.op_s[i] += dur
        out.attributed += 1
        out.attributed_s += dur
        attributed_per_stream[d.stream] = attributed_per_stream.get(d.stream, 0.0) + dur
    out.by_stream_s = per_stream
    if attributed_per_stream:
        s = max(attributed_per_stream, key=attributed_per_stream.__getitem__)
        out.compute_stream, out.compute_stream_total_s = s, per_stream[s]
        out.compute_stream_attributed_s = attributed_per_stream[s]
    return out


def _enclosing(ms: Sequence[tuple[int, int, int]], starts: Sequence[int], t: int) -> int | None:
    """The op of the innermost range in ``ms`` (sorted by start) that contains ``t``."""
    k = bisect.bisect_right(starts, t) - 1
    while k >= 0:  # (ranges do not nest in the runtime's use: one step back at most)
        s, e, i = ms[k]
        if s <= t <= e:
            return i
        k -= 1
    return None


def mark(timer: KernelTimer | None, i: int) -> contextlib.AbstractContextManager:
    """The range to run op ``i`` in: ``tierflow#i`` while ``timer`` profiles, else nothing."""
    return contextlib.nullcontext() if timer is None else timer.mark(i)


class KernelTimer:
    """A ``torch.profiler`` session with CPU and CUDA activity around one iteration.

    :meth:`start` returns None where the profiler cannot run (another profiler is
    already active, say the user's: they cannot nest; no CUDA activity in this build):
    the caller keeps its event timings.
    """

    def __init__(self, prof: Any):
        self._prof = prof

    @classmethod
    def start(cls) -> KernelTimer | None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        enabled = getattr(torch._C._autograd, "_profiler_enabled", None)
        if getattr(torch.autograd.profiler, "_is_profiler_enabled", False) or (enabled is not None and enabled()):
            return None
        try:
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        except Exception:  # NOTE: a timing aid must never stop training: events instead
            return None
        return cls(prof)

    def mark(self, i: int) -> contextlib.AbstractContextManager:
        """The host range op ``i`` runs in (its kernels are found by it)."""
        from torch.autograd.profiler import record_function

        return record_function(f"{MARK}{i}")

    def stop(self, n_ops: int) -> KernelTimes | None:
        """End the session; the ops' kernel times (None if its events could not be read)."""
        prof, self._prof = self._prof, None
        if prof is None:
            return None
        try:
            prof.__exit__(None, None, None)
            host, device = records(prof.profiler.kineto_results.events())
            return op_kernel_times(n_ops, host, device)
        except Exception:  # NOTE: (as in start) another torch's event API, say: events instead
            return None

    def close(self) -> None:
        """End the session, if still open, reading nothing (an iteration cut short)."""
        prof, self._prof = self._prof, None
        if prof is not None:
            with contextlib.suppress(Exception):
                prof.__exit__(None, None, None)


def records(events: Iterable[Any]) -> tuple[list[HostSpan], list[DeviceSpan]]:
    """Host and device spans from the profiler's kineto events.

    Host ops and annotations are the CPU events that link to nothing themselves (the
    CUDA runtime's calls, ``cudaLaunchKernel``, are CPU events linked to the op they
    serve; their own ids are CUPTI's and could collide with ops' ids). Device spans are
    the events on a CUDA device, linked to the host op they were launched under, less the
    GPU side of annotations (``record_function`` ranges drawn over the kernels they
    launched: not activity of their own).
    """
    from torch.autograd import DeviceType

    host: list[HostSpan] = []
    device: list[DeviceSpan] = []
    for e in events:
        dt = e.device_type()
        start = int(e.start_ns())
        end = start + int(e.duration_ns())
        if dt == DeviceType.CPU:
            if e.linked_correlation_id() == 0:
                host.append(HostSpan(int(e.correlation_id()), e.name(), int(e.start_thread_id()), start, end))
        elif dt == DeviceType.CUDA:
            if _is_annotation(e):
                continue
            device.append(DeviceSpan(e.name(), start, end, int(e.linked_correlation_id()),
                                     int(e.device_resource_id())))
    return host, device


def _is_annotation(e: Any) -> bool:
    """Whether a device event is the GPU side of a ``record_function`` range."""
    flag = getattr(e, "is_user_annotation", None)
    if flag is not None:
        try:
            if flag():
                return True
        except Exception:  # (another torch's binding: fall back to the activity's name)
            pass
    kind = getattr(e, "activity_type", None)
    try:
        return kind is not None and "annotation" in str(kind()).lower()
    except Exception:
        return False
