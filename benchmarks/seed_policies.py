"""The seed-system policies on G10's five workloads: ratio of ideal and planning seconds.

    python benchmarks/seed_policies.py [--g10 ../shared/benchmarks/g10] [--hardware g10-a100]
                                       [--policies flashneuron,vdnn,singa,myelin,deeptm]
                                       [--budget 40GiB]

For every case and policy: the plan is made (timed), checked by ``validate`` and
simulated; the table gives the simulated ratio (ideal / step time), "no fit" where the
policy's own algorithm cannot meet the budget (the PlanError's planned bytes are
printed below the table), and the planning seconds. G10's published FlashNeuron ratio
is printed beside ours, read from G10's files.
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from pathlib import Path

from tierflow import load_hardware, load_trace, validate
from tierflow.errors import PlanError
from tierflow.policies import make_plan
from tierflow.simulate import simulate

CASES = [
    ("bert-256", "BERT"),
    ("vit-1280", "ViT"),
    ("inceptionv3-1536", "Inceptionv3"),
    ("resnet152-1280", "ResNet152"),
    ("senet154-1024", "SENet154"),
]


def published_flashneuron(g10: Path) -> dict[str, float]:
    lines = [x.strip() for x in (g10 / "published" / "all.base.txt").read_text().splitlines() if x.strip()]
    header = [h.strip() for h in lines[0].split("|")]
    out = {}
    for label_line, values in zip(lines[1::2], lines[2::2]):
        nums = [float(v) for v in values.split()]
        fn = nums[header.index("FlashNeuron")]
        out[label_line.split("|")[0]] = nums[header.index("ideal")] / fn if math.isfinite(fn) else 0.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--g10", default=str(Path(__file__).resolve().parents[2] / "shared" / "benchmarks" / "g10"))
    ap.add_argument("--hardware", default="g10-a100")
    ap.add_argument("--policies", default="flashneuron,vdnn,singa,myelin,deeptm")
    ap.add_argument("--budget", default=None)
    args = ap.parse_args()
    g10 = Path(args.g10)
    hw = load_hardware(args.hardware)
    names = args.policies.split(",")
    pub = published_flashneuron(g10)
    rows, notes, worst = [], [], 0.0
    for case, label in CASES:
        trace = load_trace(g10 / case)
        cells = []
        for name in names:
            t0 = time.perf_counter()
            try:
                plan = make_plan(name, trace, hw, budget=args.budget)
            except PlanError as e:
                dt = time.perf_counter() - t0
                cells.append(f"no fit | {dt:.2f}")
                notes.append(f"- {case}, {name}: {e}")
                worst = max(worst, dt)
                continue
            dt = time.perf_counter() - t0
            worst = max(worst, dt)
            validate(plan, trace, hw)
            r = simulate(trace, hw, plan)
            cells.append(f"{r.ratio:.3f}{'' if r.fits else ' (no fit)'} | {dt:.2f}")
        fn = pub.get(label, float("nan"))
        fn_cell = f"{fn:.3f}" if fn else "inf (no fit)"
        rows.append(f"| {case} | {trace.n_ops} | " + " | ".join(cells) + f" | {fn_cell} |")
    print(
        f"Machine: {platform.machine()}, {platform.processor() or 'cpu'}, Python {platform.python_version()}; "
        f"hardware preset {hw.name}; budget {args.budget or 'device capacity'}\n"
    )
    print("| case | kernels | " + " | ".join(f"{n} ratio | {n} plan s" for n in names) + " | FlashNeuron (G10 published) |")
    print("|---|---|" + "---|---|" * len(names) + "---|")
    print("\n".join(rows))
    print(f"\nSlowest planning: {worst:.2f} s")
    if notes:
        print("\nWhere a policy cannot fit:\n")
        print("\n".join(notes))


if __name__ == "__main__":
    main()
