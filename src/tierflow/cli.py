"""The ``tierflow`` command: thin — it parses, calls the library, prints.

Bad input never shows a traceback: every :class:`TierflowError` becomes one line on
stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import math
import sys
from typing import Any

from . import _cli_util as u
from .errors import TierflowError
from .units import fmt_bytes, fmt_seconds

# Command groups that live beside their layer; each module has register(subparsers).
_EXTENSIONS = (
    "tierflow.capture.cli",
    "tierflow.pool.cli",
    "tierflow.bound",
    "tierflow.report.cli",
    "tierflow.runtime.cli",
)

DEFAULT_POLICIES = ("ideal", "lru", "deepum")
# tierflow.simulate.POOL_CHOICES, spelled out so that parsing imports no simulator
POOL_CHOICES = ("none", "greedy", "best")


def _add_policy_args(p: argparse.ArgumentParser, json_help: str = "print JSON instead of tables") -> None:
    """What planning with a policy takes: the machine, the budget, policy options, --json."""
    p.add_argument("--hardware", default="g10-a100", help="preset name or TOML file (default: g10-a100)")
    p.add_argument("--budget", default=None, help="device budget: bytes (20GiB) or share of the peak (30%%)")
    p.add_argument("--json", action="store_true", help=json_help)
    p.add_argument(
        "--set", dest="options", action="append", default=[], metavar="KEY=VALUE",
        help="a policy option, e.g. --set lookahead=4 (repeatable; see each policy's docs)",
    )


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    _add_policy_args(p)
    p.add_argument(
        "--gpus", type=int, default=1,
        help="data-parallel ranks: simulate one rank of N over the hardware's [interconnect] (default: 1)",
    )
    p.add_argument(
        "--strategy", choices=("ddp", "fsdp"), default="ddp",
        help="with --gpus N: ddp (replicated, all-reduce) or fsdp (sharded, all-gather/reduce-scatter)",
    )
    p.add_argument(
        "--pool", choices=POOL_CHOICES, default="none",
        help="device memory as one arena laid out by the pool planner (greedy or best), fragmentation "
        "included: the budget is lowered until the arena fits; none = byte counting (default)",
    )
    p.add_argument(
        "--pool-time", type=_positive_seconds, default=2.0, metavar="SECONDS",
        help="with --pool best: seconds the solver may spend on each layout (default: 2)",
    )


def _positive_seconds(text: str) -> float:
    """argparse type of ``--pool-time``: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def parse_options(items: list[str]) -> dict[str, Any]:
    """``["lookahead=4", "liveness=false"]`` -> ``{"lookahead": 4, "liveness": False}``."""
    from .errors import PolicyError

    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise PolicyError(f"--set {item!r}: expected KEY=VALUE")
        low = text.strip().lower()
        value: Any
        if low in ("true", "yes", "on"):
            value = True
        elif low in ("false", "no", "off"):
            value = False
        else:
            try:
                value = int(text)
            except ValueError:
                try:
                    value = float(text)
                except ValueError:
                    value = text
        out[key.strip()] = value
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierflow",
        description="Plan, simulate and run tensor placement across GPU, host, persistent memory and SSD.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("simulate", help="simulate one policy's plan for a trace")
    u.add_trace_args(p)
    _add_plan_args(p)
    p.add_argument("--policy", default="deepum", help="policy name (see 'tierflow policies')")
    p.add_argument(
        "--plan-file", default=None,
        help="replay an external plan instead: a tierflow plan JSON or G10's prefetch_guide.config",
    )
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser(
        "plan", help="plan one policy for a trace and write the plan (JSON)",
        description="Plan with one policy and write the plan, which 'tierflow simulate --plan-file' "
        "replays. With --incumbent, the plan in use is kept if it is at least as fast on this "
        "hardware (a planner's new plan for a better machine can be slower than the old one).",
    )
    u.add_trace_args(p)
    _add_policy_args(p, json_help="print JSON instead of text")
    p.add_argument("--policy", default="tierflow", help="policy name (default: tierflow; see 'tierflow policies')")
    p.add_argument("-o", "--out", required=True, metavar="PLAN.json", help="where to write the plan")
    p.add_argument(
        "--incumbent", default=None, metavar="PLAN.json",
        help="the plan in use for this trace: written instead if it is at least as fast here",
    )
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("compare", help="simulate several policies side by side")
    u.add_trace_args(p)
    _add_plan_args(p)
    p.add_argument("--policies", default=None, help="comma-separated policy names (default: all)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("policies", help="list the planning policies")
    p.set_defaults(func=cmd_policies)

    p = sub.add_parser("hardware", help="list or show hardware presets")
    hsub = p.add_subparsers(dest="hw_command", metavar="ACTION")
    hsub.required = True
    hl = hsub.add_parser("list", help="list presets")
    hl.add_argument("--json", action="store_true", help="print JSON instead of a table")
    hl.set_defaults(func=cmd_hardware_list)
    hs = hsub.add_parser("show", help="show a preset or TOML file (printed as TOML)")
    hs.add_argument("name")
    hs.set_defaults(func=cmd_hardware_show)

    p = sub.add_parser(
        "demo", help="the whole pipeline on a built-in model: capture, plan, simulate, train",
        description="Capture a zoo model on the meta device, plan every policy for a GPU it does not "
        "fit on, simulate and compare them; then train a tiny model a few steps on the CPU with "
        "moves to host and SSD, and check it against plain PyTorch.",
    )
    p.add_argument("--model", default="gpt2-large", help="zoo model to plan for (default: gpt2-large)")
    p.add_argument("--batch", type=int, default=8, help="its batch size (default: 8)")
    p.add_argument("--hardware", default="rtx4090-24g", help="hardware preset (default: rtx4090-24g)")
    p.add_argument("--policies", default=None, help="comma-separated policies (default: all)")
    p.add_argument("--train-model", default="gpt-tiny", help="zoo model the CPU training part runs (default: gpt-tiny)")
    p.add_argument("--steps", type=int, default=6, help="training steps on the CPU (default: 6)")
    p.add_argument("--no-train", action="store_true", help="stop after the simulation")
    p.add_argument("--synthetic", action="store_true", help="plan for the built-in synthetic GPT trace instead of capturing")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_demo)

    for name in _EXTENSIONS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and name.startswith(e.name):
                continue  # that layer is not part of this build
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except TierflowError as e:
        print(f"tierflow: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tierflow: interrupted", file=sys.stderr)
        return 130


