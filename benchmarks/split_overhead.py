"""Two source trees of tierflow, the runtime's cost per step compared, interleaved.

Runs ``benchmarks/runtime_overhead.py`` (gpt-tiny, CPU time) alternately with each tree
first on ``PYTHONPATH``, ``--pairs`` times, and prints for each mode the median over
the pairs of ``step(tree B) / step(tree A)``, each step taken relative to plain PyTorch
in its own run (so that a change of the machine's load between runs cancels). For a
refactoring that must not slow the runtime: A is the tree before, B after.

Usage:
    git archive <commit> src | tar -x -C /tmp/before
    python benchmarks/split_overhead.py /tmp/before/src src --pairs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("offload", "offload@60%")


def _run(src: str, rounds: int, steps: int) -> dict[str, float]:
    """Each mode's step over plain's (the median of its per-round ratios), from one run
    of runtime_overhead.py."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        # NOTE: runtime_overhead.py puts a source tree first on sys.path itself (its own
        # checkout's, unless TIERFLOW_SRC names another): PYTHONPATH alone ran this
        # checkout's tree in both arms
        tree = Path(src).resolve()
        env = dict(os.environ, PYTHONPATH=str(tree), TIERFLOW_SRC=str(tree))
        done = subprocess.run([sys.executable, str(HERE / "runtime_overhead.py"), "--modes",
                               "plain," + ",".join(MODES), "--rounds", str(rounds), "--steps", str(steps),
                               "--json", str(out)], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"runtime_overhead.py failed with {src}:\n{done.stderr[-2000:]}")
        data = json.loads(out.read_text())
    ran = Path(data["tierflow_file"]).resolve()
    if tree not in ran.parents:
        raise SystemExit(f"runtime_overhead.py ran tierflow from {ran}, not from {tree}")
    return {m: float(data["step_vs_plain"][m]) for m in MODES}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="source tree A (the directory holding the tierflow package)")
    ap.add_argument("b", help="source tree B")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)
    ratios: dict[str, list[float]] = {m: [] for m in MODES}
    for k in range(args.pairs):
        order = (args.a, args.b) if k % 2 == 0 else (args.b, args.a)  # (neither always runs first)
        got = {src: _run(src, args.rounds, args.steps) for src in order}
        for m in MODES:
            ratios[m].append(got[args.b][m] / got[args.a][m])
        print(f"pair {k + 1}: " + ", ".join(f"{m} A {got[args.a][m]:.3f}x plain, B {got[args.b][m]:.3f}x plain"
                                            for m in MODES), flush=True)
    for m in MODES:
        r = ratios[m]
        print(f"{m}: step B / step A = {statistics.median(r):.3f} (median of {len(r)} pairs; "
              f"range {min(r):.3f}-{max(r):.3f}); load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
