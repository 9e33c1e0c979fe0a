"""How often a machine upgrade makes a policy slower, over random training-shaped cases.

    python benchmarks/robustness.py [--cases 400] [--seed 0] [--policies lru,g10,tierflow]
                                    [--same-plan]

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

With ``--same-plan`` each policy plans once, on the base machine, and that one plan is
simulated on both machines: what is left is the executor's part (the simulator, and for
reactive plans its demand pager), without the planner's. A plan that is slower on the
better machine there is not the planner's doing; cases where the policy cannot plan for
the base machine are left out (the "cases" column counts the rest).
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


def same_plan_steps(name: str, trace, hw, upgrade, budget: int) -> tuple[float, float] | None:
    """(base step, upgraded step) of the plan made for the base machine; None if none fits."""
    try:
        plan = make_plan(name, trace, hw, budget=budget)
    except PlanError:
        return None
    # a SimResult's time_s is inf where the plan cannot run
    return simulate(trace, hw, plan).time_s, simulate(trace, upgrade, plan).time_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=None, help="comma-separated (default: every policy)")
    ap.add_argument("--same-plan", action="store_true",
                    help="simulate the base machine's plan on both machines (the executor's part only)")
    args = ap.parse_args()
    names = args.policies.split(",") if args.policies else policy_names()
    rng = np.random.default_rng(args.seed)
    cases = [draw_case(rng) for _ in range(args.cases)]
    print(f"Machine: {platform.machine()}, Python {platform.python_version()}; "
          f"{args.cases} cases, seed {args.seed}"
          f"{'; one plan per case, made for the base machine' if args.same_plan else ''}\n")
    print("| policy | cases | slower | on link upgrades | on host-memory upgrades "
          "| worst slowdown | median slowdown | CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        c0 = time.process_time()
        slow = {"links": 0, "host-memory": 0}
        amounts = []
        ran = {"links": 0, "host-memory": 0}
        for trace, budget, hw, kind, factor in cases:
            side = "host-memory" if kind == "host-memory" else "links"
            up = upgraded(hw, kind, factor)
            if args.same_plan:
                steps = same_plan_steps(name, trace, hw, up, budget)
                if steps is None:
                    continue
                before, after = steps
            else:
                before, after = step_s(name, trace, hw, budget), step_s(name, trace, up, budget)
            ran[side] += 1
            if after > before * (1 + REL_TOL) + 1e-12:
                slow[side] += 1
                amounts.append(after / before - 1 if math.isfinite(after) else math.inf)
        worst = f"{max(amounts):.2%}" if amounts else "-"
        median = f"{statistics.median(amounts):.2%}" if amounts else "-"
        total = slow["links"] + slow["host-memory"]
        print(f"| {name} | {ran['links'] + ran['host-memory']} | {total} | {slow['links']} of {ran['links']} "
              f"| {slow['host-memory']} of {ran['host-memory']} | {worst} | {median} | {time.process_time() - c0:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
