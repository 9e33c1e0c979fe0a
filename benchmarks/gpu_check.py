"""One GPU check: does tierflow tell the truth about memory, train bit for bit like
PyTorch, keep its budget, and how fast is it next to the tools people use today?

How to run (one device call, about 9 minutes on an H100; results, the log and the
gzipped Chrome traces come back in $OUT)::

    set -o pipefail; PYTHONUNBUFFERED=1 PYTHONPATH=src python3 benchmarks/gpu_check.py --out $OUT --time-limit 470 2>&1 | tee $OUT/gpu_check.log

(device tool: ``run(command=<that line>, timeout_s=540)``: the guard starts no row it
expects to end after 470 s, which leaves a row that overruns its estimate, and the
start, room inside the 9 minutes; rows left out are listed under ``skipped`` and can be
run in a second call with ``--models``/``--parts``.) ``--out DIR`` runs the rows
of the GPU-defaults and follow-the-plan issues (benchmarks/gpu_suite.py: the Hugging
Face GPT-2 from a config, then gpt2-medium, the HF compile sweep, bert-large, vit-b16,
the zoo compile sweeps; ``DIR/gpu_check.json`` rewritten after every row,
``DIR/timelines-*.tar``). Its CPU dry run: ``--device cpu --out /tmp/gc`` (tiny models,
about a minute). Without ``--out`` the sections below run, as before:

    PYTHONPATH=src python benchmarks/gpu_check.py                  # CUDA when there is one
    PYTHONPATH=src python benchmarks/gpu_check.py --device cpu     # small models, < 1 min
    ... [--json gpu_check.json] [--models gpt2-medium:4:512,vit-b16:64] [--quick] [--time-limit 480]

It imports only torch, numpy (through tierflow) and tierflow, so it runs from a source
tree on a machine without a package registry. Every figure is measured in this run; the
JSON (``--json``) holds every row, the environment (device name, torch and CUDA
versions) and the rows a wall-clock guard skipped (``skipped``: a row is skipped, with a
note, when the longest row of its kind so far would not finish before ``--time-limit``).

Sections (one table each):

1. **memory truth** -- ``peak_live_bytes`` of the trace ``tierflow.capture`` records on
   the device (the peak the planner plans against) over the peak PyTorch itself reports
   for one plain training step (``tierflow.capture.check.torch_step_peak``: on CUDA
   ``torch.cuda.max_memory_allocated``; on CPU the allocator's events under
   ``torch.profiler``). A ratio near 1 means the planner sees the memory that is there.
   This measured plain peak is the *reference peak* of sections 3-4.
2. **parity** -- ``tierflow.runtime.train(..., check_parity=True)`` at a 50% budget:
   losses, every gradient of every step and the final parameters compared with
   ``torch.equal`` against the same model trained in plain PyTorch. Two runs can only
   match bit for bit if each is reproducible, so on CUDA this section runs under
   ``torch.use_deterministic_algorithms(True, warn_only=True)`` with the math attention
   backend (the fused attention backward is not deterministic); ops that warned they
   have no deterministic kernel are listed in the JSON (``nondeterministic_ops``).
3. **budget** -- each budgeted tierflow run of section 4: its budget (a share of the
   reference peak, in bytes) and its peak over the timed steps, all planned: on CUDA
   ``torch.cuda.max_memory_allocated`` (reset after warm-up), on CPU the peak tierflow
   accounts (``run.stats.peak_device_bytes_planned``). ``within``: that peak is at most
   the budget -- the check. ``whole run`` is the same over every step, the warm-up ones
   included (Adam's first step and the profiled one run reactive; on CUDA also the
   planner's bandwidth probe): shown, not checked. ``untracked``: the device memory
   in use that no storage tierflow tracks explains (cuBLAS's workspaces, the caching
   allocator's rounding), measured while profiling; the plan keeps it free
   (``run.stats.untracked_device_bytes``; 0 on CPU).
4. **throughput** -- median step time over the timed steps (after warm-up; each step
   synchronised on CUDA; the mean is in the JSON) of plain PyTorch,
   ``torch.utils.checkpoint`` around every transformer block / residual stage (put on
   from outside: each block's ``forward`` is wrapped), ``torch.autograd.graph.save_on_cpu``
   (pinned on CUDA) around forward and loss, and tierflow with no budget, 50% and 30%
   of the reference peak. ``x plain`` is step time over plain's. The peers have no
   budget knob: their peak (measured as in section 1) is shown with whether it fits in
   50% / 30% of the reference peak. tierflow's peak is as in section 3. On CPU
   ``save_on_cpu`` moves nothing (activations already live on the host): plain plus
   its hooks.
5. **prediction** -- tierflow's predicted step time (``run.stats.predicted_step_time_s``,
   the simulator on the planned trace) over its measured one (``run.stats.step_time_s``,
   the runtime's mean over planned steps). Below 1: slower than predicted.

Exit status 0 when every parity holds, every budgeted run stays within its budget
and no row raised.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import tierflow
from tierflow.capture import zoo, zoo_trace
from tierflow.capture.check import torch_step_peak
from tierflow.errors import TierflowError
from tierflow.runtime import BudgetError, train

# (zoo name, batch, seq). CUDA: sizes whose activations dominate, so that 30% of the peak
# is above the minimum working set (gpt2-small's logits alone are 31% of its peak) and
# the whole check stays well under 9 minutes on one H100.
MODELS = {
    "cuda": [("gpt2-medium", 4, 512), ("bert-large", 8, 256), ("vit-b16", 64, None)],
    "cpu": [("gpt-tiny", 4, 32), ("bert-tiny", 4, 32), ("vit-tiny", 4, None)],
}
SHARES = (0.5, 0.3)
MiB = 2**20


@dataclass
class Settings:
    device: torch.device
    warmup: int  # plain / peer steps before measuring
    timed: int  # steps timed per row
    parity_steps: int
    max_warm: int = 5  # tierflow: steps at most before the first planned one is done


@dataclass
class Guard:
    """Runs rows until ``limit_s`` would be overrun; skips the rest with a note. A row
    that raises is recorded in ``errors`` (traceback on stderr) and the check goes on."""

    limit_s: float
    estimates: dict[str, float] = field(default_factory=dict)  # seconds a row of a kind takes, until one has run
    start: float = field(default_factory=time.monotonic)
    longest: dict[str, float] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def left(self) -> float:
        return self.limit_s - (time.monotonic() - self.start)

    def run(self, kind: str, label: str, fn: Any) -> Any:
        need, left = self.longest.get(kind, self.estimates.get(kind, 0.0)), self.left()
        if left <= need:
            self.skipped.append(f"{kind} {label}: skipped ({left:.0f} s left, a {kind} row takes {need:.0f} s)")
            return None
        t0 = time.monotonic()
        try:
            return fn()
        except Exception as e:  # one failed row (an OOM, a bug) must not lose the others
            traceback.print_exc()
            self.errors.append(f"{kind} {label}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            return None
        finally:
            self.longest[kind] = max(self.longest.get(kind, 0.0), time.monotonic() - t0)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def release(dev: torch.device) -> None:
    """Between rows: what the last row left is freed and the allocator's peak forgotten."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        # pinned host blocks (tierflow's host pool, save_on_cpu's copies) stay cached by
        # PyTorch's host allocator after they are freed: give them back too
        getattr(torch._C, "_host_emptyCache", lambda: None)()
        torch.cuda.reset_peak_memory_stats(dev)


