"""tierflow with all three levers (move, recompute, host step) beside move-only tierflow
and every other policy present, on the issue-14 zoo rows and G10's five workloads.

    python benchmarks/levers.py zoo [--cache /tmp/tierflow-zoo] [--cases gpt2-large,...] [--policies a,b] [--bound]
    python benchmarks/levers.py g10 [--g10 ../shared/benchmarks/g10] [--cases vit-1280,...] [--bound]

Per row: ratio ideal/step of ``tierflow`` (``levers=all``), of move-only tierflow
(``levers=move``) and of each other policy, planning seconds (wall and CPU of this
process) of both tierflow modes, which lever variant won, and the recompute and
host-step records of the plan. Then the geometric means (G10).

How the all-levers step is scored: by the simulator, on the mapped-back plan when the
simulator prices ``Recompute``/``HostStep``
(``tierflow.policies.tierflow.joint.LEVERS_SIMULATED``), otherwise on the lowered trace
the plan was made on (re-run ops are real ops there, priced as any op; see
``tierflow.policies.tierflow.joint``): the ``scored`` column says which. Zoo models are
captured on the meta device (op times from the roofline of the row's hardware); with
``--cache`` each trace is saved there on first use and read back afterwards.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tierflow import load_hardware, load_trace  # noqa: E402
from tierflow.errors import PlanError, PolicyError  # noqa: E402
from tierflow.policies import make_plan, policy_names  # noqa: E402
from tierflow.simulate import simulate  # noqa: E402

ZOO = [
    # (model, batch, seq, dtype, hardware, budget: None = the device, "50%" = half the peak)
    ("gpt2-large", 8, 1024, "fp32", "rtx4090-24g", None),
    ("gpt2-xl", 16, 1024, "fp32", "rtx4090-24g", None),
    ("llama-1b", 16, 2048, "bf16", "rtx4090-24g", None),
    ("llama-7b", 4, 2048, "bf16", "h100-80g-pcie5-nvme", "60GiB"),
    ("bert-large", 32, None, "fp32", "rtx4090-24g", "50%"),
    ("vit-l16", 64, None, "fp32", "rtx4090-24g", "50%"),
]
G10_CASES = ("bert-256", "vit-1280", "inceptionv3-1536", "resnet152-1280", "senet154-1024")


def _geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _zoo_trace(model, batch, seq, dtype, hw, cache: Path | None):
    path = cache / f"{model}-b{batch}-{dtype}-{hw.name}.json.gz" if cache else None
    if path is not None and path.exists():
        return load_trace(path)
    from tierflow.capture import zoo_trace

    trace = zoo_trace(model, batch=batch, seq=seq, dtype=dtype, hardware=hw)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        trace.save(path)
    return trace


def _tierflow(trace, hw, budget, levers):
    t0, c0 = time.perf_counter(), time.process_time()
    plan = make_plan("tierflow", trace, hw, budget=budget, levers=levers)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    info = plan.meta.get("levers") or {}
    if plan.recomputes or plan.host_steps:
        from tierflow.policies.tierflow.joint import LEVERS_SIMULATED

        if LEVERS_SIMULATED:
            ratio, scored = simulate(trace, hw, plan).ratio, "simulated"
        else:
            ratio, scored = trace.ideal_s / plan.meta["predicted_step_s"], "lowered trace"
    else:
        ratio, scored = simulate(trace, hw, plan).ratio, "simulated"
    return ratio, wall, cpu, plan, info, scored


def _row(label, trace, hw, budget, others, bound: bool = False):
    ratio, wall, cpu, plan, info, scored = _tierflow(trace, hw, budget, "all")
    m_ratio, m_wall, m_cpu, *_ = _tierflow(trace, hw, budget, "move")
    cells = [label, f"{ratio:.4f}", f"{m_ratio:.4f}"]
    best_other = 0.0
    for p in others:
        try:
            r = simulate(trace, hw, make_plan(p, trace, hw, budget=budget)).ratio
            cells.append(f"{r:.3f}")
            best_other = max(best_other, r)
        except (PlanError, PolicyError) as e:
            cells.append(type(e).__name__)
    rs = info.get("recompute_s", 0.0)
    cells += [f"{wall:.1f} / {cpu:.1f}", f"{m_wall:.1f} / {m_cpu:.1f}", info.get("variant", "moves only"),
              f"{len(plan.recomputes)} ({rs * 1e3:.0f} ms)", str(len(plan.host_steps)), scored]
    if bound:
        from tierflow.bound import levers_bound
        from tierflow.policies import resolve_budget

        t0 = time.process_time()
        b = levers_bound(trace, hw, resolve_budget(trace, hw, budget), points=100)
        cells += [f"{b.bound_ratio:.4f}", f"{time.process_time() - t0:.1f}"]
    print("| " + " | ".join(cells) + " |", flush=True)
    return ratio, m_ratio, best_other


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", choices=("zoo", "g10"))
    ap.add_argument("--cache", default=None, help="zoo: directory to keep captured traces in")
    ap.add_argument("--g10", default=str(Path(__file__).resolve().parents[2] / "shared" / "benchmarks" / "g10"))
    ap.add_argument("--cases", default=None, help="comma-separated models (zoo) or case directories (g10)")
    ap.add_argument("--policies", default=None, help="others to compare (default: every policy present)")
    ap.add_argument("--bound", action="store_true", help="add the levers bound (tierflow.bound.levers_bound, 100 check ops)")
    args = ap.parse_args()
    others = (args.policies.split(",") if args.policies is not None and args.policies
              else [] if args.policies == "" else [p for p in policy_names() if p not in ("ideal", "tierflow")])
    print(f"Machine: {platform.machine()}, Python {platform.python_version()} (shared, noisy: planning seconds "
          f"are wall / CPU of this process)\n")
    head = ["case", "tierflow", "tierflow move-only"] + others + [
        "plan s (wall / CPU)", "move-only plan s", "lever variant", "recomputes (time)", "host steps", "scored"] + (
        ["levers bound", "bound CPU s"] if args.bound else [])
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    if args.table == "zoo":
        cache = Path(args.cache) if args.cache else None
        wanted = set(args.cases.split(",")) if args.cases else None
        for model, batch, seq, dtype, hw_name, budget in ZOO:
            if wanted and model not in wanted:
                continue
            hw = load_hardware(hw_name)
            trace = _zoo_trace(model, batch, seq, dtype, hw, cache)
            label = f"{model} b{batch}{f' s{seq}' if seq else ''} {dtype}, {hw_name}, {budget or 'device'}"
            _row(label, trace, hw, budget, others, args.bound)
    else:
        hw = load_hardware("g10-a100")
        cases = args.cases.split(",") if args.cases else list(G10_CASES)
        cols: tuple[list[float], list[float]] = ([], [])
        for case in cases:
            trace = load_trace(Path(args.g10) / case)
            ratio, m_ratio, _ = _row(case, trace, hw, None, others, args.bound)
            cols[0].append(ratio)
            cols[1].append(m_ratio)
        print(f"\nGeometric mean: tierflow {_geomean(cols[0]):.4f}, move-only {_geomean(cols[1]):.4f}")


if __name__ == "__main__":
    main()
