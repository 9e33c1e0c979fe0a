"""How well the simulator predicts the runtime's step time in CPU mode.

For three zoo models at toy size and the two models outside the zoo
(``benchmarks/outside_models.py``), at two budgets, train a few steps under
``tierflow.offload`` with its default options and compare the simulator's step time for
the plan it follows (``run.stats.predicted_step_time_s``) with the wall time the planned
steps took (the median of them, leaving out the first three: in CPU mode the prediction
is re-made from those iterations' op times and the model's cost outside the runtime,
``tierflow/runtime/retime.py``; the column "at plan" is the prediction made at the plan,
``predicted_step_time_s_at_plan``, before any step followed it), and with their CPU time (the process's, one thread:
what a loaded, shared machine's other work leaves out of the wall time). Each row is the median of ``--runs`` runs, interleaved
round by round with the other rows, so that the shared machine's slow spells fall on
every row alike. The stall columns say how much of a miss is on-demand fetching that the
plan did not foresee (fetches the simulator, following the plan, never sees).

    PYTHONPATH=src python benchmarks/predict_cpu.py --runs 3 --json /tmp/predict.json

To compare two source trees on a shared machine, interleave them by process: run each
tree with ``--runs 1 --json`` in turn, a few times, then
``predict_cpu.py --combine A1.json A2.json A3.json`` prints the median of each row.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import tierflow
from tierflow.capture import zoo
from tierflow.runtime.retime import RETIMED

ZOO = ("gpt-tiny", "bert-tiny", "vit-tiny")
OUTSIDE = ("unet-mini", "mixer-mini")


def _outside_models():
    path = Path(__file__).with_name("outside_models.py")
    spec = importlib.util.spec_from_file_location("outside_models", path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def _workload(name: str):
    """``(model, batches, loss_fn)``: the model and the batches ``i -> (x, y)``."""
    if name in OUTSIDE:
        model, make_batch, loss_fn = _outside_models().build(name)
        return model, make_batch, loss_fn
    built = zoo.build(name)
    s = zoo.spec(name)
    return built.model, lambda i: built.make_batch(s.batch), built.loss_fn


def run_once(name: str, budget: str, steps: int) -> dict:
    """One run: ``steps`` optimizer steps under ``offload`` at ``budget``."""
    model, batch, loss_fn = _workload(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cpu_s = []  # each step's CPU time (one thread: the wall time the machine's other load leaves out)
    with tierflow.offload(model, opt, budget=budget) as run:
        for i in range(steps):
            x, y = batch(i)  # (outside the time: the runtime's iteration starts at the forward)
            c0 = time.process_time()
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            cpu_s.append(time.process_time() - c0)
    st = run.stats
    # the planned steps are the last ``planned_steps`` iterations when the plan held; the
    # first RETIMED of them are left out: the prediction is re-made from their times
    k = len(st.step_times_s) - st.planned_steps + RETIMED
    planned = st.step_times_s[k:] if st.planned_steps > RETIMED else []
    measured = statistics.median(planned) if planned else st.step_time_s
    cpu = statistics.median(cpu_s[k:] if st.planned_steps > RETIMED else cpu_s[1:])
    pred = st.predicted_step_time_s
    at_plan = st.predicted_step_time_s_at_plan
    hw = run.hardware
    return {
        "model": name, "budget": budget, "predicted_s": pred, "measured_s": measured, "cpu_s": cpu,
        "ratio": (pred / measured) if pred and measured else None,
        "predicted_at_plan_s": at_plan, "at_plan_ratio": (at_plan / measured) if at_plan and measured else None,
        "cpu_ratio": (pred / cpu) if pred and cpu else None,
        "planned_steps": st.planned_steps, "steps": st.steps, "policy": st.policy,
        "stalls_per_step": st.stalls / max(1, st.steps), "stall_s_per_step": st.stall_s / max(1, st.steps),
        "ideal_s": st.ideal_step_time_s, "n_ops": run.trace.n_ops if run.trace is not None else None,
        "op_issue_us": getattr(hw, "op_issue_s", 0.0) * 1e6 if hw is not None else None,
        "move_issue_us": hw.move_issue_s * 1e6 if hw is not None else None,
        "planned_moves_per_step": st.planned_moves / max(1, st.steps),
        "recomputed_ops": st.recomputed_ops, "host_steps": st.host_steps,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(ZOO + OUTSIDE))
    ap.add_argument("--budgets", default="50%,30%")
    ap.add_argument("--runs", type=int, default=3, help="runs per row, interleaved (median reported)")
    ap.add_argument("--steps", type=int, default=14, help="optimizer steps per run")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--combine", nargs="+", metavar="JSON",
                    help="run nothing: the median of each row over these files (each one run of --json)")
    args = ap.parse_args(argv)
    runs: dict[tuple[str, str], list[dict]] = {}
    if args.combine:
        for path in args.combine:
            for r in json.loads(Path(path).read_text())["rows"]:  # (a row: one run, or a file's median)
                runs.setdefault((r["model"], r["budget"]), []).append(r)
        rows = list(runs)
    else:
        torch.set_num_threads(args.threads)
        rows = [(m, b) for m in args.models.split(",") for b in args.budgets.split(",")]
        print(f"load before: {os.getloadavg()}  torch {torch.__version__}  threads {torch.get_num_threads()}",
              flush=True)
        runs = {r: [] for r in rows}
        for k in range(args.runs):
            for m, b in rows:
                runs[(m, b)].append(run_once(m, b, args.steps))
            print(f"  round {k + 1}/{args.runs} done, load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    out = []
    print(f"{'model':<11} {'budget':>6} {'ops':>5} {'op_us':>6} {'predicted':>10} {'measured':>10} {'ratio':>6} "
          f"{'(min-max)':>11} {'at plan':>7} {'cpu':>9} {'cpu ratio':>9} {'stalls':>7} {'stall_ms':>8} {'moves':>6}")
    for m, b in rows:
        rs = runs[(m, b)]
        ratios = [r["ratio"] for r in rs if r["ratio"] is not None]
        med = statistics.median(ratios) if ratios else None
        cpu_ratios = [r["cpu_ratio"] for r in rs if r.get("cpu_ratio") is not None]
        plan_ratios = [r["at_plan_ratio"] for r in rs if r.get("at_plan_ratio") is not None]
        pick = min(rs, key=lambda r: abs((r["ratio"] or 0) - (med or 0)))
        row = dict(pick, ratio=med, ratios=ratios, cpu_ratios=cpu_ratios,
                   cpu_ratio=statistics.median(cpu_ratios) if cpu_ratios else None,
                   at_plan_ratios=plan_ratios,
                   at_plan_ratio=statistics.median(plan_ratios) if plan_ratios else None,
                   predicted_s=statistics.median([r["predicted_s"] or 0 for r in rs]),
                   measured_s=statistics.median([r["measured_s"] for r in rs]),
                   cpu_s=statistics.median([r.get("cpu_s") or 0 for r in rs]))
        out.append(row)
        span = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
        nan = float("nan")
        print(f"{m:<11} {b:>6} {row['n_ops'] or 0:>5} {row['op_issue_us'] or 0:>6.1f} "
              f"{row['predicted_s'] * 1e3:>8.2f}ms {row['measured_s'] * 1e3:>8.2f}ms "
              f"{med if med is not None else nan:>6.2f} {span:>11} "
              f"{row['at_plan_ratio'] if row['at_plan_ratio'] is not None else nan:>7.2f} {row['cpu_s'] * 1e3:>7.2f}ms "
              f"{row['cpu_ratio'] if row['cpu_ratio'] is not None else nan:>9.2f} {row['stalls_per_step']:>7.1f} "
              f"{row['stall_s_per_step'] * 1e3:>8.2f} {row['planned_moves_per_step']:>6.1f}")
    for key, what in (("ratio", "wall"), ("cpu_ratio", "CPU"), ("at_plan_ratio", "wall, prediction at the plan")):
        inside = sum(1 for r in out if r[key] is not None and 0.75 <= r[key] <= 1.33)
        print(f"rows within [0.75, 1.33] ({what} time): {inside} of {len(out)}")
    print(f"load after: {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"load_after": os.getloadavg(), "rows": out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
