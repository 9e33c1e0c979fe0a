"""Kernel-true op times (runtime/kernel_times.py): device activity summed per op by the
host range around it, on synthetic profiler records (no GPU needed), and the records
read from a real CPU profiler session."""

from __future__ import annotations

import pytest
import torch

from tierflow.runtime.kernel_times import (
    COVERAGE,
    DeviceSpan,
    HostSpan,
    KernelTimer,
    mark,
    op_kernel_times,
    records,
)

MAIN, BWD = 11, 22  # host threads: the loop's and autograd's


def _synthetic():
    host = [
        HostSpan(1, "tierflow#0", MAIN, 100, 200),
        HostSpan(2, "aten::mm", MAIN, 110, 190),  # op 0's aten op: its kernels link here
        HostSpan(3, "tierflow#1", MAIN, 300, 400),
        HostSpan(4, "aten::add", MAIN, 310, 390),
        HostSpan(5, "aten::copy_", MAIN, 450, 460),  # between marks: the runtime's own copy
        HostSpan(6, "tierflow#2", BWD, 305, 500),  # op 2 ran on autograd's thread, overlapping op 1's time
        HostSpan(7, "aten::mm", BWD, 320, 480),
    ]
    device = [
        DeviceSpan("gemm", 1_000, 4_000, 2, 7),  # op 0: 3 us
        DeviceSpan("gemm_splitk", 4_000, 5_000, 2, 7),  # op 0: 1 us more
        DeviceSpan("add", 9_000, 9_500, 4, 7),  # op 1: 0.5 us
        DeviceSpan("bwd_gemm", 10_000, 12_000, 7, 7),  # op 2 (its thread's range): 2 us
        DeviceSpan("direct", 12_000, 12_250, 6, 7),  # linked to op 2's range itself
        DeviceSpan("Memcpy DtoH", 6_000, 8_000, 5, 20),  # runtime's copy: no op
        DeviceSpan("lib_init", 0, 100, 0, 7),  # linked to nothing
    ]
    return host, device


def test_kernels_are_summed_per_op_by_the_range_around_their_host_op():
    host, device = _synthetic()
    kt = op_kernel_times(3, host, device)
    assert kt.op_s == pytest.approx([4e-6, 0.5e-6, 2.25e-6])
    assert kt.kernels == 7 and kt.attributed == 5
    assert kt.device_total_s == pytest.approx((3000 + 1000 + 500 + 2000 + 250 + 2000 + 100) / 1e9)
    assert kt.attributed_s == pytest.approx(sum(kt.op_s))
    # the compute stream (7) is the one the ops ran on; the copy stream is not held against them
    assert kt.compute_stream == 7
    assert kt.compute_stream_total_s == pytest.approx(6850 / 1e9)
    assert kt.coverage == pytest.approx(6750 / 6850) and kt.usable


def test_threads_keep_their_own_ranges():
    """A host op on autograd's thread inside the *main* thread's range of op 1 (by time)
    is op 2's: ranges are matched on the launching thread."""
    host, device = _synthetic()
    kt = op_kernel_times(3, host, device)
    assert kt.op_s[1] == pytest.approx(0.5e-6)


def test_marks_beyond_the_op_count_and_other_names_are_ignored():
    host = [HostSpan(1, "tierflow#5", MAIN, 0, 10), HostSpan(2, "tierflow#x", MAIN, 20, 30),
            HostSpan(3, "other#0", MAIN, 40, 50)]
    device = [DeviceSpan("k", 0, 1000, i, 7) for i in (1, 2, 3)]
    kt = op_kernel_times(2, host, device)
    assert kt.op_s == [0.0, 0.0] and kt.attributed == 0 and not kt.usable and kt.coverage == 0.0


def test_low_coverage_is_not_usable():
    """Ops that explain under COVERAGE of the compute stream: the caller keeps events."""
    host = [HostSpan(1, "tierflow#0", MAIN, 0, 10)]
    device = [DeviceSpan("k", 0, 1000, 1, 7), DeviceSpan("stray", 2000, 12000, 0, 7)]
    kt = op_kernel_times(1, host, device)
    assert kt.attributed == 1 and kt.coverage == pytest.approx(1000 / 11000)
    assert kt.coverage < COVERAGE and not kt.usable


