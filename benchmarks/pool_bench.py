"""Run the pool solvers on the shared benchmarks and print a markdown table.

    .venv/bin/python benchmarks/pool_bench.py                 # 10 s (challenging), 30 s (idealloc)
    .venv/bin/python benchmarks/pool_bench.py --time-limit 5  # both sets at 5 s

Every solution is checked by the independent validator; the data is read in place from
../shared/benchmarks/pool. Each row gives best's wall seconds and the CPU seconds the
process used meanwhile (on a busy machine CPU < wall: the difference went to others).
The first run on a machine also compiles the search (numba, cached on disk after);
``--warm`` compiles it before the timed runs, on a tiny problem.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

from tierflow import pool

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "benchmarks" / "pool"
SETS = {"minimalloc-challenging": 10.0, "idealloc": 30.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA, help="benchmark root (default: %(default)s)")
    ap.add_argument("--time-limit", type=float, default=None, help="seconds per case for best (default: 10 / 30)")
    ap.add_argument("--sets", nargs="*", default=list(SETS), help="which sets to run")
    ap.add_argument("--cases", nargs="*", default=None, help="only these case names")
    ap.add_argument("--node-limit", type=int, default=None, help="nodes per case for best (deterministic)")
    ap.add_argument("--warm", action="store_true", help="compile the search before timing")
    args = ap.parse_args(argv)
    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}", file=sys.stderr)
    if args.warm:
        t0, c0 = time.perf_counter(), time.process_time()
        from tierflow.pool import search

        # one call of each compiled kernel: the heuristics' and the search's
        tiny = pool.Problem((pool.Buffer("long", 0, 10, 4), pool.Buffer("l1", 0, 5, 6),
                             pool.Buffer("r1", 5, 10, 3), pool.Buffer("r2", 5, 10, 3)))
        sec = search.Sections(tiny.lower, tiny.upper, tiny.units)
        order = search.preorders(tiny.lower, tiny.upper, tiny.units, sec)["TWA"]
        search.lowest_first(tiny.units, order, sec)
        search.feasible(tiny.units, 10, order, sec, time.perf_counter() + 600, 100)
        print(f"warm-up (JIT or cache load): {time.perf_counter() - t0:.1f} s wall, "
              f"{time.process_time() - c0:.1f} s CPU", file=sys.stderr)
    ok = True
    for name in args.sets:
        files = sorted((args.data / name).glob("*.csv"), key=lambda f: (f.stat().st_size, f.stem))
        if args.cases:
            files = [f for f in files if f.stem in args.cases]
        limit = args.time_limit if args.time_limit is not None else SETS.get(name, 10.0)
        print(f"\n### {name} (best: --time-limit {limit:g})\n")
        print("| case | buffers | lower bound | greedy | greedy/LB | best | best/LB | wall s | CPU s | valid |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        logs_g, logs_b = [], []
        for f in files:
            p = pool.read_csv(f)
            g = pool.solve(p, "greedy")
            t0, c0 = time.perf_counter(), time.process_time()
            b = pool.solve(p, "best", time_limit=limit, node_limit=args.node_limit)
            secs, cpu = time.perf_counter() - t0, time.process_time() - c0
            valid = pool.validate(p, g.offsets, g.peak).valid and pool.validate(p, b.offsets, b.peak).valid
            ok &= valid and b.peak <= g.peak
            logs_g.append(math.log(g.ratio))
            logs_b.append(math.log(b.ratio))
            print(
                f"| {f.stem} | {len(p):,} | {p.lower_bound:,} | {g.peak:,} | {g.ratio:.4f} | {b.peak:,} | "
                f"{b.ratio:.4f} | {secs:.1f} | {cpu:.1f} | {'yes' if valid else 'NO'} |",
                flush=True,
            )
        if files:
            gm_g, gm_b = math.exp(sum(logs_g) / len(files)), math.exp(sum(logs_b) / len(files))
            above = sum(math.exp(v) > 1.06 for v in logs_b)
            print(f"| geomean | | | | {gm_g:.4f} | | {gm_b:.4f} | | | |")
            print(f"\ncases above 1.06 x LB: {above}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
