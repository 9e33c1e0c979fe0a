"""The pool solver against the lower bound where the optimum is known or near it.

    .venv/bin/python benchmarks/pool_ladder.py                      # challenging A-K and own sets, 10 s each
    .venv/bin/python benchmarks/pool_ladder.py --sets own --time-limit 60
    .venv/bin/python benchmarks/pool_ladder.py --solver ladder      # the ladder alone, from greedy
    .venv/bin/python benchmarks/pool_ladder.py --node-limit 1000000 --det-time 0.1 --time-limit 600   # deterministic
    .venv/bin/python benchmarks/pool_ladder.py --baseline --baseline-off descent  # with and without the descent

Sets:

* ``challenging``: MiniMalloc's challenging A-K, read in place from
  ../shared/benchmarks/pool/minimalloc-challenging.
* ``zoo``: the device pools of zoo models planned by the ``tierflow`` policy on
  ``rtx4090-24g`` (meta capture, default budget), as ``tierflow simulate --pool best``
  lays them out, solved by ``best`` without the ladder (as before it) and with it,
  interleaved, at ``--zoo-time`` seconds (default 2, the ``--pool-time`` default).
* ``own``: eight sets with a perfect packing by construction (tierflow.pool.generate):
  guillotine cuts and stacked strips, 200-600 buffers, 500-2000 time steps, sizes in
  1 KiB multiples, each also with 10% of its buffers removed while one instant stays
  full (free space; the optimum still equals the bound).

Per set: peak / lower bound, whether the result is proven optimal, wall and CPU
seconds; geometric mean and max per group. Every answer is checked by the independent
validator (a failure exits non-zero). ``--det`` gives CP-SAT's deterministic time used
by the ladder (a clock-free measure of its work).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from tierflow import pool
from tierflow.pool import generate

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "benchmarks" / "pool" / "minimalloc-challenging"
# (construction, buffers, time steps, seed)
OWN = (("guillotine", 200, 500, 11), ("guillotine", 450, 1500, 12), ("strips", 250, 800, 13), ("strips", 600, 2000, 14))


def own_sets() -> list[pool.Problem]:
    out = []
    for kind, n, steps, seed in OWN:
        make = generate.guillotine if kind == "guillotine" else generate.strips
        p, witness = make(n, steps=steps, seed=seed)
        out.append(p)
        out.append(generate.with_free_space(p, witness, 0.1, seed=seed)[0])
    return out


def challenging(cases: list[str] | None) -> list[pool.Problem]:
    files = sorted(DATA.glob("*.csv"))
    return [pool.read_csv(f) for f in files if not cases or f.stem in cases]


def run_ladder_alone(p: pool.Problem, limit: float, seed: int, det: float | None) -> pool.Solution:
    from tierflow.pool.greedy import best_fit
    from tierflow.pool.ladder import ladder
    from tierflow.pool.reduce import reduce

    t0 = time.perf_counter()
    red = reduce(p)
    start = best_fit(red.lower, red.upper, red.size, np.lexsort((np.arange(len(red)), red.lower, -red.size)))
    res = ladder(red, start, time_limit=limit, seed=seed, det_budget=det)
    off = red.expand(res.offsets)
    peak = int((off + p.size).max())
    return pool.Solution(off, peak, p.lower_bound, "ladder", time.perf_counter() - t0,
                         optimal=peak == p.lower_bound or res.optimal,
                         meta={"ladder": {"attempts": [{"status": a.status, "by": a.variant} for a in res.attempts]}})


ZOO = ("gpt2-small", "bert-base", "vit-b16", "resnet50", "gpt-tiny", "bert-tiny", "vit-tiny", "llama-tiny", "mlp")


def zoo_rows(limit: float, seed: int) -> bool:
    from tierflow import load_hardware
    from tierflow.capture import zoo_trace
    from tierflow.policies import make_plan
    from tierflow.pool import best

    hw = load_hardware("rtx4090-24g")
    print(f"\n### zoo pools (tierflow policy, rtx4090-24g; best --time-limit {limit:g} without / with the ladder)\n")
    print("| model | buffers | lower bound | before | before/LB | after | after/LB | found by | valid |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    ok = True
    for name in ZOO:
        trace = zoo_trace(name, hardware=hw)
        try:
            p = pool.from_trace(trace, make_plan("tierflow", trace, hw), hw)
        except pool.PoolError as e:  # a plan that recomputes or host-steps has no pool model yet
            print(f"| {name} | | | skipped: {e} | | | | | |")
            continue
        saved = best.LADDER_MAX_BUFFERS
        try:
            best.LADDER_MAX_BUFFERS = 0
            before = pool.solve(p, "best", time_limit=limit, seed=seed)
        finally:
            best.LADDER_MAX_BUFFERS = saved
        after = pool.solve(p, "best", time_limit=limit, seed=seed)
        valid = all(pool.validate(p, s.offsets, s.peak).valid for s in (before, after))
        ok &= valid
        print(f"| {name} | {len(p)} | {p.lower_bound:,} | {before.peak:,} | {before.ratio:.4f} | {after.peak:,} | "
              f"{after.ratio:.4f} | {after.meta.get('found_by')} | {'yes' if valid else 'NO'} |", flush=True)
    return ok


def _geo(ratios: list[float]) -> float:
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else 1.0


def without(p: pool.Problem, args: argparse.Namespace) -> pool.Solution:
    """best as it was before the ladder (``--baseline-off ladder``) or before the
    min-conflicts descent (``--baseline-off descent``): the same call with that part off."""
    from tierflow.pool import best

    knob, off = ("LADDER_MAX_BUFFERS", 0) if args.baseline_off == "ladder" else ("DESCENT_AT", 1.0)
    saved = getattr(best, knob)
    try:
        setattr(best, knob, off)
        return pool.solve(p, "best", time_limit=args.time_limit, seed=args.seed, node_limit=args.node_limit)
    finally:
        setattr(best, knob, saved)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="*", default=["challenging", "own"], choices=["challenging", "own", "zoo"])
    ap.add_argument("--zoo-time", type=float, default=2.0, help="seconds per zoo pool (default 2)")
    ap.add_argument("--cases", nargs="*", default=None, help="only these case names")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--solver", default="best", choices=["best", "ladder"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", action="store_true",
                    help="also run best without the ladder (as before it) on each case, just before, same limits")
    ap.add_argument("--baseline-off", default="ladder", choices=["ladder", "descent"],
                    help="what --baseline switches off (default the ladder)")
    ap.add_argument("--node-limit", type=int, default=None,
                    help="best: deterministic mode, search nodes (with --det-time for the ladder after it)")
    ap.add_argument("--det-time", type=float, default=None,
                    help="CP-SAT deterministic time: best with --node-limit, or the ladder alone (one lane); "
                    "the wall limit then only caps the run")
    args = ap.parse_args(argv)
    print(f"load average at start: {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs", file=sys.stderr)
    ok = True
    for group in args.sets:
        if group == "zoo":
            ok &= zoo_rows(args.zoo_time, args.seed)
            continue
        problems = challenging(args.cases) if group == "challenging" else [
            p for p in own_sets() if not args.cases or p.name in args.cases]
        det = "" if args.det_time is None else f", --node-limit {args.node_limit}, --det-time {args.det_time:g}"
        print(f"\n### {group} ({args.solver}, --time-limit {args.time_limit:g}{det})\n")
        extra = f" without {args.baseline_off}: peak/LB |" if args.baseline else ""
        print(f"| case | buffers | lower bound |{extra} peak | peak/LB | proven optimal | found by | wall s | CPU s | valid |")
        print("|---|---:|---:|" + ("---:|" if args.baseline else "") + "---:|---:|---|---|---:|---:|---|")
        ratios, proven, base_ratios = [], 0, []
        for p in problems:
            before = ""
            if args.baseline:
                b = without(p, args)
                ok &= pool.validate(p, b.offsets, b.peak).valid
                base_ratios.append(b.ratio)
                before = f" {b.ratio:.4f} |"
            t0, c0 = time.perf_counter(), time.process_time()
            if args.solver == "ladder":
                sol = run_ladder_alone(p, args.time_limit, args.seed, args.det_time)
            else:
                sol = pool.solve(p, "best", time_limit=args.time_limit, seed=args.seed, node_limit=args.node_limit,
                                 ladder_det_budget=args.det_time)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            report = pool.validate(p, sol.offsets, sol.peak)
            ok &= report.valid
            ratios.append(sol.ratio)
            proven += bool(sol.optimal)
            print(f"| {p.name} | {len(p)} | {p.lower_bound:,} |{before} {sol.peak:,} | {sol.ratio:.4f} | "
                  f"{'yes' if sol.optimal else 'no'} | {sol.meta.get('found_by', sol.solver)} | {wall:.1f} | {cpu:.1f} | "
                  f"{'yes' if report.valid else 'NO'} |", flush=True)
        geo = _geo(ratios)
        pad = f" {_geo(base_ratios):.4f} |" if args.baseline else ""
        print(f"| geomean | | |{pad} | {geo:.4f} | {proven}/{len(ratios)} proven | | | | |")
        pad = f" {max(base_ratios, default=1.0):.4f} |" if args.baseline else ""
        print(f"| max | | |{pad} | {max(ratios, default=1.0):.4f} | | | | | |")
    print(f"load average at end: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
