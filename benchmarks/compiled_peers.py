"""torch.compile's own memory knobs beside tierflow's compiled plan, and the simulator's
prediction of tierflow's compiled steps against what they measure (issue 30).

For each model (the gated MLP of ``benchmarks/compiled.py`` and Hugging Face GPT-2 from
a config), from one seeded initialisation, one copy per arm, all with inductor:

* ``plain``: ``torch.compile(model)``;
* ``tierflow none`` and ``tierflow S``: ``tierflow.compiled.compile(model, budget=...)``
  (``none`` plans nothing: the same graphs as plain, through tierflow's hook, for the
  prediction's reference);
* ``amb B``: compiled under ``torch._functorch.config.activation_memory_budget = B``
  for each ``B`` of the sweep;
* ``offloading``: compiled under ``enable_activation_offloading = True`` with every
  forward node marked ``should_offload`` by a joint-graph pass (torch offloads only
  marked nodes; "all" is what the ``compile_offloading`` policy marks by default).

Each arm compiles in its warm-up steps, then one step runs under ``torch.profiler`` (the
allocator's peak, bytes above the step's start), then the timed steps of all arms run
interleaved (one step of each in turn). For each tierflow share the ``amb`` arm whose
measured peak is closest to the tierflow arm's is named "at equal peak".

Predictions (:mod:`tierflow.compiled.predict`) use each tierflow arm's partition records
(the graphs' traces and plans) on ``predict.cpu_hardware()`` with graph_trace's roofline
op times: ``predicted / measured`` for step time and peak, and the step-time ratio after
one calibration (all predicted times scaled by ``tierflow none``'s measured / predicted
step, so the planned arms' ratio says whether the *difference* a plan makes is
predicted). The torch knobs are also run as tierflow policies
(``compile_memory_budget``, ``compile_offloading``) on ``tierflow none``'s graph traces:
their simulated peak beside the arm's measured one.

    PYTHONPATH=src python benchmarks/compiled_peers.py --models mlp,gpt2 --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tierflow.compiled as tc  # noqa: E402
from compiled import Arm, Workload, fresh, make_arms, prepare_arm, run_models, timed_round, workload  # noqa: E402
from tierflow.compiled.predict import cpu_hardware, predict_step, step_trace  # noqa: E402

AMBS = "1.0,0.8,0.6,0.4,0.2,0.1"


def mark_all(graph: torch.fx.Graph) -> None:
    """A joint-graph pass: every node ``should_offload`` (torch keeps those it can offload:
    saved activations, not views, contiguous, not the model's outputs)."""
    for node in graph.nodes:
        if node.op == "call_function":
            node.meta["should_offload"] = True


def arm_makers(w: Workload, shares: list[float], ambs: list[float], headroom: float) -> list[Callable[[], Arm]]:
    """``benchmarks/compiled.py``'s arms (with tierflow planning nothing beside its
    shares), then torch's activation offloading with every saved tensor marked."""

    def offloading() -> Arm:
        import contextlib

        import torch._inductor.config as inductor_config

        m, o = fresh(w)
        counter = tc.CallCounter("inductor")
        arm = Arm("offloading (all marked)", m, torch.compile(m, backend=counter, **w.compile_kwargs), o, counter)

        @contextlib.contextmanager
        def patched():
            # the pass is a plain function: the FX graph cache cannot key on it, so it is off
            with torch._functorch.config.patch(enable_activation_offloading=True), \
                    inductor_config.patch(joint_custom_post_pass=mark_all, fx_graph_cache=False):
                yield

        arm.first_call = patched
        return arm

    return make_arms(w, [None, *shares], ambs, headroom) + [offloading]


def graph_pairs(run: Any) -> list[tuple[Any, Any]]:
    """(facts, plan) of each graph a step runs, in order: the graphs called as often as
    the most-called one (a graph Dynamo replaced after the first step is left out).
    Every compile partitions (the caches are off in :func:`main`), so the records and
    the reports pair up in compile order."""
    if len(run.records) != len(run.graphs):
        raise RuntimeError(f"{len(run.records)} partitions for {len(run.graphs)} graphs: a cache hit left a graph unplanned")
    most = max(g.calls for g in run.graphs)
    return [(r.facts, r.plan) for r, g in zip(run.records, run.graphs, strict=True) if g.calls == most]


def policy_rows(pairs: list[tuple[Any, Any]], ambs: list[float], hw: Any) -> list[dict[str, Any]]:
    """The torch knobs as tierflow policies on the unplanned graphs' traces: simulated
    peak above the step's start and step time, graphs in sequence (a later graph runs
    beside what the earlier ones keep saved)."""
    from tierflow.policies import make_plan
    from tierflow.simulate import simulate

    rows = []
    arms = [(f"amb {b}", "compile_memory_budget", {"memory_budget": b}) for b in ambs]
    arms.append(("offloading (all marked)", "compile_offloading", {"always": True}))
    for label, policy, opts in arms:
        step_s = peak = carried = 0.0
        for facts, _ in pairs:
            trace = step_trace(facts.trace)
            held = int(sum(int(trace.sizes[t.id]) for t in trace.tensors if t.persistent))
            plan = make_plan(policy, trace, hw, **opts)
            res = simulate(trace, hw, plan)
            gone = {t for r in plan.recomputes for t in r.tensors} | {m.tensor for m in plan.moves}
            peak = max(peak, carried + res.peak_bytes[hw.device] - held)
            carried += sum(s.bytes for s in facts.saved if s.tensor not in gone)
            step_s += res.time_s
        rows.append({"arm": label, "policy": policy, "sim_peak_bytes": int(peak), "sim_step_s": step_s})
    return rows


def prediction_hardware(name: str) -> Any:
    """``cpu``: :func:`tierflow.compiled.predict.cpu_hardware`; else a preset or TOML file."""
    if name == "cpu":
        return cpu_hardware()
    from tierflow import load_hardware

    return load_hardware(name)


def run_model(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    w = workload(name, device, args.quick)
    shares = [float(s) for s in args.shares.split(",")]
    ambs = [float(b) for b in args.ambs.split(",")]
    torch._dynamo.reset()
    arms = [prepare_arm(make, w, args) for make in arm_makers(w, shares, ambs, args.headroom)]
    for k in range(args.steps):
        timed_round(arms, w, args.warmup + 1 + k)
    plain = arms[0]
    med = {a.name: statistics.median(a.times) for a in arms}
    ref = next(a for a in arms if a.name == "tierflow none")
    hw = prediction_hardware(args.hardware)
    ref_pred = predict_step(graph_pairs(ref.handle), hw)
    calib = med[ref.name] / ref_pred.step_s if ref_pred.step_s > 0 else float("nan")
    rows = []
    for a in arms:
        row: dict[str, Any] = {"arm": a.name, "peak_bytes": a.peak, "peak_over_plain": a.peak / plain.peak,
                               "step_s": med[a.name], "x_plain": med[a.name] / med["plain"],
                               "calls": a.handle.calls, "losses_equal_plain": a.losses == plain.losses}
        if a.name.startswith("tierflow"):
            pred = predict_step(graph_pairs(a.handle), hw)
            row.update({
                "graphs": len(pred.graphs), "pred_step_s": pred.step_s, "pred_peak_bytes": pred.peak_bytes,
                "pred_over_measured_step": pred.step_s / med[a.name],
                "pred_over_measured_peak": pred.peak_bytes / a.peak if a.peak else float("nan"),
                "calibrated_pred_over_measured_step": calib * pred.step_s / med[a.name],
                "bitwise_params": all(torch.equal(p, q) for p, q in zip(a.model.parameters(), plain.model.parameters(),
                                                                        strict=True)),
            })
        rows.append(row)
    # torch's knob at the tierflow arm's peak: the amb arm whose measured peak is closest
    equal = {}
    for s in shares:
        t = next(r for r in rows if r["arm"] == f"tierflow {s:.0%}")
        best = min((r for r in rows if r["arm"].startswith("amb")), key=lambda r: abs(r["peak_bytes"] - t["peak_bytes"]))
        equal[t["arm"]] = {"amb": best["arm"], "amb_peak_bytes": best["peak_bytes"], "amb_step_s": best["step_s"],
                           "tierflow_peak_bytes": t["peak_bytes"], "tierflow_step_s": t["step_s"],
                           "tierflow_over_amb_step": t["step_s"] / best["step_s"]}
    sims = policy_rows(graph_pairs(ref.handle), ambs, hw)
    for s in sims:
        measured = next(r for r in rows if r["arm"] == s["arm"])
        s["measured_peak_bytes"] = measured["peak_bytes"]
        s["sim_over_measured_peak"] = s["sim_peak_bytes"] / measured["peak_bytes"]
    return {"model": w.name, "rows": rows, "equal_peak": equal, "policies": sims, "calibration": calib,
            "prediction_hardware": hw.name}


def print_rows(res: dict[str, Any]) -> None:
    mib = 2**20
    print(f"\n{res['model']}")
    print("| arm | peak MiB | x plain peak | step s | x plain | calls | losses = plain | predicted step s (x measured; calibrated) | predicted peak MiB (x measured) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        pred_t = pred_p = ""
        if "pred_step_s" in r:
            pred_t = (f"{r['pred_step_s']:.4f} ({r['pred_over_measured_step']:.2f}; "
                      f"{r['calibrated_pred_over_measured_step']:.2f})")
            pred_p = f"{r['pred_peak_bytes'] / mib:.1f} ({r['pred_over_measured_peak']:.2f})"
        print(f"| {r['arm']} | {r['peak_bytes'] / mib:.1f} | {r['peak_over_plain']:.2f} | {r['step_s']:.3f} | "
              f"{r['x_plain']:.2f} | {r['calls']} | {'yes' if r['losses_equal_plain'] else 'no'} | {pred_t} | {pred_p} |")
    print("\nAt equal peak (the amb arm whose measured peak is closest):")
    print("| tierflow arm | peak MiB | step s | amb arm | peak MiB | step s | tierflow / amb step |")
    print("|---|---|---|---|---|---|---|")
    for arm, e in res["equal_peak"].items():
        print(f"| {arm} | {e['tierflow_peak_bytes'] / mib:.1f} | {e['tierflow_step_s']:.3f} | {e['amb']} | "
              f"{e['amb_peak_bytes'] / mib:.1f} | {e['amb_step_s']:.3f} | {e['tierflow_over_amb_step']:.2f} |")
    print("\nThe knobs as tierflow policies on the unplanned graphs (simulated, CPU figures):")
    print("| arm | policy | simulated peak MiB | measured peak MiB | simulated / measured |")
    print("|---|---|---|---|---|")
    for s in res["policies"]:
        print(f"| {s['arm']} | {s['policy']} | {s['sim_peak_bytes'] / mib:.1f} | {s['measured_peak_bytes'] / mib:.1f} | "
              f"{s['sim_over_measured_peak']:.2f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp,gpt2")
    ap.add_argument("--shares", default="0.5,0.3")
    ap.add_argument("--ambs", default=AMBS, help="activation_memory_budget sweep")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--headroom", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small models (the dry run)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hardware", default="cpu", help="the predictions' machine: cpu (predict.cpu_hardware) "
                    "or a preset (h100-80g-pcie5-nvme); op times stay graph_trace's roofline estimate")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared CPU)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64
    # a cache hit skips the partitioner: its graph would have no trace to predict from
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    return run_models(args, run_model, print_rows)


if __name__ == "__main__":
    sys.exit(main())
