"""Run the pool solvers on the shared benchmarks and print a markdown table.

    .venv/bin/python benchmarks/pool_bench.py                 # 10 s (challenging), 30 s (idealloc)
    .venv/bin/python benchmarks/pool_bench.py --time-limit 5  # both sets at 5 s

Every solution is checked by the independent validator; the data is read in place from
../shared/benchmarks/pool.
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
    args = ap.parse_args(argv)
    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}", file=sys.stderr)
    ok = True
    for name in args.sets:
        files = sorted((args.data / name).glob("*.csv"), key=lambda f: (f.stat().st_size, f.stem))
        if args.cases:
            files = [f for f in files if f.stem in args.cases]
        limit = args.time_limit if args.time_limit is not None else SETS.get(name, 10.0)
        print(f"\n### {name} (best: --time-limit {limit:g})\n")
        print("| case | buffers | lower bound | greedy | greedy/LB | best | best/LB | best s | valid |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
        logs_g, logs_b = [], []
        for f in files:
            p = pool.read_csv(f)
            g = pool.solve(p, "greedy")
            t0 = time.perf_counter()
            b = pool.solve(p, "best", time_limit=limit)
            secs = time.perf_counter() - t0
            valid = pool.validate(p, g.offsets, g.peak).valid and pool.validate(p, b.offsets, b.peak).valid
            ok &= valid and b.peak <= g.peak
            logs_g.append(math.log(g.ratio))
            logs_b.append(math.log(b.ratio))
            print(
                f"| {f.stem} | {len(p):,} | {p.lower_bound:,} | {g.peak:,} | {g.ratio:.4f} | {b.peak:,} | "
                f"{b.ratio:.4f} | {secs:.1f} | {'yes' if valid else 'NO'} |",
                flush=True,
            )
        if files:
            gm_g, gm_b = math.exp(sum(logs_g) / len(files)), math.exp(sum(logs_b) / len(files))
            print(f"| geomean | | | | {gm_g:.4f} | | {gm_b:.4f} | | |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
