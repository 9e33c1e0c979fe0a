"""Every policy on captured zoo models too big for their GPU.

    python benchmarks/zoo_policies.py

Cases (issue 5): GPT-2-xl at batch 16 (fp32, AdamW) on ``rtx4090-24g`` with the whole
card as the budget, and Llama-7B at batch 4 x 2048 (bf16, AdamW) on
``h100-80g-pcie5-nvme`` with a 60 GiB budget. Each model is captured on the meta device
(nothing allocated; op times from the roofline cost model of that hardware), then every
policy plans under the budget and the simulator predicts the step. Prints one markdown
table per case: step time, ratio of ideal, stalls, bytes moved per link, device peak,
planning seconds (wall clock, and CPU time of this process, less sensitive to a loaded
machine); a policy that cannot plan shows why.
"""

from __future__ import annotations

import argparse
import platform
import time

from tierflow import load_hardware
from tierflow.capture import zoo_trace
from tierflow.errors import PlanError
from tierflow.policies import make_plan, policy_names
from tierflow.simulate import simulate

CASES = [
    # (model, batch, seq, dtype, hardware, budget)
    ("gpt2-xl", 16, 1024, "fp32", "rtx4090-24g", None),
    ("llama-7b", 4, 2048, "bf16", "h100-80g-pcie5-nvme", "60GiB"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default=None, help="comma-separated (default: every policy present)")
    args = ap.parse_args()
    names = args.policies.split(",") if args.policies else policy_names()
    print(f"Machine: {platform.machine()}, Python {platform.python_version()}\n")
    for model, batch, seq, dtype, hw_name, budget in CASES:
        hw = load_hardware(hw_name)
        t0 = time.perf_counter()
        trace = zoo_trace(model, batch=batch, seq=seq, dtype=dtype, hardware=hw)
        cap_s = time.perf_counter() - t0
        print(
            f"### {model}, batch {batch} x {seq}, {dtype}, AdamW on {hw_name}, budget {budget or 'the whole device'}\n\n"
            f"{trace.n_ops} ops, {trace.n_tensors} tensors; unconstrained peak "
            f"{trace.peak_live_bytes / 2**30:.1f} GiB; ideal step {trace.ideal_s * 1e3:.1f} ms; "
            f"captured on meta in {cap_s:.1f} s.\n"
        )
        links = [link.name for link in hw.links]
        print("| policy | step ms | ratio | stall ms | " + " | ".join(f"{n} GB" for n in links) + " | peak GiB | plan s | plan CPU s |")
        print("|---" * (7 + len(links)) + "|")
        notes = []
        for name in names:
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                plan = make_plan(name, trace, hw, budget=budget if name != "ideal" else None)
            except PlanError as e:
                print(f"| {name} | no plan | | | " + " | ".join("" for _ in links) + " | | | |")
                notes.append(f"- {name}: {e}")
                continue
            plan_s, plan_cpu = time.perf_counter() - t0, time.process_time() - c0
            r = simulate(trace, hw, plan)
            if r.error:
                print(f"| {name} | fails | | | " + " | ".join("" for _ in links) + f" | | {plan_s:.2f} | {plan_cpu:.2f} |")
                notes.append(f"- {name}: {r.error}")
                continue
            print(
                f"| {name} | {r.time_s * 1e3:.1f} | {r.ratio:.4f} | {r.stall_s * 1e3:.1f} | "
                + " | ".join(f"{r.traffic_bytes.get(n, 0) / 1e9:.1f}" for n in links)
                + f" | {r.peak_bytes[hw.device] / 2**30:.1f} | {plan_s:.2f} | {plan_cpu:.2f} |"
            )
        print("\n" + "\n".join(notes) + "\n")


if __name__ == "__main__":
    main()
