"""What a followed iteration could cost the host if the runtime acted at hooks instead
of at every aten op: the floor of the design decided in docs/runtime.md ("The steady
state on a GPU").

Three ways to run the same training step, interleaved round by round, medians:

* ``plain``: PyTorch alone;
* ``hooks``: PyTorch with the hooks a hook-driven runtime would listen to, doing a
  counter's work: every module's forward pre- and post-hook, and saved-tensor pack and
  unpack hooks (the ticks at which it would act);
* ``per-op``: ``tierflow.offload`` without a budget (an empty plan: the per-op dispatch
  mode and lean path with nothing to do, the runtime's floor today).

It prints each median, the ratios to plain, the ops per step (the runtime's trace) and
the ticks per step, and the cost per op and per tick above plain. CPU mode: the host
runs the kernels too, so this is the per-op Python cost without a GPU's launch queue;
on a GPU the same host cost is what keeps the device waiting (BENCHMARKS.md, the H200
run at 824f12f).

    PYTHONPATH=src python benchmarks/hook_floor.py [--layers 24] [--width 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.nn.modules import module as module_hooks

import tierflow


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round and way")
    args = ap.parse_args(argv)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=2, vocab_size=256, n_positions=args.seq,
                     attn_implementation="eager")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).train()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))

    def step() -> None:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed() -> float:
        step()  # (one untimed: the way's caches warm)
        ts = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    ticks = [0]

    def tick(*_a):
        ticks[0] += 1

    def pack(t):
        ticks[0] += 1
        return t

    def unpack(t):
        ticks[0] += 1
        return t

    def with_hooks() -> float:
        handles = [module_hooks.register_module_forward_pre_hook(tick), module_hooks.register_module_forward_hook(tick)]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return timed()
        finally:
            for h in handles:
                h.remove()

    times: dict[str, list[float]] = {"plain": [], "hooks": [], "per-op": []}
    n_ops = None
    for _ in range(args.rounds):
        times["plain"].append(timed())
        times["hooks"].append(with_hooks())
        with tierflow.offload(model, opt) as run:
            for _ in range(3):  # warm-up, profiled, first followed
                step()
            times["per-op"].append(timed())
            n_ops = run.trace.n_ops if run.trace is not None else None
    ticks[0] = 0
    handles = [module_hooks.register_module_forward_pre_hook(tick), module_hooks.register_module_forward_hook(tick)]
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        step()
    for h in handles:
        h.remove()
    med = {k: statistics.median(v) for k, v in times.items()}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"GPT-2 {args.layers} x {args.width}, batch {args.batch} x {args.seq}, AdamW, torch {torch.__version__}, "
          f"1 thread, {args.rounds} rounds x {args.steps} steps, load average {load:.2f}")
    for k, v in med.items():
        print(f"  {k:7s} {v * 1e3:8.2f} ms  {v / med['plain']:.2f}x plain")
    print(f"  ops per step (trace): {n_ops}; ticks per step: {ticks[0]}")
    if n_ops:
        print(f"  above plain: per-op {1e6 * (med['per-op'] - med['plain']) / n_ops:.1f} us an op; "
              f"hooks {1e6 * (med['hooks'] - med['plain']) / max(1, ticks[0]):.1f} us a tick")


if __name__ == "__main__":
    main()
