"""``tierflow report``: simulate policies for a trace and write an HTML report (and PNGs)."""

from __future__ import annotations

import argparse
import shlex
import sys

from .. import _cli_util as u


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``report`` command to the ``tierflow`` parser.

    Args:
        subparsers: the object ``ArgumentParser.add_subparsers()`` returned.

    Example:
        >>> import argparse
        >>> p = argparse.ArgumentParser(); register(p.add_subparsers())
        >>> p.parse_args(["report", "t.json", "-o", "r.html"]).output
        'r.html'
    """
    p = subparsers.add_parser(
        "report",
        help="write a self-contained HTML report (figures per policy; optional PNGs)",
        description="Simulate each policy's plan for a trace and write one HTML page with no "
        "external resources: memory per tier, transfers per link, stalls, a comparison and a verdict.",
    )
    u.add_trace_args(p)
    p.add_argument("--hardware", default="g10-a100", help="preset name or TOML file (default: g10-a100)")
    p.add_argument("--budget", default=None, help="device budget: bytes (20GiB) or share of the peak (30%%)")
    p.add_argument("--policies", default=None, help="comma-separated policy names (default: all)")
    p.add_argument(
        "--set", dest="options", action="append", default=[], metavar="KEY=VALUE",
        help="a policy option, e.g. --set lookahead=4, or POLICY.KEY=VALUE for one policy (repeatable)",
    )
    p.add_argument("-o", "--output", default="report.html", help="the HTML file to write (default: report.html)")
    p.add_argument("--png", default=None, metavar="DIR", help="also write every figure as a PNG into DIR")
    p.add_argument("--embed", choices=("svg", "png"), default="svg",
                   help="how figures are embedded: svg (sharp when zoomed) or png (a smaller file)")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    """Run the ``report`` command; returns the exit code (0).

    Raises:
        TierflowError: a bad trace, hardware, policy or budget (the CLI prints one line).
    """
    from ..errors import PlanError
    from ..hardware import load_hardware
    from ..policies import get_policy, make_plan, options_from_settings, policy_names, resolve_budget
    from ..simulate import SimResult, simulate
    from ..units import fmt_seconds
    from .html import write_report
    from .verdict import verdict

    names = [n.strip() for n in args.policies.split(",") if n.strip()] if args.policies else policy_names()
    for n in names:
        get_policy(n)  # an unknown name fails before any work
    options = options_from_settings(names, args.options)  # so does an unknown option
    hw = load_hardware(args.hardware)
    trace = u.resolve_trace(args, hardware=hw)
    resolve_budget(trace, hw, args.budget)  # a budget nothing can meet stops here, once
    results = []
    per = 3 * trace.n_ops  # progress units of one policy: planning 1/3, simulating 2/3
    with u.progress(f"planning {names[0]}", per * len(names)) as update:
        for k, name in enumerate(names):
            update(k * per, description=f"planning {name}")
            try:
                plan = make_plan(name, trace, hw, budget=args.budget, **options[name], progress=lambda f, what,
                                 b=k * per, n=name: update(b + f * trace.n_ops, description=f"planning {n}: {what}"))
            except PlanError as e:
                if len(names) == 1:
                    raise
                # one policy that cannot fit is a finding of the report, not its end
                results.append(SimResult.unplanned(name, trace, hw, str(e)))
                continue
            base = k * per + trace.n_ops
            update(base, description=f"simulating {name}")
            results.append(simulate(trace, hw, plan, progress=lambda d, _t, b=base: update(b + d)))
    command = "tierflow " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else None
    files = write_report(args.output, trace, hw, results, png_dir=args.png, command=command, fmt=args.embed)
    con = u.console()
    head, _ = verdict(trace, hw, results)
    for r in results:
        con.print(f"  {r.policy:<12} {fmt_seconds(r.time_s):>10}  {r.ratio:.3f} of ideal  "
                  f"{'fits' if r.fits else 'does not fit'}")
    con.print(head)
    con.print(f"wrote {files[0]}" + (f" and {len(files) - 1} PNG files in {args.png}" if args.png else ""))
    return 0