# -- commands ------------------------------------------------------------------------------


def _run_policies(
    trace: Any, hw: Any, names: list[str], budget: Any, show_progress: bool, options: dict | None = None,
    gpus: int = 1, strategy: str = "ddp", pool: str = "none", pool_time: float = 2.0,
) -> list[Any]:
    from .errors import PlanError
    from .policies import make_plan, resolve_budget
    from .simulate import SimResult, simulate

    if gpus < 1:
        raise SystemExit("tierflow: --gpus must be >= 1")
    if pool != "none" and gpus > 1:
        raise SystemExit("tierflow: --pool lays out one device's memory; it cannot be combined with --gpus")
    if gpus > 1:
        from .simulate.parallel import DataParallel, rank_trace, simulate_parallel

        dp = DataParallel.on(hw, gpus, strategy)
        trace = rank_trace(trace, dp)  # plans and simulations are of one rank

        def simulate(tr: Any, h: Any, plan: Any, progress: Any = None) -> Any:
            return simulate_parallel(tr, h, plan, dp, progress=progress).sim

    resolve_budget(trace, hw, budget)  # a budget nothing can meet stops here, once
    results = []
    total = len(names) * 2 * trace.n_ops
    with u.progress(f"simulating {trace.name}", total, enabled=show_progress) as update:
        for k, name in enumerate(names):
            try:
                plan = make_plan(name, trace, hw, budget=budget, **(options or {}))
            except PlanError as e:
                if len(names) == 1:
                    raise
                # one policy that cannot fit is a row of the comparison, not its end
                results.append(SimResult.unplanned(name, trace, hw, str(e)))
                continue
            base = k * 2 * trace.n_ops
            tick = lambda d, _t, b=base: update(b + d)  # noqa: E731
            if pool == "none":
                results.append(simulate(trace, hw, plan, progress=tick))
                continue
            from .simulate import simulate_pooled

            # a fragmented arena leaves the plan less room: the policy plans for the lower
            # budget, as it would if it knew the allocator (ideal ignores budgets)
            replan = None if name == "ideal" else (
                lambda b, n=name: make_plan(n, trace, hw, budget=b, **(options or {}))
            )
            results.append(simulate_pooled(trace, hw, plan, pool, time_limit=pool_time, replan=replan, progress=tick))
    return results


def _policy_list(text: str | None) -> list[str]:
    from .policies import get_policy, policy_names

    names = [n.strip() for n in text.split(",") if n.strip()] if text else policy_names()
    for n in names:
        get_policy(n)  # raises PolicyError naming the unknown one
    return names