def build(name: str, dev: torch.device) -> tuple[zoo.Built, torch.optim.Optimizer]:
    m = zoo.build(name, device=dev, seed=0)
    return m, torch.optim.AdamW(m.model.parameters(), lr=1e-3)  # as tierflow.runtime.train


def step(m: zoo.Built, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    """The user's training step, the same for every row."""
    m.loss_fn(m.model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed_steps(m: zoo.Built, opt: torch.optim.Optimizer, x, y, s: Settings) -> dict[str, float]:
    """Median and mean of ``s.timed`` steps, each synchronised on CUDA (the median: a
    step that another process on a shared machine slowed down does not move it)."""
    times = []
    for _ in range(s.timed):
        sync(s.device)
        t0 = time.perf_counter()
        step(m, opt, x, y)
        sync(s.device)
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), "step_mean_s": statistics.fmean(times)}


# -- the peers, put on from outside the zoo model -------------------------------------
def blocks_of(model: nn.Module) -> list[nn.Module]:
    """Transformer blocks (the entries of every ``ModuleList``), else residual stages
    (``Sequential``s held by a ``Sequential``, ResNet's ``layers``)."""
    found = [b for mod in model.modules() if isinstance(mod, nn.ModuleList) for b in mod]
    if not found:
        found = [c for mod in model.modules() if isinstance(mod, nn.Sequential)
                 for c in mod.children() if isinstance(c, nn.Sequential)]
    if not found:
        raise TierflowError(f"{type(model).__name__}: no blocks or stages to checkpoint")
    return found


