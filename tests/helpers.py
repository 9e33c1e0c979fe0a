"""Tiny hand-made traces and machines for tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from tierflow import Hardware, Op, TensorInfo, Trace
from tierflow.pool import Buffer, Problem
from tierflow.pool.greedy import best_fit
from tierflow.synthetic import MB, toy_hardware


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
    """A 1 GiB 'gpu' and host over a symmetric link, no latency (see
    :func:`tierflow.synthetic.toy_hardware`)."""
    return toy_hardware(pcie_gbps, host_gib, fault_us)


@st.composite
def placed_problems(draw, max_buffers: int, max_start: int, max_life: int):
    """A random pool problem (1 to ``max_buffers`` buffers, each live from an op in
    0..``max_start`` for 1..``max_life`` ops, 0-9 units) and a valid placement of it:
    greedy's best fit under a random order."""
    n = draw(st.integers(1, max_buffers))
    bufs = []
    for i in range(n):
        lo = draw(st.integers(0, max_start))
        bufs.append(Buffer(str(i), lo, lo + draw(st.integers(1, max_life)), draw(st.integers(0, 9))))
    p = Problem(tuple(bufs))
    order = np.array(draw(st.permutations(range(n))), dtype=np.int64)
    return p, best_fit(p.lower, p.upper, p.units, order)
