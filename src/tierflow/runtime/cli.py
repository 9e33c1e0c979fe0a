"""``tierflow train``: train a zoo model under a device budget with the runtime.

Example::

    tierflow train --model gpt-tiny --batch 4 --budget 50% --steps 8 --ssd-dir /tmp --check-parity
"""

from __future__ import annotations

import argparse
import math

from .. import _cli_util as u
from ..units import fmt_bytes, fmt_seconds


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a zoo model within a device budget (profile, plan, execute)",
        description="Train a built-in model for a few steps under tierflow.offload: the first iteration is "
        "profiled, a policy plans, later iterations follow the plan; prints measured vs predicted.",
    )
    p.add_argument("--model", required=True, help="zoo model name (see 'tierflow capture --list')")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: the model's)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (transformers)")
    p.add_argument("--budget", default=None,
                   help="device budget: bytes (4GiB) or a share of the unconstrained peak (30%%); default none")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps (default 8)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="compute device (default cpu)")
    p.add_argument("--policy", default="tierflow", help="policy (default tierflow; see 'tierflow policies')")
    p.add_argument("--ssd-dir", default=None, help="directory for the SSD tier's file (default: no SSD tier)")
    p.add_argument("--check-parity", action="store_true",
                   help="also train without tierflow and compare losses, gradients, parameters bitwise")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--report", default=None, metavar="HTML",
                   help="also write the HTML report of the followed plan, measured beside predicted")
    p.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    from ..errors import TierflowError
    from .training import train

    if args.steps < 1:
        raise TierflowError(f"--steps must be >= 1, got {args.steps}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise TierflowError("--device cuda: CUDA is not available on this machine")
    res = train(args.model, batch=args.batch, budget=args.budget, steps=args.steps, device=args.device,
                policy=args.policy, ssd_dir=args.ssd_dir, check_parity=args.check_parity, seq=args.seq,
                optimizer=args.optimizer)
    if args.report:
        _write_report(args.report, res)
    if args.json:
        u.print_json(res.to_dict())
        return 0 if res.parity is not False else 1
    s = res.stats
    con = u.console()
    from rich.table import Table

    t = Table(title=f"tierflow train: {res.model} (batch {res.batch}) on {res.device}, policy {s.policy}")
    t.add_column("")
    t.add_column("value", justify="right")
    budget = "none" if not math.isfinite(s.budget_bytes) else fmt_bytes(s.budget_bytes)
    rows = [
        ("steps (profiled / planned / fell back)", f"{s.steps} ({s.profiled_steps} / {s.planned_steps} / {s.reactive_steps})"),
        ("step time, measured", fmt_seconds(s.step_time_s)),
        ("step time, predicted (simulator)", fmt_seconds(s.predicted_step_time_s) if s.predicted_step_time_s else "n/a"),
        ("step time, trace ideal", fmt_seconds(s.ideal_step_time_s) if s.ideal_step_time_s else "n/a"),
        ("step time, plain PyTorch", fmt_seconds(res.plain_step_time_s) if res.plain_step_time_s else "not run"),
        ("peak device bytes / budget", f"{fmt_bytes(s.peak_device_bytes)} / {budget}"),
        ("moved to/from host", fmt_bytes(s.moved_bytes.get("host", 0))),
        ("moved to/from ssd", fmt_bytes(s.moved_bytes.get("ssd", 0))),
        ("stalls (on-demand fetches)", f"{s.stalls} ({fmt_seconds(s.stall_s)})"),
        ("planned moves / unplanned evictions", f"{s.planned_moves} / {s.unplanned_evictions}"),
        ("stale plans / plans made", f"{s.stale_plans} / {s.replans}"),
        ("parity with plain PyTorch", "not checked" if res.parity is None else
         ("bitwise equal" if res.parity else f"DIFFERS: {res.parity_detail}")),
    ]
    for k, v in rows:
        t.add_row(k, v)
    con.print(t)
    return 0 if res.parity is not False else 1


def _write_report(path: str, res) -> None:
    """The report of the plan the run followed: the simulator's prediction and, beside
    it, the measured step time and device peak."""
    from ..errors import TierflowError
    from ..report import Measured, write_report

    run = res.run
    if run is None or run.trace is None or run.prediction is None:
        raise TierflowError("--report: the run made no plan to report on (it never profiled an iteration)")
    s = res.stats
    measured = {run.prediction.policy: Measured(
        time_s=s.step_time_s, peak_bytes={run.hardware.device: int(s.peak_device_bytes)},
        source=f"measured on {res.device}",
    )}
    write_report(path, run.trace, run.hardware, [run.prediction], measured=measured,
                 command=f"tierflow train --model {res.model}")
