"""How fast the simulator runs, and a check that a faster one gives the same results.

    python benchmarks/sim_speed.py make  --dir /tmp/simspeed   # plan every case, keep plans + results
    python benchmarks/sim_speed.py check --dir /tmp/simspeed   # replay the kept plans, compare, time

``make`` plans every case with today's policies, pickles each plan with a digest of its
simulated result (every headline number, the per-op start/end/stall arrays, every
transfer record and the memory curves, as exact bytes or ``repr``) and the CPU seconds
the simulation took. ``check`` replays the *same* plans (so policy changes made since do
not matter), asserts that every digest is equal (``==``, not approximately) and prints
the CPU seconds (``time.process_time``) per case beside the ones ``make`` measured.
Running ``check`` with ``PYTHONPATH`` pointing at an older source tree times that tree
on the same plans.

Cases (``--set main``, the default): G10's five workloads (``--g10``) on ``g10-a100``
with lru, deepum, g10, tierflow and deeptm, and two captured zoo traces (issue 5:
GPT-2-xl batch 16 on ``rtx4090-24g``, Llama-7B batch 4 x 2048 on ``h100-80g-pcie5-nvme``
with a 60 GiB budget) with lru, deepum, g10, singa and tierflow. The zoo traces are
captured on meta once and kept in ``--dir``. ``--set extra`` adds cases kept for the
equality check rather than for timing: more plan shapes on two G10 workloads (pager
options, the seed-system policies, the unlimited reference) and one rank of GPT-2-xl
on 4 GPUs (ddp and fsdp) through ``simulate_parallel``; ``--set all`` is both.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from pathlib import Path

from tierflow import load_hardware, load_trace
from tierflow.errors import PlanError
from tierflow.simulate import simulate
from tierflow.trace import Trace

G10_CASES = ["bert-256", "vit-1280", "inceptionv3-1536", "resnet152-1280", "senet154-1024"]
G10_POLICIES = ["lru", "deepum", "g10", "tierflow", "deeptm"]
ZOO_CASES = [
    # (label, model, batch, seq, dtype, hardware, budget)
    ("gpt2-xl-b16", "gpt2-xl", 16, 1024, "fp32", "rtx4090-24g", None),
    ("llama-7b-b4", "llama-7b", 4, 2048, "bf16", "h100-80g-pcie5-nvme", "60GiB"),
]
ZOO_POLICIES = ["lru", "deepum", "g10", "singa", "tierflow"]
# --set extra: (G10 case, policies as "name:option=value,...")
EXTRA_G10 = [
    (case, ["lru:refetch_dead=1", "lru:headroom=0", "ideal", "flashneuron", "vdnn", "myelin", "singa"])
    for case in ("bert-256", "senet154-1024")
]
# --set extra: one rank of a data-parallel run (zoo case, GPUs, strategy, policies)
EXTRA_PARALLEL = [("gpt2-xl-b16", 4, "ddp", ["lru", "g10"]), ("gpt2-xl-b16", 4, "fsdp", ["lru", "g10"])]


def digest(r) -> dict:  # noqa: ANN001 (a SimResult)
    """Everything a simulation reports, in a form compared exactly with ``==``."""
    return {
        "summary": json.dumps(r.to_dict(), sort_keys=True),  # floats as repr: exact
        "fields": repr((r.traffic_bytes, r.peak_bytes, r.fault_bytes, r.skipped_moves, r.meta)),
        "ops": [a.tobytes() for a in (r.op_start_s, r.op_end_s, r.op_stall_s)],
        "transfers": repr(r.transfers),
        "memory": {k: (t.tobytes(), b.tobytes()) for k, (t, b) in sorted(r.memory.items())},
    }


def _traces(args) -> list[tuple[str, Trace, str, list[str], str | None, tuple | None]]:  # noqa: ANN001
    """(label, trace, hardware name, policies, budget, data-parallel (GPUs, strategy) or
    None) for every case of ``args.set``."""
    main, extra = args.set in ("main", "all"), args.set in ("extra", "all")
    zoo = {}
    for label, model, batch, seq, dtype, hw_name, budget in ZOO_CASES:
        path = Path(args.dir) / "traces" / f"{label}.json"
        if not path.exists():
            from tierflow.capture import zoo_trace

            path.parent.mkdir(parents=True, exist_ok=True)
            zoo_trace(model, batch=batch, seq=seq, dtype=dtype, hardware=load_hardware(hw_name)).save(path)
        # always simulate the trace as read back, so make and check see the same floats
        zoo[label] = (load_trace(path), hw_name, budget)
    out = []
    for case in G10_CASES:
        pols = (G10_POLICIES if main else []) + [p for c, ps in EXTRA_G10 if extra and c == case for p in ps]
        if pols:
            out.append((case, load_trace(Path(args.g10) / case), "g10-a100", pols, None, None))
    for label, (trace, hw_name, budget) in zoo.items():
        if main:
            out.append((label, trace, hw_name, ZOO_POLICIES, budget, None))
    for label, gpus, strategy, pols in EXTRA_PARALLEL if extra else []:
        from tierflow.simulate.parallel import DataParallel, rank_trace

        trace, hw_name, budget = zoo[label]
        dp = DataParallel.on(load_hardware(hw_name), gpus, strategy)
        out.append((f"{label}-dp{gpus}{strategy}", rank_trace(trace, dp), hw_name, pols, budget, (gpus, strategy)))
    return out


def _plan(name: str, trace: Trace, hw, budget):  # noqa: ANN001
    """Plan with ``name`` given as ``policy`` or ``policy:option=value,...``."""
    from tierflow.policies import make_plan

    policy, _, opts = name.partition(":")
    # text: make_plan coerces each value to the type the policy declares
    extra = dict(o.split("=", 1) for o in opts.split(",") if o)
    return make_plan(policy, trace, hw, budget=budget if policy != "ideal" else None, **extra)


def _timed(trace, hw, plan, dp=None):  # noqa: ANN001
    """(digest of the result, CPU seconds of the simulation)."""
    t0 = time.process_time()
    if dp is None:
        r = simulate(trace, hw, plan)
        return digest(r), time.process_time() - t0
    from tierflow.simulate.parallel import DataParallel, simulate_parallel

    par = simulate_parallel(trace, hw, plan, DataParallel.on(hw, *dp))
    cpu = time.process_time() - t0
    return dict(digest(par.sim), parallel=repr((par.comm_wait_s, par.interconnect_bytes, par.collectives))), cpu


def make(args) -> None:  # noqa: ANN001
    store = Path(args.dir)
    store.mkdir(parents=True, exist_ok=True)
    for label, trace, hw_name, policies, budget, dp in _traces(args):
        hw = load_hardware(hw_name)
        for name in policies:
            if args.only and f"{label}/{name}" not in args.only.split(","):
                continue
            try:
                plan = _plan(name, trace, hw, budget)
            except PlanError as e:
                print(f"{label} {name}: no plan ({e})", file=sys.stderr)
                continue
            d, cpu = _timed(trace, hw, plan, dp)
            kept = {"plan": plan, "digest": d, "cpu_s": cpu, "hardware": hw_name, "dp": dp, "set": args.set}
            with open(store / f"{label}__{name}.pkl", "wb") as fh:
                pickle.dump(kept, fh)
            print(f"{label} {name}: simulate {cpu:.2f} s CPU", flush=True)


def check(args) -> None:  # noqa: ANN001
    store = Path(args.dir)
    cases = {(label, name): trace for label, trace, _, names, *_ in _traces(args) for name in names}
    rows, bad = [], 0
    tot_before = tot_now = 0.0
    for path in sorted(store.glob("*.pkl")):
        label, name = path.stem.split("__")
        if (label, name) not in cases or (args.only and f"{label}/{name}" not in args.only.split(",")):
            continue
        with open(path, "rb") as fh:
            kept = pickle.load(fh)
        hw = load_hardware(kept["hardware"])
        best = None
        for _ in range(args.repeat):
            d, cpu = _timed(cases[(label, name)], hw, kept["plan"], kept.get("dp"))
            best = cpu if best is None else min(best, cpu)
        same = d == kept["digest"]
        bad += not same
        tot_before += kept["cpu_s"]
        tot_now += best
        rows.append(f"| {label} | {name} | {kept['cpu_s']:.2f} | {best:.2f} | {kept['cpu_s'] / best:.1f}x | {'yes' if same else 'NO'} |")
        print(rows[-1], flush=True)
    print("\n| case | policy | CPU s at make | CPU s now | speed-up | identical |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"| all | | {tot_before:.2f} | {tot_now:.2f} | {tot_before / max(tot_now, 1e-9):.1f}x | {'yes' if not bad else f'{bad} differ'} |")
    if bad:
        sys.exit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["make", "check"])
    ap.add_argument("--dir", default="/tmp/simspeed", help="where plans, results and zoo traces are kept")
    ap.add_argument("--g10", default=str(Path(__file__).resolve().parents[2] / "shared" / "benchmarks" / "g10"))
    ap.add_argument("--set", choices=["main", "extra", "all"], default="main", help="which cases (see above)")
    ap.add_argument("--only", default=None, help="comma-separated case/policy pairs, e.g. senet154-1024/lru")
    ap.add_argument("--repeat", type=int, default=1, help="check: simulations per case; the least CPU time is shown")
    args = ap.parse_args()
    (make if args.mode == "make" else check)(args)


if __name__ == "__main__":
    main()
