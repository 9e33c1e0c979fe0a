"""tierflow on G10's five workloads, beside G10's published figures, every other policy
this build has, and the physical bound (no plan can do better).

    python benchmarks/tierflow_vs_bound.py [--g10 ../shared/benchmarks/g10] [--cases bert-256,...]
                                           [--policies lru,deepum,g10,...] [--points 100]

Prints one markdown table: per case the ratio ideal/step of tierflow and of each other
policy (simulated here), G10's published ratio (read from G10's files), the bound,
tierflow's distance to it (bound - ratio), the seconds tierflow took to plan (wall clock
and CPU time of this process: the CPU figure is less sensitive to a loaded machine; and the
CPU seconds of that spent planning and simulating its deeptm seed), the seed its plan grew
from and the repair simulations it ran, and the seconds the bound took
to solve. Then the geometric means. Ratios of tierflow, G10 and the bound are printed to
4 decimals (others to 3). A policy that fails on a case shows its error class instead of
a number.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from g10_baselines import CASES, read_published  # noqa: E402
from tierflow import load_hardware, load_trace  # noqa: E402
from tierflow.bound import physical_bound  # noqa: E402
from tierflow.policies import make_plan, policy_names  # noqa: E402
from tierflow.simulate import simulate  # noqa: E402


def _geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--g10", default=str(Path(__file__).resolve().parents[2] / "shared" / "benchmarks" / "g10"))
    ap.add_argument("--cases", default=",".join(c for c, _ in CASES))
    ap.add_argument("--policies", default=None, help="others to compare (default: every policy present)")
    ap.add_argument("--hardware", default="g10-a100")
    ap.add_argument("--points", type=int, default=100, help="check ops of the bound")
    args = ap.parse_args()
    g10 = Path(args.g10)
    hw = load_hardware(args.hardware)
    ratios, _ = read_published(g10)
    labels = dict(CASES)
    others = (
        args.policies.split(",") if args.policies
        else [p for p in policy_names() if p not in ("ideal", "tierflow")]
    )
    head = ["case", "tierflow", "G10 published"] + others + [
        "bound", "distance", "plan s", "plan CPU s", "of which deeptm seed", "seed", "repairs", "bound s"]
    print(f"Machine: {platform.machine()}, Python {platform.python_version()}; hardware preset {hw.name}\n")
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    cols: dict[str, list[float]] = {h: [] for h in ["tierflow", "G10 published", "bound", *others]}
    for case in args.cases.split(","):
        trace = load_trace(g10 / case)
        t0, c0 = time.perf_counter(), time.process_time()
        plan = make_plan("tierflow", trace, hw)
        plan_s, plan_cpu = time.perf_counter() - t0, time.process_time() - c0
        ours = simulate(trace, hw, plan).ratio
        row = [case, f"{ours:.4f}"]
        pub = ratios.get(labels.get(case, ""), {}).get("prefetch_lru", float("nan"))
        row.append(f"{pub:.4f}")
        cols["tierflow"].append(ours)
        cols["G10 published"].append(pub)
        for p in others:
            try:
                r = simulate(trace, hw, make_plan(p, trace, hw)).ratio
                row.append(f"{r:.3f}")
                cols[p].append(r)
            except Exception as e:  # report, do not hide: a failing baseline is a finding
                row.append(type(e).__name__)
        b = physical_bound(trace, hw, points=args.points)
        cols["bound"].append(b.bound_ratio)
        seed = str(plan.meta.get("seed", "")).replace("'", "").replace("g10_accounting", "books").replace("line_share", "line")
        dtm_cpu = plan.meta.get("seed_cpu_s", {}).get("deeptm")
        row += [f"{b.bound_ratio:.4f}", f"{b.bound_ratio - ours:.4f}", f"{plan_s:.2f}", f"{plan_cpu:.2f}",
                "" if dtm_cpu is None else f"{dtm_cpu:.2f}",
                seed.replace("|", "/"), str(plan.meta.get("repair_simulations", "")), f"{b.seconds:.2f}"]
        print("| " + " | ".join(row) + " |", flush=True)
    n_cases = len(cols["tierflow"])
    gm = ["geomean", f"{_geomean(cols['tierflow']):.4f}", f"{_geomean(cols['G10 published']):.4f}"]
    # a policy that failed on some case has no comparable mean
    gm += [f"{_geomean(cols[p]):.3f}" if len(cols[p]) == n_cases else f"({len(cols[p])} of {n_cases} ran)" for p in others]
    gm += [f"{_geomean(cols['bound']):.4f}", "", "", "", "", "", "", ""]
    print("| " + " | ".join(gm) + " |")


if __name__ == "__main__":
    main()
