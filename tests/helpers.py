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


# -- recompute and host steps ---------------------------------------------------------


def lever_trace(layers: int, sizes_mb: list[int], durations_ms: list[int], rng_layers: frozenset[int] = frozenset()) -> Trace:
    """A small training iteration with what recompute and host steps need: per layer a
    weight ``w`` and its optimizer state ``m`` (persistent), a forward pair
    ``h = lin(x, w)``, ``y = act(h)`` (``act`` draws random numbers in ``rng_layers``),
    a backward op reading ``h``, ``x`` and ``w`` and writing the weight's gradient, and one
    optimizer op per weight reading its gradient and updating ``w`` and ``m``.

    ``sizes_mb`` holds ``6 * layers + 2`` sizes in creation order (per layer ``w``,
    ``m``; the input; per layer ``h``, ``y``; the loss gradient; per layer from the last
    ``g``, ``dx``), ``durations_ms`` ``4 * layers + 1`` op times."""
    sizes, durs = iter(sizes_mb), iter(durations_ms)
    tensors: list[TensorInfo] = []
    ops: list[Op] = []

    def tensor(kind: str, persistent: bool = False, name: str = "") -> int:
        tensors.append(TensorInfo(len(tensors), next(sizes) * MB, kind, persistent, name))
        return len(tensors) - 1

    ws, ms = [], []
    for i in range(layers):
        ws.append(tensor("parameter", True, f"w{i}"))
        ms.append(tensor("optimizer_state", True, f"m{i}"))
    x = tensor("input", name="x")
    xs, hs = [], []
    for i, w in enumerate(ws):
        h = tensor("activation", name=f"h{i}")
        ops.append(Op(f"lin{i}", "forward", next(durs) * 1e-3, (x, w), (h,), scope=f"l{i}"))
        y = tensor("activation", name=f"y{i}")
        ops.append(Op(f"act{i}", "forward", next(durs) * 1e-3, (h,), (y,), scope=f"l{i}", rng=i in rng_layers))
        xs.append(x)
        hs.append(h)
        x = y
    dy = tensor("activation", name="dy")
    ops.append(Op("loss", "forward", next(durs) * 1e-3, (x,), (dy,)))
    grads = []
    for i in reversed(range(layers)):
        g = tensor("gradient", name=f"g{i}")
        dx = tensor("activation", name=f"dx{i}")
        ops.append(Op(f"bwd{i}", "backward", next(durs) * 1e-3, (dy, hs[i], xs[i], ws[i]), (g, dx), scope=f"l{i}"))
        grads.append((i, g))
        dy = dx
    for i, g in grads:
        ops.append(Op(f"step{i}", "optimizer", next(durs) * 1e-3, (ws[i], g, ms[i]), (ws[i], ms[i])))
    return Trace(ops, tensors, "levers")


@st.composite
def lever_traces(draw, max_layers: int = 4):
    layers = draw(st.integers(1, max_layers))
    sizes = draw(st.lists(st.integers(1, 60), min_size=6 * layers + 2, max_size=6 * layers + 2))
    durs = draw(st.lists(st.integers(0, 20), min_size=4 * layers + 1, max_size=4 * layers + 1))
    rng = frozenset(draw(st.sets(st.integers(0, layers - 1))))
    return lever_trace(layers, sizes, durs, rng)


def host_hw(pcie_gbps: float = 10.0, host_gbps: float = 5.0) -> Hardware:
    """:func:`simple_hw` with a host that runs optimizer updates at ``host_gbps`` GB/s."""
    import dataclasses

    from tierflow.hardware import HostCompute

    return dataclasses.replace(simple_hw(pcie_gbps), host_compute=HostCompute(host_gbps * 1e9, "test"))


