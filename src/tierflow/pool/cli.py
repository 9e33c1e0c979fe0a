"""``tierflow pool FILE.csv``: plan the offsets of a MiniMalloc CSV."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .._cli_util import console, print_json, progress
from . import SOLVERS, read_csv, solve, speed_note, validate, write_csv
from .problem import PoolError

_PROOF_TEXT = {
    "lower-bound": "yes: the peak equals the lower bound",
    "search": "yes: no placement with a lower peak exists (proven)",
    "none": "no: not proven within the limit",
}


def proof(sol) -> str:
    """Why ``sol`` is optimal: ``"lower-bound"`` (it meets the bound), ``"search"``
    (a search proved every lower peak infeasible: the ladder's decision at peak - 1 or
    the exhaustive search), or ``"none"``."""
    if sol.peak == sol.lower_bound:
        return "lower-bound"
    return "search" if sol.optimal else "none"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "pool",
        help="plan a static memory pool: offsets for buffers of known lifetime (MiniMalloc CSV)",
        description="Read buffers (id,lower,upper,size), place them in one arena minimising its peak, "
        "check the result with an independent validator, and optionally write the CSV with offsets.",
    )
    p.add_argument("file", help="MiniMalloc CSV: id,lower,upper,size (lifetime [lower, upper))")
    p.add_argument("--solver", choices=SOLVERS, default="best", help="greedy: by size, best fit; "
                   "best: anytime search, never worse than greedy; exact: CP-SAT (or a HiGHS MILP) for small problems")
    p.add_argument("--time-limit", type=float, default=10.0, metavar="S", help="seconds for best/exact (default 10)")
    p.add_argument("--alignment", type=int, default=1, metavar="B", help="offsets are multiples of B bytes")
    p.add_argument("--seed", type=int, default=0, help="seed of best's randomised restarts")
    p.add_argument("--node-limit", type=int, default=None, metavar="N",
                   help="best: stop after N search nodes; with a time limit that does not bind, "
                   "the result is the same on every run")
    p.add_argument("--det-time", type=float, default=None, metavar="D",
                   help="best with --node-limit: CP-SAT deterministic time for the decision ladder "
                   "(default none; 0.01 is about a second of CPU); the result stays the same on every run")
    p.add_argument("-o", "--output", help="write the CSV with an offset column here")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.time_limit < 0:
        raise PoolError(f"--time-limit must be non-negative, got {args.time_limit}")
    if args.node_limit is not None and args.node_limit < 0:
        raise PoolError(f"--node-limit must be non-negative, got {args.node_limit}")
    if args.det_time is not None and args.det_time < 0:
        raise PoolError(f"--det-time must be non-negative, got {args.det_time}")
    if args.alignment < 1:
        raise PoolError(f"--alignment must be at least 1, got {args.alignment}")
    problem = read_csv(args.file, alignment=args.alignment)
    t0 = time.perf_counter()
    show = args.solver == "best" and not args.json and args.time_limit >= 1
    with progress(f"pool {problem.name}: searching", total=100, enabled=show) as update:
        sol = solve(problem, solver=args.solver, time_limit=args.time_limit, seed=args.seed,
                    node_limit=args.node_limit, progress=lambda frac, peak: update(int(frac * 100)),
                    ladder_det_budget=args.det_time)
    seconds = time.perf_counter() - t0
    note = speed_note(args.solver)
    if note:
        print(note, file=sys.stderr)
    report = validate(problem, sol.offsets, sol.peak)
    if args.output:
        write_csv(args.output, problem, sol.offsets)
    result = {
        "file": str(Path(args.file)),
        "buffers": len(problem),
        "alignment": problem.alignment,
        "peak": sol.peak,
        "lower_bound": sol.lower_bound,
        "ratio": sol.ratio,
        "solver": sol.solver,
        "seconds": round(seconds, 3),
        "valid": report.valid,
        "optimal": sol.optimal,
        "proof": proof(sol),
    }
    if note:
        result["note"] = note
    if not report.valid:
        result["errors"] = list(report.errors)
    if args.output:
        result["output"] = str(args.output)
    if args.json:
        print_json(result)
    else:
        from rich.table import Table

        t = Table(title=f"pool {problem.name}", show_header=False)
        t.add_column("", style="bold")
        t.add_column("", justify="right")
        t.add_row("buffers", f"{len(problem):,}")
        t.add_row("solver", sol.solver)
        t.add_row("peak", f"{sol.peak:,} B")
        t.add_row("lower bound", f"{sol.lower_bound:,} B")
        t.add_row("peak / bound", f"{sol.ratio:.4f}" + (" (optimal)" if sol.optimal else ""))
        t.add_row("proven optimal", _PROOF_TEXT[result["proof"]])
        t.add_row("seconds", f"{seconds:.2f}")
        t.add_row("valid", "yes" if report.valid else "[red]NO[/red]: " + report.errors[0])
        if args.output:
            t.add_row("written", str(args.output))
        console().print(t)
    return 0 if report.valid else 1
