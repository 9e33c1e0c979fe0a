"""Baselines on G10's five workloads beside G10's published figures.

    python benchmarks/g10_baselines.py [--g10 ../shared/benchmarks/g10] [--policies lru,deepum]

A policy may carry options: ``lru:refetch_dead=1`` (see each policy's docstring).

Prints a markdown table per metric: ratio of ideal (ours vs G10's published column),
traffic per iteration in 4 KiB pages (ours vs published), and the time to plan and
simulate each case on this machine. The published numbers are read from G10's files,
never typed in here.
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from pathlib import Path

from tierflow import load_hardware, load_trace
from tierflow.policies import make_plan
from tierflow.simulate import simulate

CASES = [  # (directory, label in G10's tables)
    ("bert-256", "BERT"),
    ("vit-1280", "ViT"),
    ("inceptionv3-1536", "Inceptionv3"),
    ("resnet152-1280", "ResNet152"),
    ("senet154-1024", "SENet154"),
]
# our policy -> G10's column header
G10_COLUMN = {"lru": "lru", "deepum": "deepUM", "g10": "prefetch_lru", "flashneuron": "FlashNeuron"}
TRAFFIC_ROWS = ("ssd->gpu", "gpu->ssd", "host->gpu", "gpu->host")


def read_published(g10: Path) -> tuple[dict, dict]:
    """({label: {column: ratio}}, {label: {column: {direction: pages}}})."""
    ratios: dict[str, dict[str, float]] = {}
    lines = [x.strip() for x in (g10 / "published" / "all.base.txt").read_text().splitlines() if x.strip()]
    header = [h.strip() for h in lines[0].split("|")]
    for label_line, values in zip(lines[1::2], lines[2::2]):
        label = label_line.split("|")[0]
        nums = [float(v) for v in values.split()]
        ideal = nums[header.index("ideal")]
        ratios[label] = {h: (ideal / v if math.isfinite(v) else 0.0) for h, v in zip(header, nums)}
    traffic: dict[str, dict[str, dict[str, float]]] = {}
    lines = [x.strip() for x in (g10 / "published" / "overall_traffic" / "traffic.txt").read_text().splitlines() if x.strip()]
    header = [h.strip() for h in lines[0].split("|")]
    i = 1
    while i < len(lines):
        label = lines[i].split("|")[0]
        rows = [[float(v) for v in lines[i + 1 + k].split()] for k in range(4)]
        traffic[label] = {h: {d: rows[k][j] for k, d in enumerate(TRAFFIC_ROWS)} for j, h in enumerate(header)}
        i += 5
    return ratios, traffic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--g10", default=str(Path(__file__).resolve().parents[2] / "shared" / "benchmarks" / "g10"))
    ap.add_argument("--policies", default="lru,lru:refetch_dead=1,deepum")
    ap.add_argument("--hardware", default="g10-a100")
    args = ap.parse_args()
    g10 = Path(args.g10)
    hw = load_hardware(args.hardware)
    policies = args.policies.split(",")
    ratios, traffic = read_published(g10)

    rows, timing, pages = [], [], []
    for case, label in CASES:
        trace = load_trace(g10 / case)
        row = [f"{case}"]
        for p in policies:
            name, _, opts = p.partition(":")
            # text: make_plan coerces each value to the type the policy declares
            extra = dict(o.split("=", 1) for o in opts.split(",") if o)
            t0 = time.perf_counter()
            plan = make_plan(name, trace, hw, **extra)
            t1 = time.perf_counter()
            res = simulate(trace, hw, plan)
            t2 = time.perf_counter()
            pub = ratios[label].get(G10_COLUMN.get(name, ""), float("nan"))
            row += [f"{res.ratio:.3f}", f"{pub:.3f}"]
            timing.append(f"| {case} | {trace.n_ops} | {p} | {t1 - t0:.3f} | {t2 - t1:.3f} |")
            pub_t = traffic[label].get(G10_COLUMN.get(name, ""), {})
            ours = {d: res.traffic_bytes.get(d, 0) / 4096 / 1e6 for d in TRAFFIC_ROWS}
            pages.append(
                f"| {case} | {p} | "
                + " | ".join(f"{ours[d]:.2f} / {pub_t.get(d, float('nan')) / 1e6:.2f}" for d in TRAFFIC_ROWS)
                + " |"
            )
        rows.append("| " + " | ".join(row) + " |")

    print(f"Machine: {platform.machine()}, {platform.processor() or 'cpu'}, Python {platform.python_version()}; hardware preset {hw.name}\n")
    head = " | ".join(f"{p} (ours) | {G10_COLUMN.get(p.partition(':')[0], p)} (G10)" for p in policies)
    print(f"| case | {head} |")
    print("|---" * (1 + 2 * len(policies)) + "|")
    print("\n".join(rows))
    print("\nTraffic per iteration, millions of 4 KiB pages, ours / G10 published:\n")
    print("| case | policy | " + " | ".join(TRAFFIC_ROWS) + " |")
    print("|---|---|---|---|---|---|")
    print("\n".join(pages))
    print("\nSeconds to plan and to simulate (two iterations):\n")
    print("| case | kernels | policy | plan s | simulate s |")
    print("|---|---|---|---|---|")
    print("\n".join(timing))


if __name__ == "__main__":
    main()
