"""Measure what this machine's host computes: the rate of an optimizer step on the CPU.

:func:`measure_host_optimizer` times ``torch.optim.AdamW`` on the CPU and returns a
:class:`tierflow.hardware.HostCompute`, the figure a ``HostStep`` (an optimizer update
run on the host, :class:`tierflow.plan.HostStep`) is priced by. It is what a CPU-mode
run's hardware should carry (``dataclasses.replace(hw, host_compute=...)``); the
presets carry published figures instead (see their ``[host_compute]`` comments).

The unit is :class:`~tierflow.hardware.HostCompute`'s: bytes of parameter, gradient and
optimizer state an update gets through per second, each tensor's bytes counted once
(fp32 AdamW: 4 + 4 + 4 + 4 = 16 bytes a parameter). The memory traffic is larger (the
update reads all four and writes three back: 28 bytes a parameter, more for the
temporaries PyTorch's unfused kernels make), but the unit stays what a planner can
count from a trace: the sizes of the tensors a step touches.
"""

from __future__ import annotations

import math
import platform
import time
from pathlib import Path

import torch

from ..errors import HardwareError
from ..hardware import HostCompute


def measure_host_optimizer(
    sizes: tuple[int, ...] = (1 << 16, 1 << 20, 1 << 22),
    *,
    repeats: int = 3,
    params_per_size: int = 4,
    threads: int | None = None,
) -> HostCompute:
    """Time ``torch.optim.AdamW`` steps on this machine's CPU.

    For each size, ``params_per_size`` fp32 parameters of ``size`` elements each get a
    gradient and an AdamW optimizer, once with ``foreach=False`` (one parameter at a
    time) and once with ``foreach=True`` (multi-tensor kernels); one unrecorded step
    creates the state, then ``repeats`` steps are timed with ``time.perf_counter`` and
    the fastest kept. The bytes a step processes are those of every parameter, its
    gradient and its state tensors. The figure returned is that of the faster
    implementation at the largest size (the steady rate of large updates; small ones
    pay per-tensor overhead); ``source`` lists the figure at every size.

    Args:
        sizes: elements per parameter tensor, each > 0. The default's largest
            (4 Mi elements x 4 parameters: 256 MiB of parameter, gradient and state)
            is well past any CPU cache, so the rate is the memory-bound one.
        repeats: timed steps per size and implementation (the fastest counts), >= 1.
        params_per_size: parameter tensors per step, >= 1.
        threads: ``torch.set_num_threads`` during the measurement (restored after);
            default the current setting, which is what a host step would run with.

    Returns:
        A :class:`~tierflow.hardware.HostCompute`; ``source`` says what was measured,
        on which CPU, with how many threads.

    Raises:
        HardwareError: a bad argument.

    Example:
        >>> hc = measure_host_optimizer((4096,), repeats=1, params_per_size=1)
        >>> hc.optimizer_bytes_per_s > 0
        True
    """
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in sizes):
        raise HardwareError(f"measure_host_optimizer: sizes must be positive integers, got {sizes!r}")
    if repeats < 1 or params_per_size < 1:
        raise HardwareError(
            f"measure_host_optimizer: repeats and params_per_size must be >= 1, got {repeats} and {params_per_size}"
        )
    if threads is not None and threads < 1:
        raise HardwareError(f"measure_host_optimizer: threads must be >= 1, got {threads}")
    old_threads = torch.get_num_threads()
    rates: dict[tuple[int, bool], float] = {}
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        used = torch.get_num_threads()
        for n in sorted(set(sizes)):
            for foreach in (False, True):
                rates[(n, foreach)] = _adamw_rate(n, foreach, repeats, params_per_size)
    finally:
        torch.set_num_threads(old_threads)
    largest = max(sizes)
    foreach = rates[(largest, True)] >= rates[(largest, False)]
    per_size = ", ".join(
        f"{n} x{params_per_size}: {max(rates[(n, False)], rates[(n, True)]) / 1e9:.2f} GB/s" for n in sorted(set(sizes))
    )
    return HostCompute(
        optimizer_bytes_per_s=rates[(largest, foreach)],
        source=(
            f"measured: torch {torch.__version__} AdamW fp32, foreach={foreach} (the faster: "
            f"{rates[(largest, False)] / 1e9:.2f} GB/s without, {rates[(largest, True)] / 1e9:.2f} GB/s with), "
            f"on {cpu_name()}, {used} threads, fastest of {repeats} steps; "
            f"per size (elements x tensors): {per_size}"
        ),
    )


def _adamw_rate(n: int, foreach: bool, repeats: int, count: int) -> float:
    """Bytes/s of one AdamW step over ``count`` parameters of ``n`` fp32 elements."""
    params = [torch.nn.Parameter(torch.rand(n)) for _ in range(count)]
    for p in params:
        p.grad = torch.rand(n)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    opt.step()  # creates the state: exp_avg, exp_avg_sq, step
    nbytes = sum(_nbytes(p) + _nbytes(p.grad) for p in params)
    nbytes += sum(_nbytes(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t0)
    return nbytes / max(best, 1e-9)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"
