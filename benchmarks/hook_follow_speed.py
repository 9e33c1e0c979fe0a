"""Followed steps at ticks against followed op by op, CPU mode: ``offload(follow="hooks")``
against ``follow="ops"`` (the default) and plain PyTorch, interleaved round by round.

Per round and way: a fresh copy of the model and optimizer (same seed), 3 steps to
profile and plan (warm-up, profiled, first followed), then ``--steps`` timed steps; the
median of each way's per-round medians is printed with its ratio to plain, the plan's
moves, the steps that followed it, on-demand fetches and the accounted peak against
the budget. No verdict is drawn from the times here (a shared machine); read the
ratios inside one run, and the load printed with them.

    PYTHONPATH=src python benchmarks/hook_follow_speed.py [--model hf-gpt2|gpt-tiny|bert-tiny|vit-tiny]
        [--budget 50%] [--rounds 5] [--steps 5]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

import tierflow


def _workload(name: str):
    if name == "hf-gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=24, n_embd=64, n_head=2, vocab_size=256, n_positions=32, attn_implementation="eager")
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg).train()
        x = torch.randint(0, cfg.vocab_size, (4, 32))
        return model, lambda m: m(input_ids=x, labels=x).loss
    from tierflow.capture import zoo

    built = zoo.build(name)
    x, y = built.make_batch(4)
    return built.model.train(), lambda m: built.loss_fn(m(x), y)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="hf-gpt2")
    ap.add_argument("--budget", default="50%", help="a share, bytes, or none (no budget: the followers' own cost)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--single-tensor", action="store_true",
                    help="AdamW one parameter at a time (CPU's default); by default foreach, as on CUDA, so "
                         "that the optimizer is a few ops, as a GPU user's is")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    base, loss = _workload(args.model)
    ways: dict[str, list[float]] = {"plain": [], "ops": [], "hooks": []}
    info: dict[str, str] = {}

    def steps(model, opt, n: int) -> list[float]:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            loss(model).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ts.append(time.perf_counter() - t0)
        return ts

    for _ in range(args.rounds):
        for way in ways:
            model = copy.deepcopy(base)
            opt = torch.optim.AdamW(model.parameters(), foreach=not args.single_tensor)
            if way == "plain":
                steps(model, opt, 3)
                ways[way].append(statistics.median(steps(model, opt, args.steps)))
                continue
            budget = None if args.budget.lower() == "none" else args.budget
            with tierflow.offload(model, opt, budget=budget, follow=way) as run:
                steps(model, opt, 3)
                ways[way].append(statistics.median(steps(model, opt, args.steps)))
            s = run.stats
            info[way] = (f"follow {s.follow}, {len(run.plan.moves) if run.plan else 0} moves in the plan, "
                         f"{s.planned_steps} of {s.steps} steps planned, {s.stalls} on-demand fetches, "
                         f"peak {s.peak_device_bytes_planned / 2**20:.2f} of {s.budget_bytes / 2**20:.2f} MiB"
                         + (f", departures {s.stale_reasons[:1]}" if s.stale_reasons else ""))
    load = os.getloadavg()[0]
    print(f"{args.model} at {args.budget}, AdamW {'single-tensor' if args.single_tensor else 'foreach'}, "
          f"torch {torch.__version__}, 1 thread, {args.rounds} rounds x "
          f"{args.steps} steps, load average {load:.2f}")
    plain = statistics.median(ways["plain"])
    for way, v in ways.items():
        m = statistics.median(v)
        print(f"  {way:6s} {m * 1e3:8.2f} ms  {m / plain:.2f}x plain  {info.get(way, '')}")


if __name__ == "__main__":
    main()
