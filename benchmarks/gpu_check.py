"""One command that checks tierflow's runtime on a real GPU (and, small, on the CPU).

Run on a machine with CUDA (torch preinstalled, no package registry needed)::

    PYTHONPATH=src python benchmarks/gpu_check.py --json gpu_check.json

and on the CPU, small and fast (the test suite runs this so the script cannot rot)::

    PYTHONPATH=src python benchmarks/gpu_check.py --device cpu --json gpu_check_cpu.json

What each section measures, per zoo model (three transformer/vision models: the tiny
ones on CPU, gpt2-small, bert-base and vit-b16 at moderate batches on CUDA):

1. **Memory truth.** The peak device bytes ``tierflow.capture`` predicts for one
   training iteration (``trace.peak_live_bytes``) against what the device really held:
   ``torch.cuda.max_memory_allocated`` over one plain PyTorch step on CUDA; the
   runtime's accounted peak with no budget on CPU (where there is no allocator to ask).
2. **Parity.** ``tierflow.runtime.train(..., check_parity=True)`` at 50% of the peak:
   losses, every gradient and the final parameters ``torch.equal`` to plain PyTorch.
3. **Budget.** The measured peak of that run against its budget (CUDA:
   ``torch.cuda.max_memory_allocated`` of the offload run; CPU: the accounted peak).
4. **Throughput.** Step time of plain PyTorch, ``tierflow.offload`` with no budget, at
   50% and at 30% of the peak, and of the peers that have no budget knob: every block
   under ``torch.utils.checkpoint`` and the whole step under
   ``torch.autograd.graph.save_on_cpu``, with their measured peaks, so the table says
   whether each fits the 50% and 30% budgets.
5. **Prediction.** For each tierflow run, the simulator's step time
   (``stats.predicted_step_time_s``) against the measured one.

How to read the table: ``x plain`` is step time over plain PyTorch's (lower is
better, 1.00 is free); ``peak`` is in MiB; ``fits`` says whether the peak is within
the 50%/30% budgets; ``pred/meas`` near 1 means the simulator predicted the step.
A wall-clock guard (``--time-limit``, 510 s by default) skips the rows left when time
runs out and says so, so one run stays under 9 minutes on one H100.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from tierflow.capture import zoo, zoo_trace  # noqa: E402
from tierflow.runtime import offload, train  # noqa: E402

# (model, batch, seq) per device: small enough that the whole script stays in budget
MODELS = {
    "cuda": (("gpt2-small", 8, 512), ("bert-base", 16, 256), ("vit-b16", 32, None)),
    "cpu": (("gpt-tiny", 4, 32), ("bert-tiny", 4, 32), ("vit-tiny", 4, None)),
}
SHARES = (0.5, 0.3)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a zoo model: the children of its ModuleLists."""
    return [b for m in model.modules() if isinstance(m, torch.nn.ModuleList) for b in m]


@contextlib.contextmanager
def _checkpointed(model: torch.nn.Module):
    """Every block's forward under ``torch.utils.checkpoint`` (non-reentrant), applied
    from outside the model and removed after: what a user would wrap by hand."""
    from torch.utils.checkpoint import checkpoint

    patched = []
    for b in _blocks(model):
        fwd = b.forward

        def wrapped(*a, _f=fwd, **k):
            return checkpoint(_f, *a, use_reentrant=False, **k)

        b.forward = wrapped
        patched.append(b)
    try:
        yield
    finally:
        for b in patched:
            del b.forward


class _Row:
    """One way of training one model: step times and peak."""

    def __init__(self, name: str):
        self.name = name
        self.step_s: float | None = None
        self.peak: int | None = None
        self.extra: dict[str, Any] = {}

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "step_s": self.step_s, "peak_bytes": self.peak, **self.extra}