def with_checkpoint(m: zoo.Built) -> zoo.Built:
    from torch.utils.checkpoint import checkpoint

    for block in blocks_of(m.model):  # an instance attribute shadows the class's forward
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return m


def with_save_on_cpu(m: zoo.Built, dev: torch.device) -> zoo.Built:
    # Pack hooks apply when a tensor is saved (forward and loss); backward unpacks by itself.
    def hooks():
        return torch.autograd.graph.save_on_cpu(pin_memory=dev.type == "cuda")

    forward, loss_fn = m.model.forward, m.loss_fn

    def hooked_forward(*args, **kwargs):
        with hooks():
            return forward(*args, **kwargs)

    def hooked_loss(out, target):
        with hooks():
            return loss_fn(out, target)

    m.model.forward = hooked_forward
    return m._replace(loss_fn=hooked_loss)


@contextlib.contextmanager
def deterministic(dev: torch.device, warned: list[str]):
    """CUDA: deterministic kernels where PyTorch has them (``warn_only``: an op without
    one warns, and its message lands in ``warned``) and the math attention backend (the
    fused ones' backward is not deterministic under ``warn_only``)."""
    if dev.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings(record=True) as caught, sdpa_kernel(SDPBackend.MATH):
            warnings.simplefilter("always")
            try:
                yield
            finally:
                warned.extend(sorted({str(w.message).splitlines()[0][:160] for w in caught
                                      if "determinis" in str(w.message)}))
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


# -- the rows ---------------------------------------------------------------------------
def memory_truth(name: str, batch: int, seq: int | None, s: Settings) -> dict[str, Any]:
    predicted = zoo_trace(name, batch, seq, device=s.device.type).peak_live_bytes
    release(s.device)
    m, opt = build(name, s.device)
    x, y = m.make_batch(batch, seq)
    measured = int(torch_step_peak(m.model, x, y, m.loss_fn, opt, warmup=s.warmup)["peak_bytes"])
    return {"model": name, "batch": batch, "seq": seq, "predicted_peak_bytes": int(predicted),
            "measured_peak_bytes": measured, "ratio": predicted / measured,
            "measured_by": "torch.cuda.max_memory_allocated" if s.device.type == "cuda"
            else "torch.profiler allocator events"}


def parity(name: str, batch: int, seq: int | None, s: Settings, host_bytes: int) -> dict[str, Any]:
    warned: list[str] = []
    try:
        with deterministic(s.device, warned):
            res = train(name, batch=batch, seq=seq, budget="50%", steps=s.parity_steps, device=s.device.type,
                        check_parity=True, host_bytes=host_bytes)
    except BudgetError as e:  # (no schedule fits: a finding, as in tierflow_row; parity untested)
        return {"model": name, "batch": batch, "seq": seq, "steps": 0, "parity": None, "detail": str(e)[:200],
                "policy": "-", "moved_bytes": 0, "error": f"{type(e).__name__}: {e}"}
    st = res.stats
    row = {"model": name, "batch": batch, "seq": seq, "steps": res.steps, "budget_bytes": int(st.budget_bytes),
           "parity": res.parity, "detail": res.parity_detail, "policy": st.policy,
           "planned_steps": st.planned_steps, "moved_bytes": int(sum(st.moved_bytes.values())),
           "host_stepped_params": st.host_stepped_params, "recomputed_ops": st.recomputed_ops,
           "untracked_device_bytes": st.untracked_device_bytes,
           "plan_error": st.plan_error, "deterministic_algorithms": s.device.type == "cuda",
           "nondeterministic_ops": warned}
    del res  # it holds both models
    return row