def host_steps_of(trace: Trace, params: set[int] | None = None, tier: str = "host") -> list:
    """A host step for each parameter (of ``params``, default all) whose optimizer ops
    touch only it, its gradient and its optimizer state (one op per parameter)."""
    from tierflow.plan import HostStep

    out = []
    for o, op in enumerate(trace.ops):
        if op.phase != "optimizer":
            continue
        kinds: dict[str, list[int]] = {}
        for t in op.tensors:
            kinds.setdefault(trace.tensors[t].kind, []).append(t)
        if len(kinds.get("parameter", ())) != 1 or len(kinds.get("gradient", ())) != 1:
            continue
        p = kinds["parameter"][0]
        if params is not None and p not in params:
            continue
        out.append(HostStep(p, kinds["gradient"][0], tuple(kinds.get("optimizer_state", ())), (o,), tier))
    return out


def recompute_candidates(trace: Trace) -> list:
    """Every single-tensor recompute by rule: a non-persistent tensor born at a pure
    forward op ``p`` (not in place), dropped over its last gap, re-created before the
    use that ends it by re-running ``p`` (or, where one of ``p``'s inputs is born at a
    pure forward op too, that op and ``p``: a chain of two)."""
    from tierflow.plan import Recompute

    out = []
    first = trace.first_use
    for t in range(trace.n_tensors):
        if trace.tensors[t].persistent:
            continue
        p = int(first[t])
        op = trace.ops[p]
        if op.phase != "forward" or not op.pure or t in op.inputs:
            continue
        uses = trace.uses(t).tolist()
        gaps = [(a, b) for a, b in zip(uses, uses[1:]) if b > a + 1]
        if not gaps:
            continue
        _, b = gaps[-1]
        out.append(Recompute((t,), (p,), b, restore_rng=True))
        for a in op.inputs:
            q = int(first[a])
            src = trace.ops[q]
            if not trace.tensors[a].persistent and src.phase == "forward" and src.pure and a not in src.inputs and q < p:
                out.append(Recompute((t,), (q, p), b, restore_rng=True))
                break
    return out


def chain_reads(trace: Trace, r) -> set[int]:  # noqa: ANN001 - a Recompute
    """Tensors a chain reads from outside itself."""
    made = {t for o in r.ops for t in trace.ops[o].outputs if int(trace.first_use[t]) == o}
    return {x for o in r.ops for x in trace.ops[o].tensors if x not in made}


def chain_made(trace: Trace, r) -> set[int]:  # noqa: ANN001 - a Recompute
    return {t for o in r.ops for t in trace.ops[o].outputs if int(trace.first_use[t]) == o}


def pick_recomputes(draw, trace: Trace) -> list:
    """A random set of :func:`recompute_candidates` that cannot conflict: no chain reads
    a tensor another drops, no tensor is dropped twice."""
    chosen, dropped, read = [], set(), set()
    for r in recompute_candidates(trace):
        if not draw(st.booleans()):
            continue
        reads = chain_reads(trace, r)
        if set(r.tensors) & (dropped | read) or reads & dropped:
            continue
        chosen.append(r)
        dropped.update(r.tensors)
        read |= reads
    return chosen


def assert_training_equal(a, b) -> None:
    """Two training runs, each ``(model, optimizer, losses, grads, ...)`` (``grads``: per
    step, every parameter's gradient): the same losses, gradients of every step, final
    parameters, optimizer state and buffers, all ``torch.equal``."""
    import torch

    (ma, oa, la, ga, *_), (mb, ob, lb, gb, *_) = a, b
    assert la == lb
    for sa, sb in zip(ga, gb):
        assert all(torch.equal(p, q) for p, q in zip(sa, sb))
    for p, q in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(p, q)
        for k, v in ob.state[q].items():
            assert torch.equal(oa.state[p][k], v), k
    for (name, x), (_, y) in zip(ma.named_buffers(), mb.named_buffers()):
        assert torch.equal(x, y), name


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (the benchmarks are scripts, not a package),
    loaded once and registered under ``name`` so that the scripts that import one
    another (gpu_suite imports gpu_check) find it."""
    import importlib.util
    import sys
    from pathlib import Path

    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]