def cmd_simulate(args: argparse.Namespace) -> int:
    from .hardware import load_hardware

    hw = load_hardware(args.hardware)
    trace = u.resolve_trace(args, hardware=hw)
    if args.plan_file and args.gpus > 1:
        raise SystemExit("tierflow: --plan-file replays a one-GPU plan; it cannot be combined with --gpus")
    if args.plan_file:
        res = _replay(trace, hw, args)
    else:
        _policy_list(args.policy)
        (res,) = _run_policies(
            trace, hw, [args.policy], args.budget, not args.json, parse_options(args.options), args.gpus, args.strategy,
            args.pool, args.pool_time,
        )
    if args.json:
        u.print_json(res.to_dict())
    else:
        _print_results(trace, hw, [res])
    return 0


def _replay(trace: Any, hw: Any, args: argparse.Namespace) -> Any:
    """Simulate a plan from a file: tierflow's JSON, or G10's prefetch_guide.config."""
    from pathlib import Path

    from .plan import Plan
    from .policies import resolve_budget
    from .simulate import simulate, simulate_pooled

    path = Path(args.plan_file)
    if path.name.endswith(".config"):
        from .formats.g10_plan import load_g10_plan

        plan = load_g10_plan(path, trace, hw, budget=resolve_budget(trace, hw, args.budget))
    else:
        plan = Plan.load(path)
    with u.progress(f"simulating {path.name}", 2 * trace.n_ops, enabled=not args.json) as update:
        if args.pool != "none":  # no policy to plan again: the same plan at lower budgets
            return simulate_pooled(trace, hw, plan, args.pool, time_limit=args.pool_time, progress=update)
        return simulate(trace, hw, plan, progress=update)


