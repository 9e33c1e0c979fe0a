"""Parity and budget matrix: every policy x {gpt-tiny, vit-tiny, resnet-tiny} x 20 steps in
CPU mode with host and SSD tiers, against plain PyTorch (losses, every gradient, final
parameters: torch.equal), plus the round-trip plan that moves every kind of tensor
through both tiers. One row per run: parity, peak/budget, bytes moved, step times.

    .venv/bin/python benchmarks/runtime_parity.py [--steps 20] [--budget 60%] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

MODELS = ("gpt-tiny", "vit-tiny", "resnet-tiny")
OPTIONS = {"singa": {"min_bytes": 4096}}  # SINGA's 1 MB block threshold, scaled to tiny models


def main() -> int:
    import torch

    from tierflow.plan import validate
    from tierflow.policies import policy_names
    from tierflow.runtime import roundtrip_plan, train

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--budget", default="60%")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)

    def roundtrip(tr, hw, b):
        p = roundtrip_plan(tr, hw)
        validate(p, tr, hw)
        return p

    rows, ok = [], True
    for model in MODELS:
        for policy in ["roundtrip", *policy_names()]:
            with tempfile.TemporaryDirectory() as d:
                res = train(model, budget=None if policy == "roundtrip" else args.budget, steps=args.steps,
                            policy=roundtrip if policy == "roundtrip" else policy, ssd_dir=d, check_parity=True,
                            policy_options=OPTIONS.get(policy))
            s = res.stats
            row = {"model": model, "policy": policy, "ran": s.policy, "parity": res.parity,
                   "peak": s.peak_device_bytes, "budget": None if s.budget_bytes == float("inf") else int(s.budget_bytes),
                   "host": s.moved_bytes.get("host", 0), "ssd": s.moved_bytes.get("ssd", 0), "stalls": s.stalls,
                   "step_ms": s.step_time_s * 1e3, "plain_ms": (res.plain_step_time_s or 0) * 1e3,
                   "pred_ms": (s.predicted_step_time_s or 0) * 1e3, "plan_error": s.plan_error}
            ok &= bool(res.parity) and (row["budget"] is None or row["peak"] <= row["budget"])
            rows.append(row)
            if not args.json:
                print(f"{model:12s} {policy:11s} ran {s.policy:26s} parity {res.parity!s:5s} peak {row['peak']:8d} "
                      f"budget {row['budget'] or 0:8d} host {row['host']:10d} ssd {row['ssd']:10d} "
                      f"stalls {row['stalls']:5d} step {row['step_ms']:6.1f} ms plain {row['plain_ms']:5.1f} ms "
                      f"pred {row['pred_ms']:5.1f} ms", flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    print("all exact and within budget" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