def test_nested_ranges_give_the_innermost():
    host = [HostSpan(1, "tierflow#0", MAIN, 0, 100), HostSpan(2, "tierflow#1", MAIN, 10, 20),
            HostSpan(3, "aten::a", MAIN, 12, 18), HostSpan(4, "aten::b", MAIN, 50, 60)]
    device = [DeviceSpan("k1", 0, 100, 3, 7), DeviceSpan("k2", 200, 500, 4, 7)]
    kt = op_kernel_times(2, host, device)
    assert kt.op_s == pytest.approx([300e-9, 100e-9])


def test_records_from_a_real_profiler_session_link_ops_to_their_marks():
    """On the CPU: the profiler's host events come out as spans with their threads and
    ids, the marks among them; device spans linked to the aten ops' ids (as CUDA kernels
    would be) are attributed to the op whose mark encloses them. (Threads: the synthetic
    tests; a CPU backward runs on the caller's thread.)"""
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(64, 64, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.autograd.profiler.record_function("tierflow#0"):
            b = torch.mm(a, a)
        with torch.autograd.profiler.record_function("tierflow#1"):
            c = torch.add(b, b)
        with torch.autograd.profiler.record_function("tierflow#2"):
            torch.mul(c, c)
    host, device = records(prof.profiler.kineto_results.events())
    assert device == []  # (no GPU here)
    names = {h.name: h for h in host}
    assert {"tierflow#0", "tierflow#1", "tierflow#2"} <= set(names)
    assert all(h.end_ns >= h.start_ns for h in host)
    op_id = {n: names[n].id for n in ("aten::mm", "aten::add", "aten::mul")}
    assert all(op_id.values()) and len(set(op_id.values())) == 3
    fake = [DeviceSpan("k", 0, 1000 * (k + 1), op_id[n], 7) for k, n in enumerate(("aten::mm", "aten::add", "aten::mul"))]
    kt = op_kernel_times(3, host, fake)
    assert kt.op_s == pytest.approx([1e-6, 2e-6, 3e-6]) and kt.usable


def test_the_gpu_side_of_the_op_ranges_is_not_counted_as_activity():
    """The profiler draws each ``tierflow#i`` range on the GPU too, over the kernels it
    launched. Counted as activity, it doubled the compute stream's time, the coverage
    fell to one half and the kernel times were thrown away (seen on an H200, 2026-11-27:
    coverage 0.47-0.50 on every row)."""
    host, device = _synthetic()
    plain = op_kernel_times(3, host, device)
    drawn = device + [DeviceSpan("tierflow#0", 1_000, 5_000, 1, 7), DeviceSpan("tierflow#1", 9_000, 9_500, 3, 7),
                      DeviceSpan("tierflow#2", 10_000, 12_250, 6, 7)]
    kt = op_kernel_times(3, host, drawn)
    assert kt.op_s == plain.op_s
    assert (kt.kernels, kt.attributed) == (plain.kernels, plain.attributed)
    assert kt.compute_stream_total_s == plain.compute_stream_total_s and kt.usable


class _Event:
    """A stand-in for the profiler's kineto event (the methods records reads)."""

    def __init__(self, name, device, start, dur, cid, linked, stream=0, annotation=False):
        self._v = (name, device, start, dur, cid, linked, stream, annotation)

    def name(self): return self._v[0]
    def device_type(self): return self._v[1]
    def start_ns(self): return self._v[2]
    def duration_ns(self): return self._v[3]
    def correlation_id(self): return self._v[4]
    def linked_correlation_id(self): return self._v[5]
    def start_thread_id(self): return MAIN
    def device_resource_id(self): return self._v[6]
    def is_user_annotation(self): return self._v[7]
    def activity_type(self): return "gpu_user_annotation" if self._v[7] else "kernel"


def test_records_leave_out_device_annotations():
    from torch.autograd import DeviceType

    events = [_Event("tierflow#0", DeviceType.CPU, 100, 100, 1, 0, annotation=True),
              _Event("aten::mm", DeviceType.CPU, 110, 80, 2, 0),
              _Event("cudaLaunchKernel", DeviceType.CPU, 120, 5, 9, 2),
              _Event("gemm", DeviceType.CUDA, 1_000, 3_000, 9, 2, stream=7),
              _Event("tierflow#0", DeviceType.CUDA, 1_000, 3_000, 10, 1, stream=7, annotation=True),
              _Event("my range", DeviceType.CUDA, 900, 3_200, 11, 1, stream=7, annotation=True)]
    host, device = records(events)
    assert [h.name for h in host] == ["tierflow#0", "aten::mm"]
    assert [d.name for d in device] == ["gemm"]
    kt = op_kernel_times(1, host, device)
    assert kt.op_s == pytest.approx([3e-6]) and kt.coverage == 1.0


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_timer_without_cuda_activity_gives_nothing_usable_and_mark_is_inert_without_a_timer():
    with mark(None, 3):  # no timer: no range, nothing recorded
        pass
    timer = KernelTimer.start()
    if timer is None:
        pytest.skip("this build's profiler cannot take CUDA activity")
    with mark(timer, 0):
        torch.randn(8).sum()
    kt = timer.stop(1)
    assert kt is not None and kt.kernels == 0 and not kt.usable
    assert timer.stop(1) is None  # (stopped once)


def test_timer_does_not_start_inside_another_profiler():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]):
        assert KernelTimer.start() is None