def peer_row(name: str, batch: int, seq: int | None, config: str, s: Settings) -> dict[str, Any]:
    m, opt = build(name, s.device)
    if config == "checkpoint":
        m = with_checkpoint(m)
    elif config == "save_on_cpu":
        m = with_save_on_cpu(m, s.device)
    x, y = m.make_batch(batch, seq)
    peak = int(torch_step_peak(m.model, x, y, m.loss_fn, opt, warmup=s.warmup)["peak_bytes"])
    return {"model": name, "config": config, "budget_share": None, "budget_bytes": None,
            **timed_steps(m, opt, x, y, s), "peak_bytes": peak,
            "peak_by": "max_memory_allocated" if s.device.type == "cuda" else "profiler"}


def tierflow_row(name: str, batch: int, seq: int | None, share: float | None, ref_peak: int, s: Settings,
                 host_bytes: int) -> dict[str, Any]:
    m, opt = build(name, s.device)
    x, y = m.make_batch(batch, seq)
    budget = None if share is None else int(share * ref_peak)
    row: dict[str, Any] = {"model": name, "config": "tierflow", "budget_share": share, "budget_bytes": budget}
    cuda = s.device.type == "cuda"
    try:
        with tierflow.offload(m.model, opt, budget=budget, policy="tierflow", host_bytes=host_bytes) as run:
            warm = 0  # Adam's first step, the profiled one, then one planned step
            while run.stats.planned_steps < 1 and warm < s.max_warm:
                step(m, opt, x, y)
                warm += 1
            # the warm-up steps' peak (profile, planning's own probe, first planned step),
            # then the timed steps' alone (Run.__enter__ reset the allocator's peak)
            warm_peak = torch.cuda.max_memory_allocated(s.device) if cuda else None
            release(s.device)
            row.update(timed_steps(m, opt, x, y, s))
            timed_peak = torch.cuda.max_memory_allocated(s.device) if cuda else None
    except BudgetError as e:  # below the minimum working set: no schedule fits, a finding, not a failure
        return {**row, "error": f"{type(e).__name__}: {e}"}
    st = run.stats
    # CPU: the runtime's accounted peak; over planned steps (as the CUDA figure is over
    # the timed ones) and over the whole run (the reactive profile steps included)
    row.update(peak_bytes=timed_peak if cuda else st.peak_device_bytes_planned,
               whole_run_peak_bytes=max(warm_peak, timed_peak) if cuda else st.peak_device_bytes,
               peak_by="max_memory_allocated" if cuda else "accounted",
               accounted_peak_bytes=st.peak_device_bytes, accounted_peak_planned_bytes=st.peak_device_bytes_planned,
               cuda_max_allocated=timed_peak, cuda_max_allocated_warmup=warm_peak,
               stats_step_time_s=st.step_time_s, predicted_step_time_s=st.predicted_step_time_s,
               policy=st.policy, plan_error=st.plan_error, warm_steps=warm, planned_steps=st.planned_steps,
               moved_bytes=int(sum(st.moved_bytes.values())), stalls=st.stalls,
               untracked_device_bytes=st.untracked_device_bytes, link_bytes_per_s=dict(st.link_bytes_per_s),
               blocking_waits=dict(st.blocking_waits), unplanned_evictions=st.unplanned_evictions,
               host_stepped_params=st.host_stepped_params, recomputed_ops=st.recomputed_ops,
               **_plan_shape(run))
    return row


def _plan_shape(run: Any) -> dict[str, Any]:
    """What the plan is (reactive hints or planned moves) and what the simulator expected
    of it, next to what the run did (``stalls``: on-demand fetches, measured)."""
    plan, sim = run.plan, run.prediction
    return {"plan_reactive": bool(plan is not None and plan.reactive),
            "plan_moves": len(plan.moves) if plan is not None else 0,
            "predicted_faults": getattr(sim, "faults", None), "predicted_stall_s": getattr(sim, "stall_s", None),
            "stall_s": run.stats.stall_s}


