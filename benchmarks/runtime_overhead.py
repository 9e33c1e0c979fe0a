"""The runtime's steady-state cost per aten op, against a do-nothing TorchDispatchMode.

What it measures. A model trains on the CPU with one thread in four ways, interleaved
round by round so that the machine's load falls on all of them alike:

- ``plain``: PyTorch alone;
- ``noop-mode``: under a ``TorchDispatchMode`` whose ``__torch_dispatch__`` only calls
  the op (the floor for any runtime that sees every aten op from Python);
- ``offload``: under ``tierflow.offload`` with no budget (the plan moves nothing);
- ``offload@60%``: under ``tierflow.offload`` at 60% of the profiled peak (the plan
  moves tensors; their copies are part of the cost).

Steps are timed by the process's CPU time by default (``--clock wall`` for wall time): on
a shared machine another process's load changes wall times by tens of percent between
rounds, the CPU time this process spends far less. Every mode runs its own warm-up first (for ``offload``: the warm-up iteration, the
profiled one and the first planned one), then ``--steps`` timed steps; a round's figure
is the median step. The per-op overhead of a mode is ``(median step - plain median) /
ops per step``, the ops counted by the noop mode. The figure the runtime issue asks for
is the ratio ``overhead(offload) / overhead(noop-mode)`` (target: at most 2).

Usage::

    python benchmarks/runtime_overhead.py                       # gpt-tiny, all four modes
    python benchmarks/runtime_overhead.py --model gpt2-small --batch 1 --seq 128 \\
        --modes plain,offload --rounds 5 --steps 3

Prints a table and, with ``--json PATH``, writes the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# (TIERFLOW_SRC: another source tree to time, benchmarks/split_overhead.py's; else this one's)
sys.path.insert(0, os.environ.get("TIERFLOW_SRC") or os.path.join(os.path.dirname(__file__), "..", "src"))

import tierflow  # noqa: E402
from tierflow.capture import zoo  # noqa: E402


class NoopMode(TorchDispatchMode):
    """Calls every op and does nothing else: the least a dispatch-mode runtime can cost."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class CountingMode(TorchDispatchMode):
    """Counts the aten ops of a step (run once, untimed)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _setup(model: str, batch: int, seq: int | None):
    built = zoo.build(model, seed=0)
    net = built.model
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, foreach=False)
    x, y = built.make_batch(batch, seq)
    return net, opt, x, y, built.loss_fn


def _step(net, opt, x, y, loss_fn) -> None:
    loss = loss_fn(net(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _timed(setup, ctx_factory, warmup: int, steps: int, clock) -> tuple[float, object]:
    net, opt, x, y, loss_fn = setup
    ctx = ctx_factory(net, opt)
    times = []
    with ctx as handle:
        for _ in range(warmup):
            _step(net, opt, x, y, loss_fn)
        for _ in range(steps):
            t0 = clock()
            _step(net, opt, x, y, loss_fn)
            times.append(clock() - t0)
    return statistics.median(times), min(times), handle


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--batch", type=int, default=None, help="default: the zoo's batch")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--modes", default="plain,noop-mode,offload,offload@60%")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round and mode")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="cpu (default): the process's CPU time, which a shared, loaded machine "
                         "disturbs far less than wall time; wall: time.perf_counter")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    batch = args.batch or zoo.spec(args.model).batch
    modes = args.modes.split(",")
    setups = {m: _setup(args.model, batch, args.seq) for m in modes}

    def noop(net, opt):
        return NoopMode()

    def offload(budget):
        return lambda net, opt: tierflow.offload(net, opt, budget=budget, policy="tierflow")

    factories = {"plain": lambda net, opt: contextlib.nullcontext(), "noop-mode": noop, "offload": offload(None)}
    for m in modes:
        if m.startswith("offload@"):
            factories[m] = offload(m.split("@", 1)[1])
    samples: dict[str, list[float]] = {m: [] for m in modes}
    best: dict[str, float] = {}  # the fastest step of each mode over all rounds
    counter, probe = CountingMode(), _setup(args.model, batch, args.seq)
    _step(*probe)  # (the first step also creates the optimizer's state: not a steady step)
    with counter:
        _step(*probe)
    ops = counter.ops
    stats = {}
    for r in range(args.rounds):
        for m in modes:
            warm = 3 if m.startswith("offload") else 1
            t, fastest, handle = _timed(setups[m], factories[m], warm, args.steps, clock)
            samples[m].append(t)
            best[m] = min(best.get(m, float("inf")), fastest)
            if m.startswith("offload"):
                s = handle.stats
                stats[m] = {"planned_steps": s.planned_steps, "stale_plans": s.stale_plans,
                            "moved_bytes": dict(s.moved_bytes), "peak_device_bytes": s.peak_device_bytes,
                            "budget_bytes": None if s.budget_bytes == float("inf") else int(s.budget_bytes),
                            "stalls": s.stalls}
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{m} {samples[m][-1] * 1e3:.2f} ms" for m in modes),
              file=sys.stderr)
    med = {m: statistics.median(v) for m, v in samples.items()}
    plain = med.get("plain")
    out = {"model": args.model, "batch": batch, "seq": args.seq, "threads": args.threads, "clock": args.clock,
           "rounds": args.rounds,
           "steps": args.steps, "ops_per_step": ops, "median_step_s": med, "stats": stats,
           "load_avg": os.getloadavg(), "torch": torch.__version__}
    print(f"\n{args.model} b{batch}{f' s{args.seq}' if args.seq else ''}, {ops} aten ops per step, "
          f"{args.threads} thread(s), {args.clock} time, load {os.getloadavg()[0]:.2f}")
    print(f"{'mode':<14} {'step (ms)':>10} {'vs plain':>9} {'per op (us)':>12}")
    per_op = {}
    for m in modes:
        ratio = med[m] / plain if plain else float("nan")
        over = (med[m] - plain) / ops * 1e6 if plain and ops else float("nan")
        per_op[m] = over
        print(f"{m:<14} {med[m] * 1e3:>10.2f} {ratio:>9.3f} {over:>12.2f}")
    out["overhead_per_op_us"] = per_op
    if "noop-mode" in per_op and "plain" in samples:
        # the ratio per round (the modes of one round ran back to back, under the same
        # load), then the median over rounds
        for m in modes:
            if m.startswith("offload"):
                ratios = [(a - p) / (n - p) for a, p, n in zip(samples[m], samples["plain"], samples["noop-mode"])
                          if n > p]
                if ratios:
                    r = statistics.median(ratios)
                    out.setdefault("overhead_vs_noop", {})[m] = r
                    print(f"{m}: per-op overhead {r:.2f}x the noop mode's (median of per-round ratios; "
                          f"range {min(ratios):.2f}-{max(ratios):.2f})")
    if "noop-mode" in best and "plain" in best:
        # the fastest step of each mode: what the code costs with the least interference
        # from the machine (timeit's rule); the headline figure
        base = best["noop-mode"] - best["plain"]
        out["fastest_step_s"] = best
        print("fastest steps: " + ", ".join(f"{m} {best[m] * 1e3:.2f} ms" for m in modes))
        for m in modes:
            if m.startswith("offload") and base > 0:
                r = (best[m] - best["plain"]) / base
                out.setdefault("overhead_vs_noop_fastest", {})[m] = r
                print(f"{m}: per-op overhead {(best[m] - best['plain']) / ops * 1e6:.2f} us, {r:.2f}x the noop "
                      f"mode's {base / ops * 1e6:.2f} us (fastest steps)")
    if "plain" in samples:
        out["step_vs_plain"] = {}
        for m in modes:
            ratios = [a / p for a, p in zip(samples[m], samples["plain"])]
            out["step_vs_plain"][m] = statistics.median(ratios)
            if m != "plain":
                print(f"{m}: step {statistics.median(ratios):.3f}x plain (median of per-round ratios; "
                      f"range {min(ratios):.3f}-{max(ratios):.3f})")
    out["tierflow_file"] = tierflow.__file__  # (which source tree ran)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