class _FakeTimer:
    """Stands in for the profiler on the CPU: op ``i`` took ``(i + 1)`` ms of kernels."""

    started = 0

    @classmethod
    def start(cls):
        cls.started += 1
        return cls()

    def stop(self, n_ops):
        from tierflow.runtime.kernel_times import KernelTimes

        op_s = [(i + 1) * 1e-3 for i in range(n_ops)]
        return KernelTimes(op_s=op_s, kernels=n_ops, attributed=n_ops, device_total_s=sum(op_s),
                           attributed_s=sum(op_s), compute_stream=7, compute_stream_total_s=sum(op_s),
                           compute_stream_attributed_s=sum(op_s))

    def close(self):
        pass


def test_profiled_trace_takes_the_kernel_times_op_by_op(monkeypatch):
    """The runtime's hook-up: the profiled (not the warm-up) iteration's ops get the
    timer's per-op times, aligned after the ops the runtime's own hooks caused are left
    out, and the trace says how it was timed. (CPU, with the timer faked: the CUDA path
    differs only in the profiler it starts.)"""
    import tierflow
    from tierflow.capture import zoo
    from tierflow.runtime import executor, profile_record

    monkeypatch.setattr(profile_record, "KernelTimer", _FakeTimer)  # (the profiled iteration's record starts it)
    monkeypatch.setattr(executor.Run, "_times_kernels", lambda self: True)
    _FakeTimer.started = 0
    m = zoo.build("gpt-tiny", seed=0)
    opt = torch.optim.AdamW(m.model.parameters())
    x, y = m.make_batch(2, 16)
    with tierflow.offload(m.model, opt, budget="60%") as run:
        for _ in range(3):
            m.loss_fn(m.model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert _FakeTimer.started == 1  # the profiled iteration only (not Adam's warm-up)
    tr = run.trace
    assert tr.meta["timing"] == "measured: kernel time (torch profiler)"
    assert tr.meta["kernel_times"]["coverage"] == 1.0
    durations = [o.duration_s for o in tr.ops]
    # strictly increasing: each op kept its own recorded index's time, in order, with
    # the hook ops (if any) cut out of both lists alike
    assert all(b > a for a, b in zip(durations, durations[1:]))
    assert durations[0] == pytest.approx(1e-3)
    assert round(durations[-1] * 1e3) > len(durations)  # (hook ops were cut out here: alignment exercised)


def test_a_timer_whose_events_cannot_be_read_gives_none_not_an_error():
    """The profiled iteration must never fail for its timing aid: the runtime then keeps
    its event timings."""

    class Broken:
        def __exit__(self, *exc):
            return False

        @property
        def profiler(self):
            raise TypeError("another torch's event API")

    assert KernelTimer(Broken()).stop(3) is None
    KernelTimer(Broken()).close()  # (and closing says nothing either)
