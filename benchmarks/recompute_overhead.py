"""Two source trees of tierflow, a step that follows recompute chains compared, interleaved.

``benchmarks/split_overhead.py`` times plans of moves; this times the other lean-path
branch, a plan with recompute chains (gpt-tiny under ``policy="checkpoint"`` at 80% of
its profiled peak: every block dropped after forward and re-made before backward). Each
run (a child process with one tree first on ``sys.path``, checked) alternates three
rounds of plain PyTorch and of the offloaded model, takes the median CPU time of the
steps after three warm ones, and reports offloaded over plain; the trees run
alternately (which one goes first alternates too), ``--pairs`` times, and the median of
``step(tree B) / step(tree A)`` is printed, with each tree's medians in milliseconds.

Usage:
    git archive <before> src | tar -x -C /tmp/before
    OMP_NUM_THREADS=1 python benchmarks/recompute_overhead.py /tmp/before/src src --pairs 6
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _steps(factory, n: int) -> tuple[list[float], object]:
    import torch

    from tierflow.capture import zoo

    m = zoo.build("gpt-tiny", seed=0)
    opt = torch.optim.AdamW(m.model.parameters())
    x, y = m.make_batch(4, 64)
    times = []
    with factory(m.model, opt) as run:
        for _ in range(n):
            t0 = time.process_time()
            m.loss_fn(m.model(x), y).backward()
            opt.step()
            opt.zero_grad()
            times.append(time.process_time() - t0)
    return times, run


def child(budget: str, rounds: int, steps: int) -> None:
    """One run, in this process, of the tree ``TIERFLOW_SRC`` names: prints a JSON line."""
    tree = os.environ["TIERFLOW_SRC"]
    sys.path.insert(0, tree)
    import torch

    import tierflow

    torch.set_num_threads(1)
    if not os.path.realpath(tierflow.__file__).startswith(os.path.realpath(tree)):
        raise SystemExit(f"imported tierflow from {tierflow.__file__}, not from {tree}")
    plain, got, run = [], [], None
    for _ in range(rounds):  # (alternating, so that the machine's load falls on both alike)
        p, _ = _steps(lambda net, opt: contextlib.nullcontext(), 3 + steps)
        g, run = _steps(lambda net, opt: tierflow.offload(net, opt, budget=budget, policy="checkpoint"), 3 + steps)
        plain += p[3:]
        got += g[3:]
    s = run.stats
    if not run.plan.recomputes or s.recomputed_ops == 0 or s.step_kinds[-steps:] != ["planned"] * steps:
        raise SystemExit(f"no recompute plan followed: {s.step_kinds} {s.plan_error}")
    print(json.dumps({"ratio": statistics.median(got) / statistics.median(plain), "ms": statistics.median(got) * 1e3,
                      "recomputed_ops": s.recomputed_ops}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", nargs="?", help="source tree A (the directory holding the tierflow package)")
    ap.add_argument("b", nargs="?", help="source tree B")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budget", default="80%")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.budget, args.rounds, args.steps)
        return
    if not (args.a and args.b):
        ap.error("two source trees are needed")
    ratios: list[float] = []
    ms: dict[str, list[float]] = {"A": [], "B": []}
    for k in range(args.pairs):
        order = (("A", args.a), ("B", args.b)) if k % 2 == 0 else (("B", args.b), ("A", args.a))
        got = {}
        for name, tree in order:
            done = subprocess.run([sys.executable, __file__, "--child", "--budget", args.budget, "--rounds",
                                   str(args.rounds), "--steps", str(args.steps)],
                                  env=dict(os.environ, TIERFLOW_SRC=str(Path(tree).resolve())),
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"the run of {tree} failed:\n{done.stderr[-2000:]}")
            got[name] = json.loads(done.stdout.strip().splitlines()[-1])
            ms[name].append(got[name]["ms"])
        ratios.append(got["B"]["ratio"] / got["A"]["ratio"])
        print(f"pair {k + 1}: A {got['A']['ratio']:.3f}x plain, B {got['B']['ratio']:.3f}x plain", flush=True)
    print(f"checkpoint@{args.budget}: step B / step A = {statistics.median(ratios):.3f} (median of {len(ratios)} "
          f"pairs; range {min(ratios):.3f}-{max(ratios):.3f}); median step A {statistics.median(ms['A']):.1f} ms, "
          f"B {statistics.median(ms['B']):.1f} ms; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
