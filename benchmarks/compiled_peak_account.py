"""What is live at the allocator's peak of a compiled step, tensor by tensor (issue 30).

For each model of :mod:`compiled` (``mlp-break``, ``mlp-dynamic``, ...) and each share,
it trains the plain compiled model and ``tierflow.compiled.compile(model, budget=S)``
with inductor (the same arms, warm-up and profiled step as ``benchmarks/compiled.py``),
then replays the profiled step's allocator events: at the step's highest point it lists
every allocation still live, with its bytes, the phase that made it (a compiled graph's
forward ``fwd k``, its backward ``bwd k``, numbered in the order they ran, or what ran
between them: the loss, the optimizer) and the op that allocated it. Live bytes made
by a phase that already ended belong to another graph (its saved tensors, its outputs,
gradients).

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/compiled_peak_account.py --models mlp-break,mlp-dynamic --quick --shares 0.5,0.3
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

import compiled as cb
import peak_breakdown as pb

PHASES = {"CompiledFunction": "fwd", "CompiledFunctionBackward": "bwd"}


@dataclass
class Alloc:
    ptr: int
    bytes: int
    t_ns: int
    phase: str
    op: str


def _phase_and_op(e: Any, seen: dict[tuple[str, int], str], counts: Counter) -> tuple[str, str]:
    """The compiled graph phase an allocation event is under (numbered in order of first
    appearance), and the nearest op that made it."""
    op, node, phase = "", e.parent, "between graphs"
    while node is not None:
        kind = PHASES.get(node.name)
        if not op and kind is None and not node.name.startswith("##"):
            op = node.name
        if kind is not None:
            key = (node.name, node.start_time_ns)
            if key not in seen:
                seen[key] = f"{kind} {counts[kind]}"
                counts[kind] += 1
            phase = seen[key]
        elif node.name.startswith("Optimizer.step"):
            phase = "optimizer"
        node = node.parent
    return phase, op or "inductor buffer"


def live_at_peak(step: Any) -> tuple[int, list[Alloc]]:
    """Run ``step`` under the profiler; its peak above the start and what is live there."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    seen: dict[tuple[str, int], str] = {}
    counts: Counter = Counter()

    def alloc(i: int, e: Any) -> Alloc:
        phase, op = _phase_and_op(e, seen, counts)
        return Alloc(int(e.extra_fields.ptr), int(e.extra_fields.alloc_size), e.start_time_ns, phase, op)

    peak, live, _ = pb.live_at_peak(pb.allocation_events(prof), alloc)
    return peak, sorted(live.values(), key=lambda a: a.t_ns)


def account(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    w = cb.workload(name, device, args.quick)
    shares = [float(s) for s in args.shares.split(",")]
    torch._dynamo.reset()
    out = []
    for make in cb.make_arms(w, shares, [], args.headroom):
        a = make()
        for i in range(args.warmup):
            a.step(w, i)
        peak, live = live_at_peak(lambda a=a: a.step(w, args.warmup))
        out.append({"arm": a.name, "peak": peak, "live": live,
                    "graphs": a.handle.stats.compiled_graphs if a.name.startswith("tierflow") else []})
    return {"model": w.name, "arms": out}


def show(res: dict[str, Any]) -> None:
    print(f"\n{res['model']}")
    plain = res["arms"][0]["peak"]
    for arm in res["arms"]:
        print(f"\n{arm['arm']}: peak {arm['peak'] / 2**20:.2f} MiB above the step's start "
              f"({arm['peak'] / plain:.2f} of plain)")
        by_phase: dict[str, int] = Counter()
        for a in arm["live"]:
            by_phase[a.phase] += a.bytes
        last = arm["live"][-1].phase if arm["live"] else "?"
        print(f"  the peak is reached in: {last}")
        for phase, b in sorted(by_phase.items()):
            print(f"  made in {phase}: {b / 2**20:.2f} MiB")
        print("  | made in | op | KiB |")
        for a in arm["live"]:
            print(f"  | {a.phase} | {a.op} | {a.bytes / 1024:.0f} |")
        for g in arm["graphs"]:
            print(f"  graph {g['index']}: calls {g['calls']}, target {g['target_bytes'] / 2**20:.2f} MiB, trace "
                  f"{g['predicted_peak_bytes'] / 2**20:.2f} -> {g['predicted_peak_bytes_planned'] / 2**20:.2f} MiB, "
                  f"offloaded {g['offloaded']} ({g['offloaded_bytes'] / 2**20:.2f} MiB), kept {g['kept']}, "
                  f"grads moved {g['grads_offloaded']}, unreachable {g['unreachable']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp-break,mlp-dynamic")
    ap.add_argument("--shares", default="0.5,0.3")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--headroom", type=float, default=0.1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 64
    args.json = None
    return cb.run_models(args, account, show)


if __name__ == "__main__":
    sys.exit(main())
