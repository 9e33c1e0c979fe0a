"""What is live at a step's allocator peak, block by block, from the torch profiler's
allocation events (CPU: ``profile(profile_memory=True)``): the one peak tool of the
compiled benchmarks (``compiled.py --breakdown`` prints its text; run alone it trains
the arms of :mod:`compiled` and breaks down each one's profiled step).

Each allocation event carries its address, its signed size and its place in the op
tree. Walking them in time order with a map ``address -> block`` gives, at the running
sum's highest point, the set of blocks live there. Each block is labelled by the region
that made it: a compiled graph's forward or backward (the ``CompiledFunction`` /
``CompiledFunctionBackward`` record above it, numbered in the order the step first
runs them), ``tierflow::reload`` inside one, the optimizer's step (``optimizer``), or
eager code between graphs (``eager``: a loss, the batch). Against the region the peak
falls in, a block is:

* ``saved``: made by a forward and still live in a backward (what a forward saved, or
  an output the caller still holds);
* ``reloaded``: made by ``tierflow::reload``, ``tierflow::prefetch`` or ``tierflow::wait``
  (an offloaded tensor back on the device);
* ``working``: made by the region the peak falls in (its temporaries and gradients so far);
* ``other backward``: made by another backward (the output gradient a later graph's
  backward made for this one: a tangent; gradients it returned);
* ``other forward``: made by another forward, the peak being in a forward;
* ``eager``: made outside every compiled graph (between graphs, or by the optimizer).

    prof = torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with prof: step()
    print(format_breakdown(peak_breakdown(prof)))

As a script, for each model of :mod:`compiled` and each share, the plain compiled model
and ``tierflow.compiled.compile(model, budget=S)`` with inductor (the same arms, warm-up
and profiled step as ``benchmarks/compiled.py``), each with its graphs' plans:

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/peak_breakdown.py --models mlp-break,mlp-dynamic --quick --shares 0.5,0.3
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")
_GRAPH = "## Call CompiledFxGraph"
# the ops that bring an offloaded tensor back (a prefetch allocates where it starts)
_COPIES_BACK = ("tierflow::reload", "tierflow::prefetch", "tierflow::wait")


@dataclass(frozen=True)
class Block:
    """One allocation live at the peak.

    Attributes:
        bytes: its size.
        made_in: the region that allocated it (``fwd 0``, ``bwd 1``, ``optimizer``, ``eager``).
        reload: allocated by ``tierflow::reload``.
        op: the innermost op that allocated it.
        order: its allocation's index among the step's allocation events.
    """

    bytes: int
    made_in: str
    reload: bool
    op: str
    order: int


@dataclass
class Breakdown:
    """The live set at the step's allocator peak.

    Attributes:
        peak_bytes: the running sum of allocation events at its highest (bytes above
            the step's start).
        region: where the peak falls (``bwd 0``: graph 0's backward).
        op: the op whose allocation made the peak.
        blocks: the live blocks (they sum to ``peak_bytes`` when every block live at
            the peak was allocated inside the profiled step).
        events: allocation events in the step.
    """

    peak_bytes: int
    region: str
    op: str
    blocks: list[Block] = field(default_factory=list)
    events: int = 0

    def category(self, b: Block) -> str:
        """``saved``, ``reloaded``, ``working``, ``other backward``, ``other forward`` or
        ``eager`` (module docstring)."""
        if b.reload:
            return "reloaded"
        if b.made_in == self.region:
            return "working"
        if b.made_in in ("eager", "optimizer"):
            return "eager"
        if b.made_in.startswith("fwd"):
            return "saved" if self.region.startswith("bwd") else "other forward"
        return "other backward"

    def by_category(self) -> dict[tuple[str, str], tuple[int, int]]:
        """``(category, made_in) -> (blocks, bytes)``, largest first."""
        acc: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        for b in self.blocks:
            a = acc[(self.category(b), b.made_in)]
            a[0] += 1
            a[1] += b.bytes
        return {k: (v[0], v[1]) for k, v in sorted(acc.items(), key=lambda kv: -kv[1][1])}


def allocation_events(prof: Any) -> list[Any]:
    from torch._C._profiler import _EventType

    out: list[Any] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            out.append(e)
        stack.extend(e.children)
    out.sort(key=lambda e: e.start_time_ns)
    return out


def live_at_peak(events: list[Any], make: Callable[[int, Any], T]) -> tuple[int, dict[int, T], int]:
    """Walk allocation events in time order keeping ``address -> make(index, event)``.

    Returns:
        ``(peak, live, ptr)``: the running sum's highest value (bytes above the walk's
        start), the blocks live there, and the address of the event that reached it.
    """
    live: dict[int, T] = {}
    cur = peak = 0
    peak_live: dict[int, T] = {}
    peak_ptr = -1
    for i, e in enumerate(events):
        size = int(e.extra_fields.alloc_size)
        ptr = int(e.extra_fields.ptr)
        cur += size
        if size > 0:
            live[ptr] = make(i, e)
        else:
            live.pop(ptr, None)
        if cur > peak:
            peak, peak_live, peak_ptr = cur, dict(live), ptr
    return peak, peak_live, peak_ptr


class _Regions:
    """Names compiled-graph regions by their first appearance: ``fwd k`` / ``bwd k``.

    A forward graph is the k-th distinct ``CompiledFxGraph`` under ``CompiledFunction``;
    its backward takes the number of its forward when the profiler tells which
    (``CompiledFunctionBackward`` of the same AOT id is not exposed), so backward
    graphs are numbered in their own order of appearance, counted down from the last
    forward (autograd runs the graphs' backwards in the reverse order of their forwards)."""

    def __init__(self) -> None:
        self.fwd: dict[str, int] = {}
        self.bwd: dict[str, int] = {}

    def name(self, event: Any) -> tuple[str, bool, str]:
        """(region, made by tierflow::reload, innermost op) of an allocation event.

        A region is the innermost ``CompiledFunction`` (forward) or
        ``CompiledFunctionBackward`` record above the event; inductor's graphs are told
        apart by the ``## Call CompiledFxGraph <hash> ##`` record under it (a graph
        called twice is one region), other backends' by the record's start (each call
        is a region of its own)."""
        chain = []
        p = event.parent
        while p is not None:
            chain.append(p)
            p = p.parent
        op = chain[0].name if chain else "?"
        if op.startswith(_GRAPH):  # (an inductor graph's own buffer: no op record above it)
            op = "inductor buffer"
        reload = any(e.name.startswith(_COPIES_BACK) for e in chain)
        outside = "optimizer" if any(e.name.startswith("Optimizer.step") for e in chain) else "eager"
        for i, e in enumerate(chain):
            if e.name not in ("CompiledFunction", "CompiledFunctionBackward"):
                continue
            # a graph compiled with torch's FX cache off has no hash ("None"): one region per call
            graph = next((c.name for c in chain[:i] if c.name.startswith(_GRAPH) and "None" not in c.name),
                         f"call@{e.start_time_ns}")
            backward = e.name == "CompiledFunctionBackward"
            table = self.bwd if backward else self.fwd
            k = table.setdefault(graph, len(table))
            return (f"bwd {k}" if backward else f"fwd {k}"), reload, op
        return outside, reload, op

    def renumber_backward(self) -> dict[str, str]:
        """``bwd j`` (order of appearance) -> ``bwd k`` (the forward graph it belongs to),
        when every forward graph ran its backward once."""
        n = len(self.fwd)
        if len(self.bwd) != n:
            return {}
        return {f"bwd {j}": f"bwd {n - 1 - j}" for j in range(n)}


def peak_breakdown(prof: Any) -> Breakdown:
    """The blocks live at the highest running sum of the profiled step's allocations.

    Args:
        prof: a finished ``torch.profiler.profile(profile_memory=True)`` over one step.

    Returns:
        A :class:`Breakdown`; blocks allocated before the profile started (and freed
        in it) are not listed, they only lower the running sum.
    """
    regions = _Regions()
    events = allocation_events(prof)

    def block(i: int, e: Any) -> Block:
        region, reload, op = regions.name(e)
        return Block(int(e.extra_fields.alloc_size), region, reload, op, i)

    peak, peak_live, peak_ptr = live_at_peak(events, block)
    blk = peak_live.get(peak_ptr)
    peak_at = (blk.made_in, blk.op) if blk is not None else ("?", "?")
    rename = regions.renumber_backward()
    blocks = [Block(b.bytes, rename.get(b.made_in, b.made_in), b.reload, b.op, b.order) for b in peak_live.values()]
    blocks.sort(key=lambda b: (-b.bytes, b.order))
    return Breakdown(peak, rename.get(peak_at[0], peak_at[0]), peak_at[1], blocks, len(events))


def format_breakdown(bd: Breakdown, min_bytes: int = 1 << 18) -> str:
    """The breakdown as text: a line per (category, region), then the blocks of at least
    ``min_bytes``."""
    mib = 2**20
    lines = [f"allocator peak {bd.peak_bytes / mib:.1f} MiB in {bd.region} (at {bd.op}); "
             f"{len(bd.blocks)} blocks live, {sum(b.bytes for b in bd.blocks) / mib:.1f} MiB"]
    for (cat, made), (n, nbytes) in bd.by_category().items():
        lines.append(f"  {cat:<12} made in {made:<7} {n:4d} blocks {nbytes / mib:8.2f} MiB")
    big = [b for b in bd.blocks if b.bytes >= min_bytes]
    if big:
        lines.append(f"  blocks of {min_bytes / mib:.2f} MiB or more:")
        lines += [f"    {b.bytes / mib:7.2f} MiB  {bd.category(b):<12} {b.made_in:<7} by {b.op} (event {b.order})"
                  for b in big]
    return "\n".join(lines)


def profiled(step: Callable[[], Any]) -> Any:
    """``step`` run under the CPU profiler with its allocations recorded."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return prof


def _graph_line(g: dict[str, Any]) -> str:
    mib = 2**20
    target = "none" if g["target_bytes"] is None else f"{g['target_bytes'] / mib:.2f} MiB"
    floor = ""
    if g.get("budget_bytes") is not None:
        floor = (f", floor {g['floor_bytes'] / mib:.2f} MiB at {g['floor_op']} against {g['budget_bytes'] / mib:.2f}"
                 + (" (ABOVE)" if g["floor_above_budget"] else ""))
    return (f"  graph {g['index']}: calls {g['calls']}, trace {g['predicted_peak_bytes'] / mib:.2f} -> "
            f"{g['predicted_peak_bytes_planned'] / mib:.2f} MiB, plan curve {g.get('plan_peak_bytes', 0) / mib:.2f} "
            f"/ target {target}, offloaded {g['offloaded']} ({g['offloaded_bytes'] / mib:.2f} MiB), kept "
            f"{g['kept']}, grads moved {g['grads_offloaded']}{floor}")


def _arms(name: str, args: Any, device: Any) -> dict[str, Any]:
    import torch

    import compiled as cb

    w = cb.workload(name, device, args.quick)
    shares = [float(s) for s in args.shares.split(",")]
    torch._dynamo.reset()
    out = []
    for make in cb.make_arms(w, shares, [], args.headroom):
        a = make()
        for i in range(args.warmup):
            a.step(w, i)
        bd = peak_breakdown(profiled(lambda a=a: a.step(w, args.warmup)))
        out.append({"arm": a.name, "breakdown": bd,
                    "graphs": a.handle.stats.compiled_graphs if a.name.startswith("tierflow") else []})
    return {"model": w.name, "arms": out, "min_bytes": int(args.min_kib * 1024)}


def _show(res: dict[str, Any]) -> None:
    print(f"\n{res['model']}")
    plain = res["arms"][0]["breakdown"].peak_bytes
    for arm in res["arms"]:
        bd = arm["breakdown"]
        print(f"\n{arm['arm']} ({bd.peak_bytes / plain:.2f} of plain):")
        print(format_breakdown(bd, min_bytes=res["min_bytes"]))
        for g in arm["graphs"]:
            print(_graph_line(g))


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).parent))  # compiled.py, beside this one
    import compiled as cb

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp-break,mlp-dynamic")
    ap.add_argument("--shares", default="0.5,0.3")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--headroom", type=float, default=0.1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--min-kib", type=float, default=256.0, help="list the live blocks of at least this many KiB")
    args = ap.parse_args(argv)
    if args.device != "cpu":
        raise SystemExit("peak_breakdown walks the CPU profiler's allocation events: --device cpu only")
    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 64
    args.json = None
    return cb.run_models(args, _arms, _show)


__all__ = ["Block", "Breakdown", "allocation_events", "format_breakdown", "live_at_peak", "main", "peak_breakdown",
           "profiled"]


if __name__ == "__main__":
    raise SystemExit(main())
