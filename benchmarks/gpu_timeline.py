"""Where the compute stream is idle in one profiled step: read a ``torch.profiler`` Chrome
trace and split the GPU's idle time by what it waited for.

Used by ``gpu_check.py --out`` (one planned step per budgeted tierflow row). Three causes,
decided for each idle gap of the compute stream (the stream with the most kernel time),
from the kernel that ends the gap (``K``), the host call that launched it (matched by
the trace's ``correlation`` id) and what else ran at the time:

* **copy** -- ``K`` had been launched but did not start, and a copy on another stream
  ran during that time: the compute stream waited on an event recorded after that copy
  (the runtime's fetches end in such a wait);
* **sync** -- ``K`` was not launched yet and the host was in a synchronizing call
  (``cudaStreamSynchronize``, ``cudaEventSynchronize``, ``cudaDeviceSynchronize``, a
  blocking ``cudaMemcpy``) at that time;
* **launch** -- neither: the host was busy elsewhere (Python, the runtime's bookkeeping)
  and had not launched ``K`` yet, or ``K`` was launched with no copy running (launch
  latency).

The split is by time: a gap can be partly each. :func:`idle_attribution` is a pure
function over plain records (tested on a synthetic event list); :func:`load_chrome_trace`
turns a trace file into those records.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATS = {"cuda_runtime", "cuda_driver"}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cuStreamSynchronize",
              "cuEventSynchronize", "cuCtxSynchronize")
BLOCKING_COPIES = ("cudaMemcpy", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2")  # (exact names: not the Async ones)


@dataclass(frozen=True)
class GpuSpan:
    """A kernel, memcpy or memset: microseconds on the trace's clock, its stream, and the
    correlation id of the host call that launched it (0: unknown)."""

    start: float
    end: float
    stream: int
    correlation: int = 0
    name: str = ""


@dataclass(frozen=True)
class HostCall:
    """A CUDA runtime or driver call on a host thread (microseconds)."""

    name: str
    start: float
    end: float
    correlation: int = 0


def _union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _overlap(a: float, b: float, spans: Sequence[tuple[float, float]]) -> float:
    """Time in [a, b] covered by ``spans`` (a sorted union)."""
    if b <= a:
        return 0.0
    return sum(max(0.0, min(b, e) - max(a, s)) for s, e in spans if e > a and s < b)


def is_sync(name: str) -> bool:
    return name in SYNC_CALLS or name in BLOCKING_COPIES or name.endswith("Synchronize")


def idle_attribution(gpu: Sequence[GpuSpan], host: Sequence[HostCall], window: tuple[float, float],
                     compute_stream: int | None = None) -> dict[str, Any]:
    """Busy and idle time of the compute stream in ``window``, the idle time split into
    waiting on a copy, on a host synchronization, and on the host's launches.

    Args:
        gpu: every kernel, memcpy and memset (all streams).
        host: the CUDA runtime/driver calls (launches, synchronizations, event waits).
        window: the step, ``(start, end)`` in microseconds.
        compute_stream: the stream to judge; default the one with the most kernel time.

    Returns:
        ``window_us``, ``busy_us``, ``idle_us``, ``gpu_busy_pct``, ``copy_wait_us``,
        ``host_sync_us``, ``host_launch_us`` (the three sum to ``idle_us``), ``gaps``,
        ``kernels``, ``compute_stream`` and ``launches_matched`` (kernels whose launch
        call was found).
    """
    w0, w1 = window
    if compute_stream is None:
        per: dict[int, float] = {}
        for g in gpu:
            per[g.stream] = per.get(g.stream, 0.0) + (g.end - g.start)
        compute_stream = max(per, key=per.__getitem__) if per else -1
    mine = sorted((g for g in gpu if g.stream == compute_stream and g.end > w0 and g.start < w1),
                  key=lambda g: g.start)
    copies = _union((g.start, g.end) for g in gpu if g.stream != compute_stream)
    syncs = _union((h.start, h.end) for h in host if is_sync(h.name))
    launch = {h.correlation: h.start for h in host if h.correlation and not is_sync(h.name)}
    out = {"window_us": w1 - w0, "busy_us": 0.0, "idle_us": 0.0, "copy_wait_us": 0.0, "host_sync_us": 0.0,
           "host_launch_us": 0.0, "gaps": 0, "kernels": len(mine), "compute_stream": compute_stream,
           "launches_matched": sum(1 for g in mine if g.correlation in launch)}

    def host_side(a: float, b: float) -> None:
        if b <= a:
            return
        s = _overlap(a, b, syncs)
        out["host_sync_us"] += s
        out["host_launch_us"] += (b - a) - s

    t = w0  # the compute stream is idle from t until the next kernel starts
    for g in mine:
        s, e = max(g.start, w0), min(g.end, w1)
        if s > t:
            out["gaps"] += 1
            launched = launch.get(g.correlation, s)  # (unknown launch: as if launched late)
            cut = min(max(launched, t), s)
            host_side(t, cut)  # not launched yet
            c = _overlap(cut, s, copies)  # launched, not started
            out["copy_wait_us"] += c
            out["host_launch_us"] += (s - cut) - c
        out["busy_us"] += max(0.0, e - max(s, t))
        t = max(t, e)
    if w1 > t:
        out["gaps"] += 1
        host_side(t, w1)
    out["idle_us"] = out["copy_wait_us"] + out["host_sync_us"] + out["host_launch_us"]
    out["gpu_busy_pct"] = 100.0 * out["busy_us"] / (w1 - w0) if w1 > w0 else None
    return out


def load_chrome_trace(path: str) -> dict[str, Any]:
    """A Chrome trace as ``torch.profiler``'s ``export_chrome_trace`` writes it (``.gz`` too)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def records(trace: dict[str, Any], *, step_name: str) -> tuple[list[GpuSpan], list[HostCall], tuple[float, float] | None]:
    """GPU spans, host CUDA calls and the window of the annotation ``step_name`` (None if
    the trace has no such annotation) from a Chrome trace's events."""
    gpu: list[GpuSpan] = []
    host: list[HostCall] = []
    window = None
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or "ts" not in ev:
            continue
        cat = str(ev.get("cat", "")).lower()
        ts, dur = float(ev["ts"]), float(ev.get("dur", 0.0))
        args = ev.get("args") or {}
        if cat in DEVICE_CATS:
            stream = args.get("stream", ev.get("tid", -1))
            gpu.append(GpuSpan(ts, ts + dur, int(stream) if str(stream).lstrip("-").isdigit() else -1,
                               int(args.get("correlation", 0) or 0), str(ev.get("name", ""))))
        elif cat in HOST_CATS:
            host.append(HostCall(str(ev.get("name", "")), ts, ts + dur, int(args.get("correlation", 0) or 0)))
        elif ev.get("name") == step_name and cat in ("user_annotation", "cpu_op"):
            window = (ts, ts + dur)
    return gpu, host, window


def summarize(path: str, *, step_name: str) -> dict[str, Any]:
    """:func:`idle_attribution` of the step ``step_name`` in the trace at ``path``. Without
    GPU activity (a CPU run) only the window and the counts are filled in."""
    gpu, host, window = records(load_chrome_trace(path), step_name=step_name)
    if window is None:
        return {"error": f"{path}: no {step_name!r} annotation"}
    if not gpu:
        return {"window_us": window[1] - window[0], "kernels": 0, "gpu_busy_pct": None,
                "note": "no GPU activity in the trace (CPU run)"}
    return idle_attribution(gpu, host, window)
