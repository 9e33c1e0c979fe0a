"""benchmarks/gpu_timeline.py: the compute stream's idle time split into waiting on a
copy, on a host synchronization and on the host's launches, on a synthetic event list
(and the same events read back from a gzipped Chrome trace)."""

from __future__ import annotations

import gzip
import json

import pytest

from helpers import load_benchmark

tl = load_benchmark("gpu_timeline")
G, H = tl.GpuSpan, tl.HostCall

# (microseconds) four kernels on stream 7; copies on stream 20; one host sync
GPU = [G(0, 10, 7, 1), G(20, 30, 7, 2), G(50, 60, 7, 3), G(70, 100, 7, 4),
       G(5, 18, 20, 90), G(66, 69, 20, 91)]
HOST = [H("cudaLaunchKernel", -5, -4, 1), H("cudaLaunchKernel", 12, 13, 2), H("cudaLaunchKernel", 45, 46, 3),
        H("cudaLaunchKernel", 65, 66, 4), H("cudaStreamSynchronize", 32, 44), H("cudaStreamWaitEvent", 14, 15, 99)]


def test_idle_time_is_split_by_what_the_next_kernel_waited_for():
    out = tl.idle_attribution(GPU, HOST, (0, 100))
    assert out["compute_stream"] == 7 and out["kernels"] == 4 and out["launches_matched"] == 4
    assert out["busy_us"] == pytest.approx(60) and out["gpu_busy_pct"] == pytest.approx(60)
    # gap 10-20: launched at 12 (2 us host-late), then the copy to 18 (6), 2 more of latency
    # gap 30-50: host in a sync 32-44 (12), late otherwise until the launch at 45 (3), then 5
    # gap 60-70: late until 65 (5), then the copy 66-69 (3) and 2 of latency
    assert out["copy_wait_us"] == pytest.approx(9)
    assert out["host_sync_us"] == pytest.approx(12)
    assert out["host_launch_us"] == pytest.approx(19)
    assert out["idle_us"] == pytest.approx(40) and out["gaps"] == 3


def test_tail_and_head_of_the_window_are_host_side():
    out = tl.idle_attribution([G(10, 20, 7, 1)], [H("cudaLaunchKernel", 9, 10, 1), H("cudaDeviceSynchronize", 20, 28)],
                              (0, 30))
    # head 0-9: nothing launched, no sync (launch); 9-10 launched, no copy (launch); tail 20-30: sync to 28
    assert out["host_launch_us"] == pytest.approx(10 + 2) and out["host_sync_us"] == pytest.approx(8)
    assert out["busy_us"] == pytest.approx(10) and out["gaps"] == 2


def test_a_kernel_whose_launch_is_unknown_counts_as_launched_late():
    # (a copy runs through the gap, but without the launch nothing says the kernel waited on it)
    out = tl.idle_attribution([G(0, 5, 7, 1), G(10, 15, 7, 0), G(5, 10, 20, 0)], [], (0, 15))
    assert out["compute_stream"] == 7
    assert out["host_launch_us"] == pytest.approx(5) and out["copy_wait_us"] == 0
    assert out["launches_matched"] == 0


def _chrome(events):
    return {"traceEvents": events}


def test_records_and_summary_from_a_gzipped_chrome_trace(tmp_path):
    events = [{"ph": "X", "cat": "user_annotation", "name": "gpu_check#step", "pid": 1, "tid": 1, "ts": 0, "dur": 100}]
    for g in GPU:
        events.append({"ph": "X", "cat": "kernel" if g.stream == 7 else "gpu_memcpy", "name": "k", "pid": 0,
                       "tid": g.stream, "ts": g.start, "dur": g.end - g.start,
                       "args": {"stream": g.stream, "correlation": g.correlation}})
    for h in HOST:
        events.append({"ph": "X", "cat": "cuda_runtime", "name": h.name, "pid": 1, "tid": 1, "ts": h.start,
                       "dur": h.end - h.start, "args": {"correlation": h.correlation}})
    events.append({"ph": "f", "cat": "ac2g", "name": "flow", "ts": 3})  # (not a span: ignored)
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_chrome(events), f)
    gpu, host, window = tl.records(tl.load_chrome_trace(str(path)), step_name="gpu_check#step")
    assert window == (0.0, 100.0) and len(gpu) == len(GPU) and len(host) == len(HOST)
    s = tl.summarize(str(path), step_name="gpu_check#step")
    assert (s["copy_wait_us"], s["host_sync_us"], s["host_launch_us"]) == pytest.approx((9, 12, 19))
    assert "error" in tl.summarize(str(path), step_name="other")
