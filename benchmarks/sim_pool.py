"""Device memory through a planned pool: arena vs live peak, and what it does to the step.

    python benchmarks/sim_pool.py [--g10 ../shared/benchmarks/g10] [--cases bert-256,...]
        [--policies g10,tierflow] [--pool-time 2] [--zoo gpt2-large:8:rtx4090-24g]

For each case and policy (planned at the device's capacity): the plain simulation
(byte counting), then ``simulate_pooled`` with ``greedy`` and ``best``, re-planning the
policy at each lowered budget as ``tierflow simulate --pool`` does. Prints markdown:
the live peak, greedy's arena for the iteration laid out alone (no layout kept across
the boundary), the pool problem's lower bound and each solver's arena for the plan as
planned (first round), then the budget each solver had to lower to, the rounds and the
ratio of ideal with and without the pool. "bound" is the pool problem's lower bound for
the plan as planned: the live peak plus what the periodic layout's cut costs. CPU
seconds are the process's, per row.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from tierflow import load_hardware, load_trace
from tierflow.policies import make_plan
from tierflow.simulate import simulate, simulate_pooled

CASES = ("bert-256", "vit-1280", "inceptionv3-1536", "resnet152-1280", "senet154-1024")
GIB = 2**30


def gib(v: float) -> str:
    return f"{v / GIB:.2f}"


def one_iteration_arena(trace, hw, plan) -> int:
    """Greedy's arena for the plan's recorded device blocks laid out as one iteration
    alone, with no layout shared across the boundary: what the cut of the periodic
    layout adds is the difference from the "bound" column."""
    from tierflow import pool
    from tierflow.plan import validate
    from tierflow.simulate.pooled import _Recorder  # the recorder simulate_pooled uses

    sim = _Recorder(trace, hw, plan, validate(plan, trace, hw).start_tier)
    sim.run(2, None)
    blocks, _ = sim.blocks()
    problem = pool.Problem(tuple(pool.Buffer(str(k), lo, hi, int(trace.sizes[t]))
                                 for k, (t, lo, hi) in enumerate(blocks)))
    return pool.solve(problem, "greedy").peak


def rows_for(label: str, trace, hw, policies: list[str], pool_time: float, rounds: int) -> list[str]:
    """Markdown rows of one trace: one per policy."""
    out = []
    for name in policies:
        t0 = time.process_time()
        plan = make_plan(name, trace, hw)
        plain = simulate(trace, hw, plan)
        res = {}
        for solver in ("greedy", "best"):
            res[solver] = simulate_pooled(
                trace, hw, plan, solver, time_limit=pool_time, max_rounds=rounds,
                replan=lambda b, n=name: make_plan(n, trace, hw, budget=b),
            )
        cpu = time.process_time() - t0
        alone = one_iteration_arena(trace, hw, plan)
        g, b = res["greedy"].pool, res["best"].pool
        first = f"{gib(g.history[0]['arena_peak_bytes'])} / {gib(b.history[0]['arena_peak_bytes'])}"
        cells = [label, name, f"{plain.ratio:.3f}", gib(plain.peak_bytes[hw.device]), gib(alone),
                 gib(b.history[0]["lower_bound_bytes"]), first]
        for solver in ("greedy", "best"):
            r, p = res[solver], res[solver].pool
            budget = gib(p.effective_budget_bytes) if p.fits else "does not fit"
            cells += [budget, str(p.rounds), f"{r.ratio:.3f}" if r.error is None else "-"]
        cells.append(f"{cpu:.0f}")
        out.append("| " + " | ".join(cells) + " |")
        print(out[-1], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--g10", default=str(Path(__file__).resolve().parents[2] / "shared" / "benchmarks" / "g10"))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--policies", default="g10,tierflow")
    ap.add_argument("--hardware", default="g10-a100")
    ap.add_argument("--pool-time", type=float, default=2.0, help="seconds best may spend per layout")
    ap.add_argument("--rounds", type=int, default=8, help="simulations at most per solver")
    ap.add_argument("--zoo", default=None, help="also a zoo trace: MODEL:BATCH:HARDWARE")
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    print(f"machine: {platform.machine()}, Python {platform.python_version()}; best {args.pool_time} s a layout, "
          f"at most {args.rounds} rounds\n")
    print("| case | policy | ratio, byte counting | live GiB | one iteration alone GiB | bound GiB "
          "| arena GiB (greedy / best) | greedy: budget GiB | rounds | ratio | best: budget GiB | rounds "
          "| ratio | CPU s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    hw = load_hardware(args.hardware)
    for case in [c for c in args.cases.split(",") if c]:
        rows_for(case, load_trace(Path(args.g10) / case), hw, policies, args.pool_time, args.rounds)
    if args.zoo:
        from tierflow.capture import zoo_trace

        model, batch, hw_name = args.zoo.split(":")
        zhw = load_hardware(hw_name)
        trace = zoo_trace(model, batch=int(batch), hardware=zhw)
        rows_for(f"{model} b{batch} ({hw_name})", trace, zhw, policies, args.pool_time, args.rounds)


if __name__ == "__main__":
    main()
