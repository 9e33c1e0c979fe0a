"""Soak: many steps of a tiny model whose every movable tensor goes through host and SSD
each step (the round-trip plan); host memory (RSS), the pool and SSD slots in use, and
open files must stay flat.

    .venv/bin/python benchmarks/runtime_soak.py --steps 1000 [--model mlp-tiny] [--json]

Prints one line per checkpoint and a verdict; exit 1 if anything grew.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def soak(model: str = "mlp-tiny", steps: int = 1000, every: int = 100, ssd_dir: str | None = None) -> dict:
    """Run ``steps`` steps under the round-trip plan; sample at every ``every`` steps.

    Returns the samples and the growth between the first sample (after warm-up) and the
    last: ``rss``, ``fds``, ``host``/``ssd``/``bounce`` slots in use at step boundaries.
    """
    import torch

    from tierflow.capture import zoo
    from tierflow.runtime import offload, roundtrip_plan

    torch.set_num_threads(1)
    m = zoo.build(model, seed=0)
    x, y = m.make_batch(8) if zoo.spec(model).seq is None else m.make_batch(2, 16)
    opt = torch.optim.AdamW(m.model.parameters(), lr=1e-3)
    samples = []
    with tempfile.TemporaryDirectory(dir=ssd_dir) as d:
        with offload(m.model, opt, policy=lambda tr, hw, b: roundtrip_plan(tr, hw), ssd_dir=d) as run:
            t0 = time.perf_counter()
            for i in range(1, steps + 1):
                m.loss_fn(m.model(x), y).backward()
                opt.step()
                opt.zero_grad()
                if i % every == 0 or i == 20:
                    use = run.tier_usage
                    samples.append({"step": i, "rss": rss_bytes(), "fds": open_fds(), **use,
                                    "elapsed_s": time.perf_counter() - t0})
        stats = run.stats
    base, last = samples[0], samples[-1]
    growth = {k: last[k] - base[k] for k in ("rss", "fds", "host", "ssd", "bounce")}
    return {"model": model, "steps": steps, "samples": samples, "growth": growth,
            "moved_bytes": stats.moved_bytes, "planned_steps": stats.planned_steps,
            "step_time_s": stats.step_time_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp-tiny")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    r = soak(args.model, args.steps, args.every)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        for s in r["samples"]:
            print(f"step {s['step']:5d}  rss {s['rss'] / 2**20:8.2f} MiB  fds {s['fds']:3d}  host {s['host']:8d}  "
                  f"ssd {s['ssd']:8d}  bounce {s['bounce']:8d}  {s['elapsed_s']:7.1f} s")
        print(f"moved {r['moved_bytes']}, step {r['step_time_s'] * 1e3:.2f} ms, growth {r['growth']}")
    flat = r["growth"]["fds"] == 0 and r["growth"]["host"] == 0 and r["growth"]["ssd"] == 0 \
        and r["growth"]["rss"] < 4 << 20
    print("flat" if flat else "GREW")
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