def cmd_plan(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .hardware import load_hardware
    from .plan import Plan
    from .policies import make_plan, replan, trace_identity
    from .simulate import simulate

    hw = load_hardware(args.hardware)
    trace = u.resolve_trace(args, hardware=hw)
    _policy_list(args.policy)
    options = parse_options(args.options)
    out = Path(args.out)
    if not out.parent.is_dir():  # fail before planning, not after
        raise TierflowError(f"--out {out}: no such directory {out.parent}")
    busy = contextlib.nullcontext() if args.json else u.console(stderr=True).status(f"planning {args.policy}")
    with busy:
        if args.incumbent:
            plan = replan(args.policy, trace, hw, Plan.load(args.incumbent), args.budget, **options)
            info = plan.meta["incumbent"]
            step = info["incumbent_step_s"] if info["kept"] else info["new_step_s"]
        else:
            plan = make_plan(args.policy, trace, hw, args.budget, **options)
            info = None
            step = simulate(trace, hw, plan).time_s  # inf where the plan cannot run
    dataclasses.replace(plan, meta={**plan.meta, "trace": trace_identity(trace)}).save(out)
    ratio = trace.ideal_s / step if step > 0 and math.isfinite(step) else 0.0
    if args.json:
        u.print_json({"plan_file": str(out), "policy": plan.policy, "moves": len(plan.moves),
                      "recomputed": plan.count("recomputed"), "host_steps": plan.count("host_step"),
                      "budget_bytes": plan.budget_bytes, "predicted_step_s": step, "ratio": ratio,
                      "incumbent": info})
        return 0
    levers = "".join(
        f", {n} {what}" for n, what in ((plan.count("recomputed"), "recomputed"), (plan.count("host_step"), "host steps")) if n
    )
    print(f"{plan.policy} plan on {hw.name}: {len(plan.moves)} moves{levers}, predicted step {fmt_seconds(step)} "
          f"({ratio:.3f} of ideal); written to {out}")
    if info is not None:
        if info["rejected"]:
            print(f"incumbent {args.incumbent} not compared: {info['rejected']}")
        elif info["kept"]:
            print(f"kept the incumbent {args.incumbent} ({fmt_seconds(info['incumbent_step_s'])} a step; "
                  f"the new plan: {fmt_seconds(info['new_step_s'])})")
        else:
            print(f"the new plan replaces the incumbent ({fmt_seconds(info['incumbent_step_s'])} a step "
                  f"here; the new plan: {fmt_seconds(info['new_step_s'])})")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .hardware import load_hardware

    hw = load_hardware(args.hardware)
    trace = u.resolve_trace(args, hardware=hw)
    names = _policy_list(args.policies)
    results = _run_policies(
        trace, hw, names, args.budget, not args.json, parse_options(args.options), args.gpus, args.strategy,
        args.pool, args.pool_time,
    )
    if args.json:
        u.print_json([r.to_dict() for r in results])
    else:
        _print_results(trace, hw, results)
    return 0


def cmd_policies(args: argparse.Namespace) -> int:
    from rich.table import Table

    from .policies import describe, policy_names

    table = Table(title="policies")
    table.add_column("name")
    table.add_column("what it does")
    for n in policy_names():
        table.add_row(n, describe(n))
    u.console().print(table)
    return 0


def cmd_hardware_list(args: argparse.Namespace) -> int:
    from rich.table import Table

    from .hardware import load_hardware, preset_names

    machines = [load_hardware(name) for name in preset_names()]
    if getattr(args, "json", False):
        u.print_json([{
            "name": hw.name,
            "device": hw.device,
            "description": hw.description,
            "tiers": {t.name: {"kind": t.kind, "capacity_bytes": t.capacity} for t in hw.tiers},
            "host_compute": None if hw.host_compute is None else {
                "optimizer_bytes_per_s": hw.host_compute.optimizer_bytes_per_s,
                "source": hw.host_compute.source,
            },
        } for hw in machines])
        return 0
    table = Table(title="hardware presets")
    for col in ("name", "device", "tiers", "host optimizer", "description"):
        table.add_column(col)
    for hw in machines:
        tiers = ", ".join(f"{t.name} {fmt_bytes(t.capacity)}" for t in hw.tiers)
        host = "-" if hw.host_compute is None else f"{hw.host_compute.optimizer_bytes_per_s / 1e9:.1f} GB/s"
        table.add_row(hw.name, hw.device, tiers, host, hw.description)
    u.console().print(table)
    return 0


def cmd_hardware_show(args: argparse.Namespace) -> int:
    from .hardware import load_hardware

    sys.stdout.write(load_hardware(args.name).to_toml())
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .hardware import load_hardware

    hw = load_hardware(args.hardware)
    con = u.console()
    quiet = args.json
    if args.synthetic:
        from .synthetic import gpt_trace

        trace = gpt_trace(hw, layers=32, d_model=2048, batch=16, seq=1024)
        what = f"{trace.name} (the built-in synthetic GPT-style trace)"
    else:
        from .capture import zoo_trace

        with con.status(f"capturing {args.model} (batch {args.batch}) on the meta device...") if not quiet else _null():
            trace = zoo_trace(args.model, batch=args.batch, hardware=hw)
        what = f"{args.model} at batch {args.batch}, captured on the meta device (nothing allocated)"
    names = _policy_list(args.policies)
    if not quiet:
        con.print(
            f"[bold]1. capture[/]: one training step of {what}: {trace.n_ops} ops, "
            f"{trace.n_tensors} tensors, ideal step {fmt_seconds(trace.ideal_s)} on {hw.name}.\n"
            f"   Unconstrained it peaks at {fmt_bytes(trace.peak_live_bytes)} "
            f"(op {trace.peak_op}, {trace.ops[trace.peak_op].name}); the device has "
            f"{fmt_bytes(hw.device_capacity)}.\n"
            f"[bold]2. plan and simulate[/]: every policy under the device's capacity."
        )
    results = _run_policies(trace, hw, names, None, not quiet)
    if not quiet:
        _print_results(trace, hw, results)
        con.print(_verdict(trace, hw, results))
    run = None
    if not args.no_train:
        from .runtime import demo_run

        if not quiet:
            con.print(
                f"[bold]3. train[/]: {args.train_model} for {args.steps} steps on this CPU at half its "
                "unconstrained peak, moving tensors to a 1 MiB host pool and an SSD file, checked against "
                "plain PyTorch."
            )
        run = demo_run(model=args.train_model, steps=args.steps, console=None if quiet else con)
    if quiet:
        u.print_json({
            "trace": trace.summary(),
            "results": [r.to_dict() for r in results],
            "train": run.to_dict() if run is not None else None,
        })
    return 0


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


# -- presentation ---------------------------------------------------------------------------


def _print_results(trace: Any, hw: Any, results: list[Any]) -> None:
    from rich.table import Table

    con = u.console()
    links = [link.name for link in hw.links if any(r.traffic_bytes.get(link.name) for r in results)]
    tiers = [t.name for t in hw.tiers if any(r.peak_bytes.get(t.name) for r in results)]
    table = Table(
        title=f"{trace.name} on {hw.name}: ideal step {fmt_seconds(trace.ideal_s)}",
        caption="traffic in GB moved per step over each link; peak in GiB held per tier",
    )
    table.add_column("policy")
    table.add_column("step", justify="right")
    table.add_column("of ideal", justify="right")
    table.add_column("stall", justify="right")
    levers = any(r.recompute_ops or r.host_steps for r in results)
    if levers:  # recompute chains on the stream; updates on the host's own stream
        table.add_column("recompute", justify="right")
        table.add_column("host steps", justify="right")
    for name in links:
        table.add_column(f"{name} GB", justify="right")
    for name in tiers:
        table.add_column(f"peak {name}", justify="right")
    pooled = any(r.pool is not None for r in results)
    if pooled:  # --pool: the device arena and what it costs over the live peak
        table.add_column(f"arena {hw.device}", justify="right")
        table.add_column("frag", justify="right")
    table.add_column("fits")
    for r in results:
        if r.error:  # no plan, or the plan cannot run: nothing measured to show
            row = [r.policy, "no plan" if not r.peak_bytes.get(hw.device) else "fails", "-", "-"]
            row += ["-"] * (len(links) + len(tiers) + 2 * levers)
        else:
            row = [r.policy, fmt_seconds(r.time_s), f"{r.ratio:.3f}", fmt_seconds(r.stall_s)]
            if levers:
                row += [fmt_seconds(r.recompute_s) if r.recompute_ops else "-",
                        fmt_seconds(r.host_step_s) if r.host_step_s else "-"]
            row += [f"{r.traffic_bytes.get(n, 0) / 1e9:.1f}" for n in links]
            row += [f"{r.peak_bytes.get(n, 0) / 2**30:.1f}" for n in tiers]
        if pooled:
            p = r.pool
            row += ["-", "-"] if p is None or not p.buffers else [
                f"{p.arena_peak_bytes / 2**30:.1f}", f"{100 * p.fragmentation_ratio:.1f}%"
            ]
        row.append("[green]yes[/]" if r.fits else "[red]no[/]")
        table.add_row(*row)
    con.print(table)
    for r in results:
        if r.pool is not None and r.pool.buffers:
            con.print(_pool_line(r))
    for r in results:
        if r.error:
            msg = r.error if r.error.startswith(f"{r.policy}:") else f"{r.policy}: {r.error}"
            con.print(f"[red]{msg}[/]")


def _pool_line(r: Any) -> str:
    """One line on a --pool result: the arena, its bound, and the budget it left."""
    p = r.pool
    line = (
        f"{r.policy}: {p.solver} pool: arena {fmt_bytes(p.arena_peak_bytes)} for {fmt_bytes(p.live_peak_bytes)} "
        f"live (bound {fmt_bytes(p.lower_bound_bytes)}, fragmentation {fmt_bytes(p.fragmentation_bytes)})"
    )
    if p.rounds > 1:
        line += (
            f"; budget {'lowered to ' + fmt_bytes(p.effective_budget_bytes) if p.fits else 'lowered'} "
            f"in {p.rounds} rounds ({p.shrink})"
        )
    return line


def _verdict(trace: Any, hw: Any, results: list[Any]) -> str:
    """Plain words: which policies fit and how close to ideal the best one gets."""
    fitting = [r for r in results if r.fits and r.policy != "ideal" and math.isfinite(r.time_s)]
    lines = []
    ideal = next((r for r in results if r.policy == "ideal"), None)
    if ideal is not None and not ideal.fits:
        lines.append(
            f"Without offloading this step does not fit: it peaks at {fmt_bytes(ideal.peak_bytes[hw.device])} "
            f"on a {fmt_bytes(hw.device_capacity)} device."
        )
    if fitting:
        best = max(fitting, key=lambda r: r.ratio)
        tied = [r.policy for r in fitting if r is not best and abs(r.time_s - best.time_s) <= 1e-9 * best.time_s]
        lines.append(
            f"Best here: [bold]{best.policy}[/]{' (tied with ' + ', '.join(tied) + ')' if tied else ''}, "
            f"predicted {fmt_seconds(best.time_s)} a step, "
            f"{best.ratio:.2f} of the ideal {fmt_seconds(best.ideal_s)}, stalling {fmt_seconds(best.stall_s)}."
        )
        for r in fitting:
            if r is not best:
                lines.append(f"  {r.policy}: {r.ratio:.2f} of ideal ({fmt_seconds(r.stall_s)} of stalls).")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
