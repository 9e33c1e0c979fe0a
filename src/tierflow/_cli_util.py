"""Small pieces every CLI command shares: output, errors, progress, trace sources.

Command modules (``cli.py``, ``capture/cli.py``, ``pool/cli.py``) import from here, never
from each other. Rich is imported lazily so that ``import tierflow`` stays light.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def console(stderr: bool = False):
    """A rich console; when output is not a terminal (a pipe, CI, a file) tables get a
    wide fixed width instead of rich's 80 columns, so rows do not wrap."""
    from rich.console import Console

    con = Console(stderr=stderr, highlight=False)
    if not con.is_terminal:
        con = Console(stderr=stderr, highlight=False, width=160)
    return con


def print_json(obj: Any) -> None:
    """One JSON document on stdout; ``inf`` becomes ``null`` so any parser reads it."""
    sys.stdout.write(json.dumps(_finite(obj), indent=2) + "\n")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


@contextmanager
def progress(description: str, total: int, enabled: bool = True) -> Iterator[Any]:
    """A transient progress bar on stderr (only on a terminal: never in a pipe, a file or
    CI, and never with ``--json``, whose callers pass ``enabled=False``), yielding an
    ``update(done, total=total, description=None)`` callable; work slower than a second
    should report through it."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    err = console(stderr=True)
    if not enabled or not err.is_terminal:
        yield lambda done, total=total, description=None: None
        return
    with Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(), console=err, transient=True,
    ) as bar:
        task = bar.add_task(description, total=total)

        def update(done: float, total: int = total, description: str | None = None) -> None:
            if description is None:
                bar.update(task, completed=done, total=total)
            else:
                bar.update(task, completed=done, total=total, description=description)

        yield update


@contextmanager
def status(text: str, enabled: bool = True) -> Iterator[Any]:
    """A spinner on stderr (only on a terminal, and not with ``--json``: callers pass
    ``enabled=False``), yielding ``say(words)`` to change its text."""
    err = console(stderr=True)
    if not enabled or not err.is_terminal:
        yield lambda words: None
        return
    with err.status(text) as spinner:
        yield lambda words: spinner.update(f"{text}: {words}")


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """A trace source: a file or G10 case directory, or ``--model NAME --batch B``."""
    p.add_argument("trace", nargs="?", help="trace file (.json/.json.gz) or G10 case directory")
    g = p.add_argument_group("built-in model instead of a trace file")
    g.add_argument("--model", help="zoo model name (see 'tierflow capture --list')")
    g.add_argument("--batch", type=int, default=None, help="batch size for --model")
    g.add_argument("--seq", type=int, default=None, help="sequence length for --model (transformers)")
    g.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="parameter/compute dtype for --model")


def resolve_trace(args: argparse.Namespace, hardware: Any = None):
    """The trace named on the command line, loaded or captured."""
    from .errors import TraceError
    from .trace import load_trace

    if getattr(args, "model", None):
        if args.trace:
            raise TraceError("give either a trace path or --model, not both")
        try:
            from .capture import zoo_trace
        except ImportError as e:  # the capture layer is optional until it lands
            raise TraceError(f"--model needs tierflow.capture ({e})") from None
        with status(f"capturing {args.model}", enabled=not getattr(args, "json", False)) as say:
            return zoo_trace(args.model, batch=args.batch, seq=args.seq, dtype=args.dtype, hardware=hardware,
                             progress=say)
    if not args.trace:
        raise TraceError("no trace given: pass a trace file, a G10 case directory, or --model NAME")
    return load_trace(args.trace)
