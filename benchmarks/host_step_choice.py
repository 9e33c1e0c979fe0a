"""Which parameters tierflow's planner steps on the host, for a zoo model on a GPU preset
whose host links run at a given rate (the rate a CUDA run measures: ``run.stats.
link_bytes_per_s``). On CUDA a host step can change a parameter's last bits (the host's
optimizer kernels are not the GPU's), so this says where parity with plain PyTorch
depends on ``offload(host_steps=...)``.

    python benchmarks/host_step_choice.py --model vit-b16 --batch 64 --gbps 55
    python benchmarks/host_step_choice.py --model gpt2-medium --batch 4 --seq 512 --gbps 55

The trace is captured on the meta device (roofline op times), not measured on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from tierflow.capture import zoo_trace  # noqa: E402
from tierflow.hardware import load_hardware  # noqa: E402
from tierflow.policies import make_plan  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="vit-b16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--hardware", default="h100-80g-pcie5-nvme")
    ap.add_argument("--gbps", type=float, default=55.0, help="device<->host rate each way, GB/s")
    ap.add_argument("--shares", default="0.5,0.3", help="budgets as shares of the trace's peak")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    tr = zoo_trace(args.model, args.batch, args.seq, device="meta")
    hw = load_hardware(args.hardware)
    host = {t.name for t in hw.tiers if t.kind == "host"}
    rate = args.gbps * 1e9
    links, buses = [], dict(hw.buses)
    for link in hw.links:
        if (link.src == hw.device and link.dst in host) or (link.dst == hw.device and link.src in host):
            links.append(dataclasses.replace(link, bandwidth=rate))
            buses.update({b: rate for b in link.buses})
        else:
            links.append(link)
    hw = dataclasses.replace(hw, links=tuple(links), buses=buses)
    n_params = sum(1 for t in tr.tensors if t.kind == "parameter")
    print(f"{args.model} b{args.batch}" + (f" s{args.seq}" if args.seq else "") +
          f": {tr.n_ops} ops, peak {tr.peak_live_bytes / 2**20:,.1f} MiB, {n_params} parameters; "
          f"{args.hardware} with host links at {args.gbps:g} GB/s")
    for share in (float(s) for s in args.shares.split(",")):
        plan = make_plan("tierflow", tr, hw, budget=int(share * tr.peak_live_bytes))
        names = [tr.tensors[h.param].name for h in plan.host_steps]
        print(f"  {share:.0%}: host steps {len(plan.host_steps)}, recomputes {len(plan.recomputes)}, "
              f"moves {len(plan.moves)}; first host-stepped: {', '.join(names[:4]) or '-'}")
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
