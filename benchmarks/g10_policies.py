"""Every policy in the registry on G10's five workloads, beside G10's published figures.

    python benchmarks/g10_policies.py [--g10 ../shared/benchmarks/g10] [--policies a,b]

Besides the registry's policies it runs two G10 rows: G10's own plan
(``prefetch_guide.config``) replayed in tierflow's simulator, and ``g10`` planned with
the machine's real figures instead of G10's own bookkeeping (``g10_accounting=0``). Prints markdown: the ratio of ideal per
case (ours / G10's published column where G10 has one), G10's published columns that
have no tierflow counterpart, and the seconds to plan and to simulate each case on this
machine. Published numbers are read from G10's files (``read_published``), never
typed in here. A policy that fails on a case is shown as ``error`` with its message
below the table.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from g10_baselines import CASES, G10_COLUMN, TRAFFIC_ROWS, read_published  # noqa: E402
from tierflow import load_hardware, load_trace  # noqa: E402
from tierflow.formats.g10_plan import load_g10_plan  # noqa: E402
from tierflow.policies import make_plan, policy_names  # noqa: E402
from tierflow.simulate import simulate  # noqa: E402

REPLAY = "g10 plan replayed"
ACCOUNTING = "g10:g10_accounting=0"
COLUMN = dict(G10_COLUMN, **{REPLAY: "prefetch_lru", ACCOUNTING: "prefetch_lru"})
PUBLISHED_ONLY = ("G10GDSSSD", "G10GDSFULL")  # G10-GDS, G10-Host


def _run(row: str, trace, hw, case_dir: Path):
    """(plan, plan seconds) for one row of the table."""
    t0 = time.perf_counter()
    if row == REPLAY:
        plan = load_g10_plan(case_dir / "prefetch_guide.config", trace, hw, budget=hw.device_capacity)
    else:
        name, _, opts = row.partition(":")
        # text: make_plan coerces each value to the type the policy declares
        extra = dict(o.split("=", 1) for o in opts.split(",") if o)
        plan = make_plan(name, trace, hw, **extra)
    return plan, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--g10", default=str(Path(__file__).resolve().parents[2] / "shared" / "benchmarks" / "g10"))
    ap.add_argument("--policies", default=None, help="comma-separated rows (default: every registered policy)")
    ap.add_argument("--hardware", default="g10-a100")
    args = ap.parse_args()
    g10 = Path(args.g10)
    hw = load_hardware(args.hardware)
    ratios, traffic = read_published(g10)
    rows = args.policies.split(",") if args.policies else policy_names() + [ACCOUNTING, REPLAY]

    cell: dict[tuple[str, str], str] = {}
    timing, errors, pages = [], [], []
    for case, label in CASES:
        trace = load_trace(g10 / case)
        for row in rows:
            if row == REPLAY and not (g10 / case / "prefetch_guide.config").exists():
                cell[(row, case)] = "n/a"
                continue
            try:
                plan, plan_s = _run(row, trace, hw, g10 / case)
                t1 = time.perf_counter()
                res = simulate(trace, hw, plan)
                sim_s = time.perf_counter() - t1
            except Exception as e:  # another engineer's policy may not handle every case yet
                cell[(row, case)] = "error"
                errors.append(f"- {row} on {case}: {type(e).__name__}: {str(e)[:200]}")
                continue
            ours = f"{res.ratio:.3f}" if res.error is None else "fails"
            if res.error:
                errors.append(f"- {row} on {case}: {res.error[:200]}")
            pub = ratios[label].get(COLUMN.get(row.partition(":")[0] if row != REPLAY else row, ""))
            shown = "" if pub is None else (" / inf" if pub == 0 else f" / {pub:.3f}")  # inf: G10 cannot run it
            cell[(row, case)] = ours + shown
            if row.startswith("g10"):
                pub_t = traffic[label]["prefetch_lru"]
                pages.append(
                    f"| {case} | {row} | "
                    + " | ".join(f"{res.traffic_bytes.get(d, 0) / 4096 / 1e6:.3f} / {pub_t[d] / 1e6:.3f}" for d in TRAFFIC_ROWS)
                    + " |"
                )
            timing.append(f"| {case} | {trace.n_ops} | {row} | {plan_s:.2f} | {sim_s:.2f} |")
            print(f"{case} {row}: {cell[(row, case)]} (plan {plan_s:.2f} s, simulate {sim_s:.2f} s)", file=sys.stderr, flush=True)

    print(f"Machine: {platform.machine()}, Python {platform.python_version()}; hardware preset {hw.name}\n")
    print("Ratio of ideal, ours / G10's published column (`prefetch_lru` for the g10 rows):\n")
    print("| policy | " + " | ".join(case for case, _ in CASES) + " |")
    print("|---" * (1 + len(CASES)) + "|")
    for row in rows:
        print(f"| {row} | " + " | ".join(cell.get((row, case), "") for case, _ in CASES) + " |")
    for col in PUBLISHED_ONLY:
        vals = [ratios[label].get(col) for _, label in CASES]
        print(f"| G10 published {col} | " + " | ".join("inf" if v == 0 else f"{v:.3f}" for v in vals) + " |")
    if errors:
        print("\nFailures:\n")
        print("\n".join(errors))
    if pages:
        print("\nTraffic per iteration of the g10 rows, millions of 4 KiB pages, ours / G10 published:\n")
        print("| case | row | " + " | ".join(TRAFFIC_ROWS) + " |")
        print("|---|---|---|---|---|---|")
        print("\n".join(pages))
    print("\nSeconds to plan and to simulate (two iterations):\n")
    print("| case | kernels | policy | plan s | simulate s |")
    print("|---|---|---|---|---|")
    print("\n".join(timing))


if __name__ == "__main__":
    main()
