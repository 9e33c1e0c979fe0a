"""How often a machine upgrade makes a policy slower, over random training-shaped cases.

    python benchmarks/robustness.py [--cases 400] [--seed 0] [--policies lru,g10,tierflow]

The property test (tests/test_policy_robustness.py) looks for one counterexample and
shrinks it; this script measures how common they are. Each case draws, with a seeded
generator, what the test draws: a :func:`tierflow.synthetic.training_trace` of 1-4
layers (tensors 1-60 MB, ops 1-30 ms), a budget between the minimum working set and
the peak, a :func:`tierflow.synthetic.toy_hardware` (PCIe 1, 4 or 16 GB/s; host
memory 0.05, 0.2 or 64 GiB; fault latency 0 or 45 us) and one upgrade: every link,
the host's links or the SSD's links 1.5x, 2x, 4x or 10x faster, or 1.5x-10x the host
memory. Every policy plans and is simulated on both machines; a case is *slower* if
the upgraded step exceeds the base step by more than 1e-9 relative (the test's
tolerance), or if the policy fits the base machine but not the upgrade.

Prints one markdown table: per policy, the cases, how many were slower (all upgrades,
then link upgrades and host-memory upgrades apart), and the worst and median
slowdown among them. The draws are uniform, not hypothesis's edge-seeking ones, so the
rates say how common a counterexample is, not whether one exists.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time

import numpy as np

from tierflow.errors import PlanError
from tierflow.policies import make_plan, min_working_set, policy_names
from tierflow.simulate import simulate
from tierflow.synthetic import UPGRADES, toy_hardware, training_trace, upgraded

REL_TOL = 1e-9
FACTORS = (1.5, 2.0, 4.0, 10.0)


def draw_case(rng: np.random.Generator):
    layers = int(rng.integers(1, 5))
    trace = training_trace(
        layers,
        rng.integers(1, 61, 4 * layers + 2).tolist(),
        rng.integers(1, 31, 3 * layers + 2).tolist(),
    )
    need, _ = min_working_set(trace)
    budget = int(rng.integers(need, max(need, trace.peak_live_bytes) + 1))
    hw = toy_hardware(
        pcie_gbps=float(rng.choice([1.0, 4.0, 16.0])),
        host_gib=float(rng.choice([0.05, 0.2, 64.0])),
        fault_us=float(rng.choice([0.0, 45.0])),
    )
    kind = str(rng.choice(UPGRADES))
    factor = float(rng.choice(FACTORS))
    return trace, budget, hw, kind, factor


def step_s(name: str, trace, hw, budget: int) -> float:
    try:
        plan = make_plan(name, trace, hw, budget=budget)
    except PlanError:
        return math.inf
    r = simulate(trace, hw, plan)
    return r.time_s if r.error is None else math.inf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=None, help="comma-separated (default: every policy)")
    args = ap.parse_args()
    names = args.policies.split(",") if args.policies else policy_names()
    rng = np.random.default_rng(args.seed)
    cases = [draw_case(rng) for _ in range(args.cases)]
    print(f"Machine: {platform.machine()}, Python {platform.python_version()}; "
          f"{args.cases} cases, seed {args.seed}\n")
    print("| policy | cases | slower | on link upgrades | on host-memory upgrades "
          "| worst slowdown | median slowdown | CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    n_mem = sum(1 for c in cases if c[3] == "host-memory")
    for name in names:
        c0 = time.process_time()
        slow = {"links": 0, "host-memory": 0}
        amounts = []
        for trace, budget, hw, kind, factor in cases:
            before = step_s(name, trace, hw, budget)
            after = step_s(name, trace, upgraded(hw, kind, factor), budget)
            if after > before * (1 + REL_TOL) + 1e-12:
                slow["host-memory" if kind == "host-memory" else "links"] += 1
                amounts.append(after / before - 1 if math.isfinite(after) else math.inf)
        worst = f"{max(amounts):.2%}" if amounts else "-"
        median = f"{statistics.median(amounts):.2%}" if amounts else "-"
        total = slow["links"] + slow["host-memory"]
        print(f"| {name} | {args.cases} | {total} | {slow['links']} of {args.cases - n_mem} "
              f"| {slow['host-memory']} of {n_mem} | {worst} | {median} | {time.process_time() - c0:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