def _loop(dev, built, x, y, opt, steps: int, warmup: int, ctx=contextlib.nullcontext) -> tuple[float, int]:
    """Train ``steps`` timed steps after ``warmup``; (mean step seconds, peak bytes of the
    timed steps on CUDA, else 0)."""
    model, loss_fn = built.model, built.loss_fn

    def step():
        with ctx():
            loss = loss_fn(model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    _sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(dev)
    dt = (time.perf_counter() - t0) / steps
    return dt, int(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else 0


def _fresh(name: str, dev: torch.device, batch: int, seq: int | None):
    built = zoo.build(name, device=dev.type, seed=0)
    x, y = built.make_batch(batch, seq)
    opt = torch.optim.AdamW(built.model.parameters(), lr=1e-4)
    return built, x, y, opt


def _free(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def check_model(name: str, batch: int, seq: int | None, dev: torch.device, steps: int, warmup: int,
                deadline: float) -> dict[str, Any]:
    out: dict[str, Any] = {"model": name, "batch": batch, "seq": seq}
    # 1. memory truth
    trace = zoo_trace(name, batch=batch, seq=seq, device=dev.type)
    predicted = int(trace.peak_live_bytes)
    del trace
    built, x, y, opt = _fresh(name, dev, batch, seq)
    plain_s, plain_peak = _loop(dev, built, x, y, opt, steps, warmup)
    if dev.type != "cuda":  # no allocator to ask: the runtime's accounted peak, no budget
        with offload(built.model, opt) as run:
            _loop(dev, built, x, y, opt, 2, 1)
        plain_peak = run.stats.peak_device_bytes
    out["memory"] = {"captured_peak_bytes": predicted, "measured_peak_bytes": plain_peak,
                     "ratio": predicted / plain_peak if plain_peak else None,
                     "measured_by": "torch.cuda.max_memory_allocated" if dev.type == "cuda" else "runtime accounting"}
    rows = [_Row("plain")]
    rows[0].step_s, rows[0].peak = plain_s, plain_peak
    del built, x, y, opt
    _free(dev)

    # 2-3. parity and the budget
    res = train(name, batch=batch, seq=seq, budget="50%", steps=max(steps, 4), device=dev.type, check_parity=True)
    s = res.stats
    measured = s.cuda_max_allocated if dev.type == "cuda" else s.peak_device_bytes
    out["parity"] = {"budget": "50%", "parity": res.parity, "detail": res.parity_detail,
                     "budget_bytes": int(s.budget_bytes), "peak_bytes": measured,
                     "within_budget": measured is not None and measured <= s.budget_bytes}
    _free(dev)

    # 4-5. throughput and prediction
    for label, budget in (("tierflow, no budget", None), ("tierflow 50%", "50%"), ("tierflow 30%", "30%")):
        if time.monotonic() > deadline:
            out.setdefault("skipped", []).append(label)
            continue
        built, x, y, opt = _fresh(name, dev, batch, seq)
        row = _Row(label)
        with offload(built.model, opt, budget=budget) as run:
            _loop(dev, built, x, y, opt, 1, 3)  # warm-up, profile, first planned step
            row.step_s, _ = _loop(dev, built, x, y, opt, steps, 0)
        st = run.stats
        row.peak = st.cuda_max_allocated if dev.type == "cuda" else st.peak_device_bytes
        row.extra = {"budget_bytes": None if budget is None else int(st.budget_bytes),
                     "predicted_step_s": st.predicted_step_time_s, "measured_step_s": st.step_time_s,
                     "policy": st.policy, "moved_bytes": dict(st.moved_bytes), "stalls": st.stalls,
                     "blocking_waits": dict(st.blocking_waits), "optimizer_chunks": st.optimizer_chunks}
        rows.append(row)
        del built, x, y, opt, run
        _free(dev)
    for label in ("checkpoint (every block)", "save_on_cpu"):
        if time.monotonic() > deadline:
            out.setdefault("skipped", []).append(label)
            continue
        built, x, y, opt = _fresh(name, dev, batch, seq)
        row = _Row(label)
        if label.startswith("checkpoint"):
            with _checkpointed(built.model):
                row.step_s, row.peak = _loop(dev, built, x, y, opt, steps, warmup)
        else:
            def ctx():
                return torch.autograd.graph.save_on_cpu(pin_memory=dev.type == "cuda")
            row.step_s, row.peak = _loop(dev, built, x, y, opt, steps, warmup, ctx)
        if dev.type != "cuda":
            row.peak = None  # (no allocator on CPU: their peaks are not measured here)
        rows.append(row)
        del built, x, y, opt
        _free(dev)
    for r in rows:
        r.extra["x_plain"] = r.step_s / plain_s if r.step_s and plain_s else None
        if r.peak is not None and plain_peak:
            r.extra["fits"] = {f"{int(sh * 100)}%": r.peak <= sh * plain_peak for sh in SHARES}
    out["rows"] = [r.to_dict() for r in rows]
    return out


def _table(results: list[dict[str, Any]]) -> str:
    mib = 1 << 20
    lines = []
    for m in results:
        mem, par = m["memory"], m["parity"]
        lines.append(f"\n{m['model']} b{m['batch']}{' s' + str(m['seq']) if m['seq'] else ''}: captured peak "
                     f"{mem['captured_peak_bytes'] / mib:.1f} MiB vs measured {mem['measured_peak_bytes'] / mib:.1f} MiB "
                     f"({mem['ratio']:.3f}); parity at 50%: {par['parity']}; peak {par['peak_bytes'] / mib:.1f} MiB "
                     f"of a {par['budget_bytes'] / mib:.1f} MiB budget ({'within' if par['within_budget'] else 'OVER'})")
        lines.append(f"  {'run':<26} {'step ms':>9} {'x plain':>8} {'peak MiB':>9} {'fits 50%/30%':>13} {'pred/meas':>10}")
        for r in m["rows"]:
            fits = r.get("fits")
            f = "/".join("yes" if v else "no" for v in fits.values()) if fits else "-"
            pm = (f"{r['predicted_step_s'] / r['measured_step_s']:.2f}"
                  if r.get("predicted_step_s") and r.get("measured_step_s") else "-")
            peak = f"{r['peak_bytes'] / mib:.1f}" if r["peak_bytes"] is not None else "-"
            lines.append(f"  {r['name']:<26} {r['step_s'] * 1e3:>9.2f} {r['x_plain']:>8.2f} {peak:>9} {f:>13} {pm:>10}")
        if m.get("skipped"):
            lines.append(f"  skipped (time limit): {', '.join(m['skipped'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default=None, help="comma-separated zoo names (default: three per device)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per row (default 10 on CUDA, 2 on CPU)")
    ap.add_argument("--time-limit", type=float, default=510.0, help="seconds; later rows are skipped (default 510)")
    ap.add_argument("--json", default="gpu_check.json")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available here (use --device cpu)")
    start = time.monotonic()
    deadline = start + args.time_limit
    steps = args.steps or (10 if dev.type == "cuda" else 2)
    models = MODELS[dev.type]
    if args.models:
        want = args.models.split(",")
        models = tuple((n, zoo.spec(n).batch, zoo.spec(n).seq) for n in want)
    info = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "threads": torch.get_num_threads()}
    results = []
    for name, batch, seq in models:
        if time.monotonic() > deadline:
            results.append({"model": name, "skipped": "time limit"})
            continue
        results.append(check_model(name, batch, seq, dev, steps, 2, deadline))
    done = [r for r in results if "rows" in r]
    out = {"machine": info, "wall_s": time.monotonic() - start, "results": results,
           "all_parity": all(r["parity"]["parity"] for r in done),
           "all_within_budget": all(r["parity"]["within_budget"] for r in done)}
    print(f"tierflow gpu_check on {info['device']} (torch {info['torch']}, CUDA {info['cuda']})")
    print(_table(done))
    print(f"\nparity everywhere: {out['all_parity']}; every peak within its budget: {out['all_within_budget']}; "
          f"{out['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
