"""Does a planned iteration do what its plan says? CPU mode, default options.

For the three tiny zoo models and the two of ``benchmarks/outside_models.py``, at each
budget: the plan (policy, planned or reactive, its moves), and per planned step (the
first after each plan left out: it starts from the profile's residency) the on-demand
fetches against the faults the simulator predicts for the plan, the evictions the budget
forced beyond the plan, and the peak against the budget. ``--departures`` also prints
``run.stats.departures`` (each way the runtime departed from the plan, by reason).

    PYTHONPATH=src python benchmarks/follow_plan.py
    PYTHONPATH=src python benchmarks/follow_plan.py --models gpt-tiny --budgets 30% --batches 4 --departures
    PYTHONPATH=src python benchmarks/follow_plan.py --models unet-mini --budgets 30%,40%,50% --batches 8 --steps 12 --made-inside

The loop keeps ``--batches`` batches and cycles through them (as a list of batches
does). Counts, not times: they do not depend on the machine's load, though the plan can
(it is made from measured op times).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

import tierflow

_HERE = Path(__file__).resolve().parent


def _outside():
    spec = importlib.util.spec_from_file_location("outside_models", _HERE / "outside_models.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["outside_models"] = mod
    spec.loader.exec_module(mod)
    return mod


def measure(name: str, budget: str, *, steps: int, batches: int, outside, made_inside: bool = False) -> dict:
    model, make_batch, loss_fn = outside.any_model(name)
    opt = torch.optim.AdamW(model.parameters())
    # made_inside: the loop makes a batch in each of its first steps, inside the block,
    # and keeps it (the budget's); else they are made before the block (not the budget's)
    data = [] if made_inside else [make_batch(i) for i in range(batches)]
    rows, last = [], None
    with tierflow.offload(model, opt, budget=budget) as run:
        for k in range(steps):
            if len(data) < batches:
                data.append(make_batch(k))
            x, y = data[k % batches]
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            s = run.stats
            now = (s.planned_steps, s.stalls, s.unplanned_evictions, s.replans)
            if last is not None and now[0] > last[0] and now[3] == last[3]:
                rows.append((now[1] - last[1], now[2] - last[2]))
            last = now
    s, plan = run.stats, run.plan
    rows = rows[1:]  # (the first planned step after a plan starts from the profile's residency)
    return {
        "model": name, "budget": budget, "policy": s.policy, "reactive": bool(plan.reactive) if plan else None,
        "moves": len(plan.moves) if plan else 0,
        "predicted_faults": run.prediction.faults if run.prediction is not None else None,
        "planned_steps_measured": len(rows),
        "fetches": [r[0] for r in rows],
        "stalls": s.stalls,
        "fetches_per_step": statistics.median(r[0] for r in rows) if rows else None,
        "fetches_max": max((r[0] for r in rows), default=None),
        "unplanned_evictions_per_step": statistics.median(r[1] for r in rows) if rows else None,
        "peak_over_budget": s.peak_device_bytes_planned / s.budget_bytes if s.budget_bytes else None,
        "held_bytes": getattr(s, "held_device_bytes", 0),
        "held_replans": getattr(s, "held_replans", 0),
        "departures": dict(getattr(s, "departures", {})),
        "plan_error": s.plan_error,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    outside = _outside()
    ap.add_argument("--models", default=",".join(("gpt-tiny", "bert-tiny", "vit-tiny", *outside.NAMES)))
    ap.add_argument("--budgets", default="50%,30%")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--made-inside", action="store_true",
                    help="the loop makes its batches inside the block and keeps them")
    ap.add_argument("--departures", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = []
    print(f"{'model':<11} {'budget':>6} {'plan':<34} {'moves':>5} {'faults':>6} {'fetches/step':>12} "
          f"{'max':>4} {'unplanned ev/step':>17} {'peak/budget':>11}")
    for name in args.models.split(","):
        for budget in args.budgets.split(","):
            try:
                r = measure(name, budget, steps=args.steps, batches=args.batches, outside=outside,
                            made_inside=args.made_inside)
            except tierflow.errors.TierflowError as e:
                print(f"{name:<11} {budget:>6} {type(e).__name__}: {str(e)[:100]}")
                out.append({"model": name, "budget": budget, "error": str(e)})
                continue
            out.append(r)
            plan = f"{r['policy'][:24]} ({'reactive' if r['reactive'] else 'planned'})"
            print(f"{name:<11} {budget:>6} {plan:<34} {r['moves']:>5} {r['predicted_faults']!s:>6} "
                  f"{r['fetches_per_step']!s:>12} {r['fetches_max']!s:>4} {r['unplanned_evictions_per_step']!s:>17} "
                  f"{r['peak_over_budget']:>11.3f}"
                  + (f"  held {r['held_bytes']} B, {r['held_replans']} re-plans" if args.made_inside else ""))
            if args.departures:
                for k, v in sorted(r["departures"].items()):
                    print(f"{'':>19}{v:>6}  {k}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
