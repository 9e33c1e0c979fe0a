"""Capture benchmarks: the gpt2-medium meta capture, the zoo table, memory truth on CPU.

    .venv/bin/python benchmarks/capture_zoo.py [--skip-zoo] [--skip-truth]

Prints Markdown for BENCHMARKS.md. Every figure is measured here, on this machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from tierflow.capture import capture, summarize, zoo, zoo_trace
from tierflow.capture.check import torch_step_peak
from tierflow.units import fmt_bytes


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def gpt2_medium() -> None:
    t0 = time.perf_counter()
    tr = zoo_trace("gpt2-medium", batch=8, seq=1024, dtype="fp32")
    el = time.perf_counter() - t0
    s = summarize(tr)
    n = tr.meta["param_count"]
    print("### gpt2-medium, batch 8, seq 1024, AdamW, fp32, on meta\n")
    print(f"- capture time (build + warm-up + recorded iteration): **{el:.1f} s**")
    print(f"- parameters: {n:,}; parameter bytes {s['param_bytes']:,} = 4 x {n:,}: {s['param_bytes'] == 4 * n}")
    print(f"- AdamW state bytes {s['optimizer_bytes']:,} = 2 x parameter bytes: "
          f"{s['optimizer_bytes'] == 2 * s['param_bytes']}")
    print(f"- ops {s['ops']:,}, tensors {s['tensors']:,}, peak live {gib(s['peak_live_bytes'])} GiB at op "
          f"{s['peak_op']} ({s['peak_op_name']}, {s['peak_phase']}), roofline step on "
          f"{tr.meta['hardware']}: {s['ideal_s'] * 1e3:.1f} ms\n")


def zoo_table() -> None:
    print("### Zoo on meta (AdamW, fp32, roofline on h100-80g-pcie5-nvme)\n")
    print("| model | batch | seq | params | parameter bytes | optimizer bytes | peak activation | peak live "
          "| ops | ideal step ms | capture s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in zoo.names():
        sp = zoo.spec(name)
        t0 = time.perf_counter()
        tr = zoo_trace(name)
        el = time.perf_counter() - t0
        s = summarize(tr)
        print(f"| {name} | {sp.batch} | {sp.seq or '-'} | {tr.meta['param_count']:,} | {fmt_bytes(s['param_bytes'])} "
              f"| {fmt_bytes(s['optimizer_bytes'])} | {fmt_bytes(s['activation_peak_bytes'])} "
              f"| {fmt_bytes(s['peak_live_bytes'])} "
              f"| {s['ops']:,} | {s['ideal_s'] * 1e3:.2f} | {el:.1f} |", flush=True)
    print()


def memory_truth() -> None:
    print("### Memory truth on CPU: trace peak vs PyTorch's recorded peak\n")
    print("| model | batch | seq | trace peak live B | PyTorch peak B | error |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, b, seq in (("gpt-tiny", 8, 64), ("llama-tiny", 8, 64), ("bert-tiny", 8, 64), ("vit-tiny", 16, None),
                         ("resnet-tiny", 16, None), ("mlp-tiny", 64, None)):
        m = zoo.build(name, device="cpu")
        x, y = m.make_batch(b, seq)
        tr = capture(m.model, x, m.loss_fn, "adamw", "cpu", target=y)
        m2 = zoo.build(name, device="cpu")
        x2, y2 = m2.make_batch(b, seq)
        r = torch_step_peak(m2.model, x2, y2, m2.loss_fn, torch.optim.AdamW(m2.model.parameters(), lr=1e-4))
        err = tr.peak_live_bytes / r["peak_bytes"] - 1
        print(f"| {name} | {b} | {seq or '-'} | {tr.peak_live_bytes:,} | {int(r['peak_bytes']):,} | {err:+.2%} |",
              flush=True)
    print()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-zoo", action="store_true")
    ap.add_argument("--skip-truth", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    print(f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"no GPU.\n")
    gpt2_medium()
    if not a.skip_truth:
        memory_truth()
    if not a.skip_zoo:
        zoo_table()


if __name__ == "__main__":
    main()
