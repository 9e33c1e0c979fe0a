"""GPT-2-xl data-parallel on a100-40g-pcie4-nvme with NVLink: 1/2/4/8 GPUs, DDP and FSDP.

For each setting, plans each policy for one rank (full 40 GiB device budget) and
simulates it with the ring-model comm stream (tierflow.simulate.parallel); prints a
Markdown table: the best policy that fits, its step time, its ratio to the rank's ideal
step, the time spent waiting for collectives, the bytes it offloads per tier (device to
host / to SSD per step) and the interconnect bytes per rank.

    .venv/bin/python benchmarks/parallel_gpt2xl.py [--batch 4] [--policies lru,deepum,g10]
"""

from __future__ import annotations

import argparse
import time

from tierflow.capture import zoo_trace
from tierflow.errors import PlanError
from tierflow.hardware import load_hardware
from tierflow.policies import make_plan
from tierflow.simulate.parallel import DataParallel, rank_trace, simulate_parallel

HW = "a100-40g-pcie4-nvme"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4, help="per-rank batch (default 4)")
    ap.add_argument("--policies", default="lru,deepum,g10")
    ap.add_argument("--gpus", default="1,2,4,8")
    args = ap.parse_args()
    hw = load_hardware(HW)
    base = zoo_trace("gpt2-xl", batch=args.batch, hardware=hw)
    gib = 2**30
    print(f"{base.name} on {HW}, interconnect {hw.interconnect.name} {hw.interconnect.bandwidth / 1e9:g} GB/s "
          f"per direction, {hw.interconnect.latency_s * 1e6:g} us a hop; per-rank ideal {base.ideal_s * 1e3:.1f} ms\n")
    print("| GPUs | strategy | rank peak (GiB) | fits | best policy | step (ms) | ideal/step | comm wait (ms) "
          "| to host GB | to SSD GB | interconnect GB | sim s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in [int(x) for x in args.gpus.split(",")]:
        for strategy in ("ddp", "fsdp"):
            dp = DataParallel.on(hw, n, strategy)
            tr = rank_trace(base, dp)
            t0 = time.perf_counter()
            rows = []
            for pol in args.policies.split(","):
                try:
                    plan = make_plan(pol, tr, hw)
                except PlanError as e:
                    rows.append((pol, None, str(e)))
                    continue
                rows.append((pol, simulate_parallel(tr, hw, plan, dp), ""))
            fits = [(p, r) for p, r, _ in rows if r is not None and r.sim.fits and r.time_s < float("inf")]
            mem_peak = sum(t.bytes for t in tr.tensors if t.persistent) / gib
            if not fits:
                print(f"| {n} | {strategy} | {mem_peak:.1f} persistent | none | - | - | - | - | - | - | - | "
                      f"{time.perf_counter() - t0:.0f} |")
                continue
            pol, r = min(fits, key=lambda pr: pr[1].time_s)
            tb = r.sim.traffic_bytes
            names = ",".join(p for p, _ in fits)
            print(f"| {n} | {strategy} | {r.sim.peak_bytes['gpu'] / gib:.1f} | {names} | {pol} | "
                  f"{r.time_s * 1e3:.1f} | {tr.ideal_s / r.time_s:.3f} | {r.comm_wait_s * 1e3:.2f} | "
                  f"{tb.get('gpu->host', 0) / 1e9:.1f} | {tb.get('gpu->ssd', 0) / 1e9:.1f} | "
                  f"{r.interconnect_bytes / 1e9:.2f} | {time.perf_counter() - t0:.0f} |")


if __name__ == "__main__":
    main()
