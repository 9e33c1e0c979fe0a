"""The min-conflicts descent (tierflow.pool.descent) alone, counted in tries and moves.

    PYTHONPATH=src .venv/bin/python benchmarks/pool_descent.py                # D, J, guillotine-450-free
    PYTHONPATH=src .venv/bin/python benchmarks/pool_descent.py --cases J --tries 8

Each case starts from the canonical search's placement under a node limit (``best`` with
``--node-limit``: deterministic, no ladder), reduced, then descends with ``--tries``
tries of :data:`tierflow.pool.descent.TRY_ITERS` moves at most and no deadline: the
peaks printed depend only on the input and the seed, so they can be compared across
loads; the wall and CPU seconds show what the moves cost on this machine now. Every
answer is checked by the independent validator (a failure exits non-zero).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from tierflow import pool
from tierflow.pool.descent import descend
from tierflow.pool.reduce import reduce

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pool_ladder import DATA, own_sets  # noqa: E402


def problems(cases: list[str]) -> list[pool.Problem]:
    own = {p.name: p for p in own_sets()}
    return [own[c] if c in own else pool.read_csv(DATA / f"{c}.csv") for c in cases]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="*", default=["D", "J", "guillotine-450-12-free"])
    ap.add_argument("--nodes", type=int, default=200_000, help="search nodes for the start placement")
    ap.add_argument("--tries", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(f"load average at start: {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs", file=sys.stderr)
    print(f"\n| case | buffers | start peak/LB (search, {args.nodes} nodes) | after {args.tries} tries | steps | "
          "moves | wall s | CPU s | valid |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    ok = True
    for p in problems(args.cases):
        start = pool.solve(p, "best", time_limit=600, node_limit=args.nodes, seed=args.seed)
        red = reduce(p)
        off = red.restrict(start.offsets)
        if off is None:
            print(f"| {p.name} | {len(p)} | {start.ratio:.4f} | (start off the reduced grid) | | | | | |")
            continue
        t0, c0 = time.perf_counter(), time.process_time()
        out, facts = descend(red.lower, red.upper, red.size, off, red.lower_bound, deadline=float("inf"),
                             seed=args.seed, max_tries=args.tries)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        report = pool.validate(p, red.expand(out))
        ok &= report.valid
        print(f"| {p.name} | {len(p)} | {start.ratio:.4f} | {report.peak / p.lower_bound:.4f} | {facts['steps']} | "
              f"{facts['moves']:,} | {wall:.1f} | {cpu:.1f} | {'yes' if report.valid else 'NO'} |", flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