# -- output -----------------------------------------------------------------------------
def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:,.1f}"


def ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:,.2f}"


def print_table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for i, r in enumerate(cells):
        print("  " + "  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))


def share_label(share: float | None) -> str:
    return "none" if share is None else f"{share:.0%}"


def report(out: dict[str, Any]) -> None:
    env = out["environment"]
    print(f"tierflow GPU check on {env['device_name']} ({env['device']}), torch {env['torch']}, "
          f"CUDA {env['cuda']}, {out['wall_s']:.0f} s")
    print_table("1. memory truth: capture's predicted peak vs PyTorch's measured peak (MiB)",
                ["model", "batch", "seq", "predicted", "measured", "ratio"],
                [[r["model"], r["batch"], r["seq"] or "-", mib(r["predicted_peak_bytes"]),
                  mib(r["measured_peak_bytes"]), f"{r['ratio']:.3f}"] for r in out["memory_truth"]])
    print_table("2. parity with plain PyTorch at a 50% budget (losses, gradients, parameters bitwise)",
                ["model", "steps", "policy", "moved MiB", "parity", "detail"],
                [[r["model"], r["steps"], r["policy"], mib(r["moved_bytes"]), r["parity"], r["detail"] or "-"]
                 for r in out["parity"]])
    print_table("3. tierflow's peak under its budget (MiB): timed steps (checked), whole run incl. profiling",
                ["model", "budget", "budget MiB", "peak", "within", "whole run", "within", "untracked", "peak by"],
                [[r["model"], share_label(r["budget_share"]), mib(r["budget_bytes"]), mib(r["peak_bytes"]), r["within"],
                  mib(r["whole_run_peak_bytes"]), r["within_whole_run"], mib(r["untracked_device_bytes"]), r["peak_by"]]
                 for r in out["budget"]])
    rows = []
    for r in out["throughput"]:
        label = r["config"] + ("" if r["config"] != "tierflow" else f" {share_label(r['budget_share'])}")
        if "error" in r:
            rows.append([r["model"], label, "-", "-", "-", "-", "-", r["error"][:60]])
            continue
        fits = [("yes" if r["peak_bytes"] <= b else "no") if (r["budget_share"] is None or r["budget_share"] == sh)
                else "" for sh, b in zip(SHARES, r["fits_budgets_bytes"])]
        rows.append([r["model"], label, ms(r["step_s"]), f"{r['x_plain']:.2f}" if r.get("x_plain") else "-",
                     mib(r["peak_bytes"]), *fits, r["peak_by"]])
    print_table("4. throughput: median step time, peak (MiB) and whether it fits 50% / 30% of the reference peak",
                ["model", "run", "step ms", "x plain", "peak", "fits 50%", "fits 30%", "peak by"], rows)
    print_table("5. tierflow's predicted vs measured step time",
                ["model", "budget", "predicted ms", "measured ms", "predicted/measured"],
                [[r["model"], share_label(r["budget_share"]), ms(r["predicted_step_time_s"]),
                  ms(r["measured_step_time_s"]), f"{r['ratio']:.3f}" if r["ratio"] else "-"]
                 for r in out["prediction"]])
    for note in out["skipped"]:
        print(f"skipped: {note}")
    for note in out["errors"]:
        print(f"error: {note}")
    print("\nall parity exact and every budget kept" if out["ok"] else "\nFAILED: a parity, a budget or a row failed")


def environment(dev: torch.device) -> dict[str, Any]:
    env = {"device": dev.type, "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "machine": platform.machine(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "tierflow": tierflow.__version__, "device_name": platform.processor() or platform.machine()}
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        env.update(device_name=props.name, device_memory_bytes=props.total_memory,
                   cudnn=torch.backends.cudnn.version(), cublas_workspace=os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    return env


def parse_models(text: str) -> list[tuple[str, int, int | None]]:
    """``name[:batch[:seq]]`` separated by commas (zoo defaults for what is left out)."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, *rest = item.split(":")
        spec = zoo.spec(name)
        batch = int(rest[0]) if rest else spec.batch
        out.append((name, batch, int(rest[1]) if len(rest) > 1 else spec.seq))
    return out


def _part_k(args: argparse.Namespace) -> int:
    """Part K (issue 30): benchmarks/compiled.py on HF GPT-2 (124M's shape on CUDA, tiny
    on the CPU dry run): plain compiled, tierflow's compiled plan at 50%, torch's
    ``activation_memory_budget``, compiled ``gradient_checkpointing_enable()`` and
    tierflow at its measured peak (``x_checkpointing``: step time over its); then
    benchmarks/compiled_peers.py on the same model into DIR/compiled_peers_k.json:
    ``enable_activation_offloading`` with every node marked (on CUDA its copies reach
    the host; on the CPU they are no-ops), ``activation_memory_budget`` 0.5, and the
    simulator's prediction of tierflow's compiled arms against their measured step and
    peak (on the H100 preset on CUDA)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import compiled
    import compiled_peers

    cpu = args.device == "cpu"
    os.makedirs(args.out, exist_ok=True)
    quick = ["--quick"] if cpu or args.quick else []
    argv = ["--models", "gpt2" if cpu else "gpt2-small", "--shares", "0.5", "--ambs", "0.5,0.2",
            "--checkpointing", "--no-eager", "--device", args.device, "--steps", "2" if cpu else "5",
            "--json", os.path.join(args.out, "compiled_k.json")]
    code = compiled.main(argv + quick)
    peers = ["--models", "gpt2" if cpu else "gpt2-small", "--shares", "0.5", "--ambs", "0.5",
             "--device", args.device, "--steps", "2" if cpu else "5",
             "--hardware", "cpu" if cpu else "h100-80g-pcie5-nvme", "--threads", "1" if cpu else "0",
             "--json", os.path.join(args.out, "compiled_peers_k.json")]
    return max(code, compiled_peers.main(peers + quick))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="gpu_check.json", help="where to write every row (default gpu_check.json)")
    ap.add_argument("--models", help="name[:batch[:seq]],... (default: three per device; with --out also "
                    "hf-gpt2, the Hugging Face GPT-2 from a config)")
    ap.add_argument("--quick", action="store_true", help="the first model only, fewer steps")
    ap.add_argument("--steps", type=int, help="timed steps per row (default: cuda 8, cpu 5)")
    ap.add_argument("--time-limit", type=float, help="seconds; later rows are skipped, with a note "
                    "(default 480; with --out 470)")
    ap.add_argument("--out", help="run the issue rows (gpu_suite.py) and write gpu_check.json and the "
                    "timelines into this directory")
    ap.add_argument("--traces", type=int, default=4, help="--out: Chrome traces kept (default 4)")
    ap.add_argument("--compile-budgets", help="--out: activation_memory_budget values to sweep "
                    "(default cuda 1,0.5,0.3,0.1; cpu 1,0.3)")
    ap.add_argument("--compile-backend", help="--out: torch.compile backend (default cuda inductor, "
                    "cpu aot_eager_decomp_partition)")
    ap.add_argument("--no-compile", action="store_true", help="--out: no torch.compile rows")
    ap.add_argument("--no-trainer", action="store_true", help="--out: no Trainer row")
    ap.add_argument("--parts", default="ABCS", help="--out: which parts of each model's rows (A: peers and "
                    "tierflow at the checkpointing peak, 50%%, 30%%; B: parity, Trainer; C: the rest; S: a GPT-2 "
                    "whose weights and AdamW state are over twice the budget, after A; K: HF GPT-2 compiled, tierflow's "
                    "compiled plan at the peak of compiled gradient_checkpointing_enable() and beside "
                    "activation_memory_budget, benchmarks/compiled.py, into DIR/compiled_k.json; default ABCS)")
    args = ap.parse_args(argv)
    if args.out and "K" in args.parts.upper():
        code = _part_k(args)
        args.parts = args.parts.upper().replace("K", "")
        if not args.parts:
            return code
    if args.out:
        if args.device == "cuda" and not torch.cuda.is_available():
            ap.error("--device cuda: CUDA is not available")
        args.time_limit = 470.0 if args.time_limit is None else args.time_limit
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import gpu_suite

        return gpu_suite.run_suite(args)
    args.time_limit = 480.0 if args.time_limit is None else args.time_limit
    dev = torch.device(args.device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            ap.error("--device cuda: CUDA is not available")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: deterministic matmul
        dev = torch.device("cuda", torch.cuda.current_device())
    cuda = dev.type == "cuda"
    s = Settings(dev, warmup=2, timed=args.steps or (8 if cuda else 5), parity_steps=4)
    models = parse_models(args.models) if args.models else MODELS[dev.type]
    if args.quick:
        models, s.timed = models[:1], min(s.timed, 4 if cuda else 2)
    guard, t0 = Guard(args.time_limit), time.perf_counter()
    truth, par, runs = [], [], []

    for name, batch, seq in models:  # 1: also the reference peak of sections 3-4
        row = guard.run("memory_truth", name, functools.partial(memory_truth, name, batch, seq, s))
        release(dev)
        if row is not None:
            truth.append(row)
    ref = {r["model"]: r["measured_peak_bytes"] for r in truth}
    # tierflow's pinned host pool: room for the whole peak twice (the default, sized from
    # the model state, pins several times more and takes seconds to allocate)
    host = {n: 2 * p + 64 * MiB for n, p in ref.items()}
    for name, batch, seq in models:  # 2
        if name in ref and (row := guard.run("parity", name, functools.partial(parity, name, batch, seq, s, host[name]))):
            par.append(row)
        release(dev)
    for name, batch, seq in models:  # 4 (and 3, 5)
        if name not in ref:
            continue
        for config in ("plain", "checkpoint", "save_on_cpu"):
            if row := guard.run("peer", f"{name} {config}", functools.partial(peer_row, name, batch, seq, config, s)):
                runs.append(row)
            release(dev)
        for share in (None, *SHARES):
            if row := guard.run("tierflow", f"{name} {share_label(share)}",
                                functools.partial(tierflow_row, name, batch, seq, share, ref[name], s, host[name])):
                runs.append(row)
            release(dev)

    plain = {r["model"]: r["step_s"] for r in runs if r["config"] == "plain"}
    for r in runs:
        r["fits_budgets_bytes"] = [int(sh * ref[r["model"]]) for sh in SHARES]
        if "step_s" in r and r["model"] in plain:
            r["x_plain"] = r["step_s"] / plain[r["model"]]
    tf = [r for r in runs if r["config"] == "tierflow" and "error" not in r]
    budget = [{k: r[k] for k in ("model", "budget_share", "budget_bytes", "peak_bytes", "peak_by", "whole_run_peak_bytes",
                                 "accounted_peak_bytes", "accounted_peak_planned_bytes", "cuda_max_allocated",
                                 "cuda_max_allocated_warmup", "untracked_device_bytes")}
              | {"within": r["peak_bytes"] <= r["budget_bytes"],
                 "within_whole_run": r["whole_run_peak_bytes"] <= r["budget_bytes"]}
              for r in tf if r["budget_bytes"] is not None]
    prediction = [{"model": r["model"], "budget_share": r["budget_share"],
                   "predicted_step_time_s": r["predicted_step_time_s"], "measured_step_time_s": r["stats_step_time_s"],
                   "ratio": (r["predicted_step_time_s"] / r["stats_step_time_s"])
                   if r["predicted_step_time_s"] and r["stats_step_time_s"] else None} for r in tf]
    # (a parity row whose budget no schedule fits tested nothing: not ok, though no row failed)
    ok = bool(par) and all(r["parity"] for r in par) and all(r["within"] for r in budget) and not guard.errors
    out = {"environment": environment(dev), "settings": {"models": models, "shares": SHARES, "timed_steps": s.timed,
           "warmup": s.warmup, "parity_steps": s.parity_steps, "time_limit_s": args.time_limit},
           "memory_truth": truth, "parity": par, "budget": budget, "throughput": runs, "prediction": prediction,
           "skipped": guard.skipped, "errors": guard.errors, "wall_s": time.perf_counter() - t0, "ok": ok}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    report(out)
    print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
