"""What planning at tick granularity costs, in simulation: the premise of the hook-driven
steady state (docs/runtime.md, "The steady state on a GPU").

For each model: one profiled iteration through ``tierflow.offload`` on the CPU (its
trace, with the ticks the runtime logged: ``trace.meta["ticks"]``), the trace coarsened
to segments (``runtime/segments.py``), then, at shares of the trace's peak, the same
policy plans from the fine trace and from the coarse one, on the same hardware model,
and the simulator scores each (on its own trace: the coarse plan at the granularity a
hook-driven runtime would run it). Printed: ops and segments, the tensors no tick can
reach, and per budget each plan's simulated step time and peak, the coarse over the
fine. No wall-clock verdicts: the times are the simulator's, from the trace's op times
(measured on this CPU) and the chosen hardware model's links.

    PYTHONPATH=src python benchmarks/segment_plans.py [--models gpt-tiny,bert-tiny,hf-gpt2]
        [--budgets 0.5,0.3] [--hardware h100-80g-pcie5-nvme] [--policy tierflow]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import tierflow
from tierflow.errors import TierflowError
from tierflow.hardware import load_hardware
from tierflow.policies import make_plan
from tierflow.runtime.segments import coarsen
from tierflow.simulate import simulate


def _hf_gpt2(layers: int, width: int, batch: int, seq: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=2, vocab_size=256, n_positions=seq,
                     attn_implementation="eager")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).train()
    x = torch.randint(0, cfg.vocab_size, (batch, seq))
    return model, lambda m: m(input_ids=x, labels=x).loss


def _zoo(name: str):
    from tierflow.capture import zoo

    built = zoo.build(name)
    x, y = built.make_batch(4)
    return built.model.train(), lambda m: built.loss_fn(m(x), y)


def profiled_trace(name: str):
    model, loss = _hf_gpt2(12, 64, 4, 32) if name == "hf-gpt2" else _zoo(name)
    opt = torch.optim.AdamW(model.parameters())
    with tierflow.offload(model, opt) as run:
        for _ in range(2):  # warm-up, profiled
            loss(model).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return run.trace


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt-tiny,bert-tiny,hf-gpt2")
    ap.add_argument("--budgets", default="0.5,0.3")
    ap.add_argument("--hardware", default="h100-80g-pcie5-nvme")
    ap.add_argument("--policy", default="tierflow")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    hw = load_hardware(args.hardware)
    rows = []
    for name in args.models.split(","):
        trace = profiled_trace(name)
        co = coarsen(trace)
        kinds = {}
        for _op, kind, _ident in trace.meta.get("ticks", ()):
            kinds[kind] = kinds.get(kind, 0) + 1
        print(f"{name}: {trace.n_ops} ops, {co.n_segments} segments, ticks {kinds}, "
              f"{len(co.unreachable)} of {trace.n_tensors} tensors unreachable "
              f"({sum(trace.tensors[t].bytes for t in co.unreachable) / 2**20:.2f} MiB), "
              f"peak {trace.peak_live_bytes / 2**20:.2f} MiB fine, {co.trace.peak_live_bytes / 2**20:.2f} coarse")
        for share in (float(b) for b in args.budgets.split(",")):
            budget = int(share * trace.peak_live_bytes)
            row = {"model": name, "share": share, "budget": budget, "ops": trace.n_ops, "segments": co.n_segments}
            for label, tr in (("fine", trace), ("coarse", co.trace)):
                try:
                    plan = make_plan(args.policy, tr, hw, budget=budget)
                    sim = simulate(tr, hw, plan)
                    row[label] = {"time_s": sim.time_s, "peak": int(sim.peak_bytes.get(hw.device, 0)), "moves": len(plan.moves),
                                  "recomputes": len(plan.recomputes), "host_steps": len(plan.host_steps),
                                  "policy": plan.policy, "ideal_s": tr.ideal_s}
                except TierflowError as e:
                    row[label] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
            f, c = row["fine"], row["coarse"]
            if "time_s" in f and "time_s" in c:
                row["coarse_over_fine"] = c["time_s"] / f["time_s"]
                print(f"  {share:.0%}: fine {f['time_s'] * 1e3:.2f} ms (peak {f['peak'] / 2**20:.2f} MiB, "
                      f"{f['moves']} moves, {f['recomputes']} recomputes), coarse {c['time_s'] * 1e3:.2f} ms "
                      f"(peak {c['peak'] / 2**20:.2f}, {c['moves']} moves, {c['recomputes']} recomputes): "
                      f"{row['coarse_over_fine']:.3f}x; ideal {f['ideal_s'] * 1e3:.2f} ms; budget {budget / 2**20:.2f} MiB")
            else:
                def said(r):
                    return r.get("error") or (f"{r['time_s'] * 1e3:.2f} ms (peak {r['peak'] / 2**20:.2f} MiB, "
                                               f"{r['moves']} moves, {r['recomputes']} recomputes)")
                print(f"  {share:.0%}: fine {said(f)}; coarse {said(c)}; budget {budget / 2**20:.2f} MiB")
            rows.append(row)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
