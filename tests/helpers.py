"""Tiny hand-made traces and machines for tests."""

from __future__ import annotations

import dataclasses

from tierflow import Hardware, Op, TensorInfo, Trace, load_hardware

MB = 10**6


def chain_trace() -> Trace:
    """W (persistent, 100 MB) used by ops 0 and 2 and 3; A (50 MB) born at 0, read at 2."""
    ts = [
        TensorInfo(0, 100 * MB, "parameter", True, "W"),
        TensorInfo(1, 50 * MB, "activation", False, "A"),
        TensorInfo(2, 30 * MB, "gradient", False, "G"),
    ]
    ops = [
        Op("f0", "forward", 0.010, (0,), (1,)),
        Op("f1", "forward", 0.020, (), ()),
        Op("b0", "backward", 0.010, (1, 0), (2,)),
        Op("opt", "optimizer", 0.005, (2, 0), (0,)),
    ]
    return Trace(ops, ts, "chain")


def simple_hw(pcie_gbps: float = 10.0, host_gib: float = 64, fault_us: float = 0.0) -> Hardware:
    """A 1 GiB 'gpu' and host over a symmetric link, no buses, no latency."""
    hw = load_hardware("rtx4090-24g")
    links = tuple(
        dataclasses.replace(link, bandwidth=pcie_gbps * 1e9, latency_s=0.0) for link in hw.links
    )
    hw = dataclasses.replace(hw, links=links, fault_latency_s=fault_us * 1e-6, name="test-hw")
    hw = hw.with_tier("gpu", capacity=float(2**30))
    hw = hw.with_tier("host", capacity=float(host_gib * 2**30))
    return hw.with_tier("ssd", latency_s=0.0)
