"""How fast this machine's CPU runs an AdamW step: the figure a CPU-mode run's
``[host_compute]`` carries (``tierflow.capture.host.measure_host_optimizer``).

Runs the measurement ``--rounds`` times, interleaving one thread and all threads, and
prints each round's figure and source line, then the median per thread count, in
decimal GB/s of parameter + gradient + optimizer state processed per second.

    PYTHONPATH=src python benchmarks/host_optimizer.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from tierflow.capture.host import measure_host_optimizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    counts = sorted({1, torch.get_num_threads()})
    figures: dict[int, list[float]] = {n: [] for n in counts}
    for r in range(args.rounds):
        for n in counts:
            hc = measure_host_optimizer(threads=n)
            figures[n].append(hc.optimizer_bytes_per_s)
            print(f"round {r + 1}, {n} threads: {hc.optimizer_bytes_per_s / 1e9:.2f} GB/s  ({hc.source})")
    for n in counts:
        print(f"median, {n} threads: {statistics.median(figures[n]) / 1e9:.2f} GB/s over {args.rounds} rounds")


if __name__ == "__main__":
    main()
