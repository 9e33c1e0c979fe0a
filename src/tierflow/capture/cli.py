"""``tierflow capture`` and ``tierflow inspect``.

    tierflow capture --list
    tierflow capture --model gpt2-medium --batch 8 --seq 1024 -o gpt2m.json.gz
    tierflow inspect gpt2m.json.gz [--json]
    tierflow inspect gpt-tiny --batch 4 --json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from .. import _cli_util as u
from ..errors import TraceError


def register(subparsers: Any) -> None:
    """Add the ``capture`` and ``inspect`` subcommands to the main CLI."""
    p = subparsers.add_parser(
        "capture", help="record one training iteration of a zoo model as a trace",
        description="Record forward, backward and optimizer step of a built-in model as a trace file. "
        "On meta nothing is allocated and op durations come from a roofline cost model.",
    )
    p.add_argument("--list", action="store_true", help="list the zoo models and exit")
    p.add_argument("--model", help="zoo model name (see --list)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: the model's benchmark batch)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (language models)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="parameter and compute dtype")
    p.add_argument("--device", choices=("meta", "cpu", "cuda"), default="meta",
                   help="meta: nothing allocated, roofline durations (default); cpu/cuda: measured")
    p.add_argument("--hardware", default=None,
                   help="preset or TOML file for the roofline cost model (default: h100-80g-pcie5-nvme)")
    p.add_argument("--optimizer", choices=("adamw", "adam", "sgd", "none"), default="adamw")
    p.add_argument("--autocast", choices=("bf16", "fp16"), default=None, help="mixed precision for forward")
    p.add_argument("--accumulation-steps", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("-o", "--output", help="trace file to write (.json or .json.gz)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_capture)

    q = subparsers.add_parser(
        "inspect", help="summarise a trace or a zoo model's iteration",
        description="Ops, tensors, bytes per kind, peak live bytes and where it occurs, ideal step time.",
    )
    u.add_trace_args(q)
    q.add_argument("--hardware", default=None, help="cost-model preset when a zoo model is named")
    q.add_argument("--json", action="store_true", help="print JSON")
    q.set_defaults(func=_inspect)


def _capture(args: argparse.Namespace) -> int:
    from . import zoo
    from .from_zoo import zoo_trace

    if args.list:
        return _list(args)
    if not args.model:
        raise TraceError("capture: give --model NAME (see 'tierflow capture --list')")
    if not args.output and not args.json:
        raise TraceError("capture: give -o FILE to write the trace (or --json to print its summary)")
    if args.output and not (args.output.endswith(".json") or args.output.endswith(".json.gz")):
        raise TraceError(f"capture: -o {args.output}: the name must end in .json or .json.gz")
    zoo.spec(args.model)
    t0 = time.perf_counter()
    with u.status(f"capturing {args.model}", enabled=not args.json) as say:
        trace = zoo_trace(args.model, batch=args.batch, seq=args.seq, dtype=args.dtype, hardware=args.hardware,
                          device=args.device, optimizer=args.optimizer, autocast=args.autocast,
                          accumulation_steps=args.accumulation_steps, progress=say)
    elapsed = time.perf_counter() - t0
    if args.output:
        trace.save(args.output)
    from .summary import summarize

    s = summarize(trace)
    s["capture_s"] = elapsed
    if args.output:
        s["output"] = str(Path(args.output))
    if args.json:
        u.print_json(s)
    else:
        _print_summary(s)
        u.console().print(f"captured in {elapsed:.1f} s" + (f" -> {args.output}" if args.output else ""))
    return 0


def _list(args: argparse.Namespace) -> int:
    from . import zoo

    rows = []
    for n in zoo.names():
        sp = zoo.spec(n)
        rows.append({"name": n, "family": sp.family, "params": sp.params, "batch": sp.batch, "seq": sp.seq,
                     "description": sp.description})
    if args.json:
        u.print_json(rows)
        return 0
    from rich.table import Table

    t = Table(title="tierflow zoo")
    for c in ("model", "published params", "default batch", "seq", "architecture"):
        t.add_column(c, justify="right" if c in ("published params", "default batch", "seq") else "left")
    for r in rows:
        t.add_row(r["name"], f"{r['params']:,}" if r["params"] else "-", str(r["batch"]),
                  str(r["seq"] or "-"), r["description"])
    u.console().print(t)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from . import zoo
    from .summary import summarize

    if args.trace and not args.model and not Path(args.trace).exists() and args.trace in zoo.names():
        args.model, args.trace = args.trace, None
    trace = u.resolve_trace(args, hardware=args.hardware)
    s = summarize(trace)
    if args.json:
        u.print_json(s)
    else:
        _print_summary(s)
    return 0


def _print_summary(s: dict[str, Any]) -> None:
    from rich.table import Table

    from ..units import fmt_bytes, fmt_seconds

    t = Table(title=f"trace {s['name']}", show_header=False)
    t.add_column("field")
    t.add_column("value", justify="right")
    t.add_row("ops", f"{s['ops']:,}")
    t.add_row("tensors", f"{s['tensors']:,}")
    for label, key in (("parameters", "param_bytes"), ("gradients", "grad_bytes"),
                       ("optimizer state", "optimizer_bytes"), ("inputs", "input_bytes"),
                       ("activations (peak live)", "activation_peak_bytes"),
                       ("temporaries (peak live)", "temporary_peak_bytes"), ("peak live", "peak_live_bytes")):
        t.add_row(label, f"{fmt_bytes(s[key])} ({s[key]:,} B)")
    if s["peak_op_name"] is not None:
        t.add_row("peak at", f"op {s['peak_op']} {s['peak_op_name']} ({s['peak_phase']})")
    t.add_row("ideal step", fmt_seconds(s["ideal_s"]))
    for ph, v in s["phase_s"].items():
        t.add_row(f"  {ph}", fmt_seconds(v))
    meta = s.get("meta") or {}
    for k in ("device", "timing", "hardware", "optimizer", "autocast", "accumulation_steps"):
        if meta.get(k) is not None:
            t.add_row(k, str(meta[k]))
    u.console().print(t)
