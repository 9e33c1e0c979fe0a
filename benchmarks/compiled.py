"""Compiled models under tierflow's compiled front-end (issue 30), against the same
compiled model without tierflow, ``torch.compile``'s ``activation_memory_budget`` and
the eager runtime at the same budget.

For each model (a gated MLP of our own, and Hugging Face GPT-2 from a config when
``transformers`` is installed) it trains, from one seeded initialisation, one copy per
arm, with inductor:

* ``plain``: ``torch.compile(model)`` (counted by :class:`tierflow.compiled.CallCounter`);
* ``tierflow S``: ``tierflow.compiled.compile(model, budget=S)`` for each share S;
* ``amb B``: ``torch.compile(model)`` compiled under
  ``torch._functorch.config.activation_memory_budget = B`` (torch's recompute knapsack);
* ``eager runtime``: the uncompiled model under ``tierflow.offload`` with a byte budget
  of S times the plain compiled step's measured peak (its peak: the runtime's own
  accounting over planned steps).

Each compiled arm runs ``--warmup`` steps and one step under ``torch.profiler`` (its
allocator peak, bytes above the step's start: the sum of allocation events' sizes at
its highest), then the arms' ``--steps`` timed steps run interleaved, one step of each
in turn (each arm's model has a forward code object of its own: :func:`own_code`). Losses and final parameters of every tierflow arm are
compared with ``torch.equal`` to plain's. The budget of ``tierflow S`` is S times
plain's measured peak; ``within`` says whether the arm's measured peak is at most that.

    PYTHONPATH=src python benchmarks/compiled.py --models mlp,gpt2 --shares 0.5,0.3 --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import tierflow
import tierflow.compiled as tc


class GatedMLP(nn.Module):
    """Pre-norm residual blocks of a SwiGLU-style gated MLP."""

    def __init__(self, d: int, h: int, n: int, graph_break: bool = False) -> None:
        super().__init__()
        self.graph_break = graph_break
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"ln": nn.LayerNorm(d), "g": nn.Linear(d, h), "u": nn.Linear(d, h), "o": nn.Linear(h, d)})
            for _ in range(n)
        )
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = len(self.blocks) // 2
        x = self.run_blocks(x, self.blocks[:half])
        if self.graph_break:  # outside the loops: Dynamo skips a frame that breaks inside one
            torch._dynamo.graph_break()
        x = self.run_blocks(x, self.blocks[half:])
        return self.head(x).float().pow(2).mean()

    @staticmethod
    def run_blocks(x: torch.Tensor, blocks: nn.ModuleList) -> torch.Tensor:
        for b in blocks:
            y = b["ln"](x)
            x = x + b["o"](nn.functional.silu(b["g"](y)) * b["u"](y))
        return x


@dataclass
class Workload:
    name: str
    model: nn.Module
    batch: Callable[[int], Any]  # step -> inputs
    loss: Callable[[Callable[..., Any], Any], torch.Tensor]  # (callable model, inputs) -> loss
    note: str = ""
    compile_kwargs: dict[str, Any] = field(default_factory=dict)


def workload(name: str, device: torch.device, quick: bool) -> Workload:
    torch.manual_seed(0)
    if name in ("mlp", "mlp-break", "mlp-dynamic"):
        d, h, n, b, s = (128, 512, 4, 4, 128) if quick else (256, 1024, 6, 8, 256)
        model = GatedMLP(d, h, n, graph_break=name == "mlp-break").to(device)
        # mlp-dynamic: the sequence length changes every step (3 lengths, compiled dynamic=True)
        seqs = (s, s + s // 4, s + s // 2) if name == "mlp-dynamic" else (s,)

        def batch(i: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(100 + i)
            return torch.randn(b, seqs[i % len(seqs)], d, generator=g).to(device)

        what = {"mlp": "", "mlp-break": ", a graph break after half the blocks",
                "mlp-dynamic": f", dynamic=True, seq cycling {seqs} (peak at {seqs[2 % len(seqs)]})"}[name]
        return Workload(f"gated-mlp d{d} h{h} x{n}, batch {b}x{s}{what}", model, batch, lambda f, x: f(x),
                        compile_kwargs={"dynamic": True} if name == "mlp-dynamic" else {})
    if name in ("gpt2", "gpt2-small", "gpt2-8l"):
        from transformers import GPT2Config, GPT2LMHeadModel

        layers, width, b, s = (2, 128, 2, 128) if quick else (4, 256, 8, 256)
        if name == "gpt2-small" and not quick:  # GPT-2 124M's shape (the GPU rows)
            layers, width, b, s = 12, 768, 8, 1024
        if name == "gpt2-8l" and not quick:  # deeper: the layers, not the loss, make the peak
            layers, width, b, s = 8, 256, 4, 256
        cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=4 if width < 768 else 12, n_positions=s,
                         vocab_size=50257 if name == "gpt2-small" else 2048,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
        model = GPT2LMHeadModel(cfg).to(device)

        def batch(i: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(100 + i)
            return torch.randint(0, cfg.vocab_size, (b, s), generator=g).to(device)

        return Workload(f"HF GPT-2 {layers}L w{width}, batch {b}x{s} (from a config, dropout 0)", model, batch,
                        lambda f, ids: f(input_ids=ids, labels=ids).loss)
    raise SystemExit(f"unknown model {name!r} (mlp, mlp-break, mlp-dynamic, gpt2, gpt2-8l, gpt2-small)")


def allocator_peak(step: Callable[[], Any], device: torch.device | None = None,
                   breakdown: Callable[[str], None] | None = None) -> int:
    """Highest bytes above the step's start: on CUDA ``max_memory_allocated`` over the
    bytes allocated at the start; on the CPU from the allocator's events under
    ``torch.profiler``. ``breakdown`` (CPU only) receives the text of
    :func:`peak_breakdown.format_breakdown`: what is live at that peak."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - start)
    from torch.profiler import ProfilerActivity, profile

    from tierflow.capture.check import _allocations

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    cur = peak = 0
    for _, delta in sorted(_allocations(prof.profiler.kineto_results.experimental_event_tree())):
        cur += delta
        peak = max(peak, cur)
    if breakdown is not None:
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).parent))  # a script beside this one
        from peak_breakdown import format_breakdown, peak_breakdown

        breakdown(format_breakdown(peak_breakdown(prof), min_bytes=1 << 20))
    return int(peak)


@dataclass
class Arm:
    name: str
    model: nn.Module
    fn: Callable[..., Any]
    opt: torch.optim.Optimizer
    handle: Any = None
    first_call: Callable[[], Any] | None = None  # a context for the compiling call
    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    peak: int = 0
    compile_s: float = 0.0

    def step(self, w: Workload, i: int) -> None:
        x = w.batch(i)
        loss = w.loss(self.fn, x)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.losses.append(loss.item())


_ARMS = iter(range(1, 1 << 30))


def own_code(m: nn.Module) -> nn.Module:
    """``m`` as an instance of a subclass whose ``forward`` has a code object of its own.

    Dynamo keeps compiled graphs per code object, with guards that copies of one model
    class all pass (parameters are graph inputs): copies compiled differently would run
    each other's graphs. A code object per arm keeps each arm's graphs its own."""
    k = next(_ARMS)
    cls = type(m)
    fwd = cls.forward
    code = fwd.__code__.replace(co_name=f"forward_arm{k}")
    new_fwd = type(fwd)(code, fwd.__globals__, f"forward_arm{k}", fwd.__defaults__, fwd.__closure__)
    new_fwd.__kwdefaults__ = fwd.__kwdefaults__
    m.__class__ = type(f"{cls.__name__}Arm{k}", (cls,), {"forward": new_fwd})
    return m


def fresh(w: Workload) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A copy of the workload's model with its own forward code (:func:`own_code`) and
    its optimizer."""
    m = own_code(copy.deepcopy(w.model))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)


def make_arms(w: Workload, shares: list[float | None], ambs: list[float], headroom: float = 0.1) -> list[Callable[[], Arm]]:
    """One maker per arm (each model copy with its own forward code: :func:`own_code`);
    a share of ``None`` is tierflow planning nothing."""

    def plain() -> Arm:
        m, o = fresh(w)
        counter = tc.CallCounter("inductor")
        return Arm("plain", m, torch.compile(m, backend=counter, **w.compile_kwargs), o, counter)

    def tierflow_arm(s: float | None) -> Arm:
        m, o = fresh(w)
        run = tc.compile(m, budget=s, backend="inductor", headroom=headroom, **w.compile_kwargs)
        return Arm(f"tierflow {'none' if s is None else f'{s:.0%}'}", m, run.model, o, run)

    def amb(b: float) -> Arm:
        m, o = fresh(w)
        counter = tc.CallCounter("inductor")
        arm = Arm(f"amb {b}", m, torch.compile(m, backend=counter, **w.compile_kwargs), o, counter)
        arm.first_call = lambda: torch._functorch.config.patch(activation_memory_budget=b)
        return arm

    return [plain] + [lambda s=s: tierflow_arm(s) for s in shares] + [lambda b=b: amb(b) for b in ambs]


def gc_arms(w: Workload, peak_of_gc: Callable[[], int]) -> list[Callable[[], Arm]]:
    """HF's ``gradient_checkpointing_enable()`` compiled, then tierflow's compiled plan
    with that arm's measured peak as its byte budget."""

    def gc() -> Arm:
        m = own_code(copy.deepcopy(w.model))
        m.gradient_checkpointing_enable()
        counter = tc.CallCounter("inductor")
        return Arm("gradient_checkpointing", m, torch.compile(m, backend=counter),
                   torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False), counter)

    def at_gc() -> Arm:
        m = own_code(copy.deepcopy(w.model))
        run = tc.compile(m, budget=peak_of_gc(), backend="inductor")
        return Arm("tierflow @ checkpointing peak", m, run.model,
                   torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False), run)

    return [gc, at_gc]


def prepare_arm(make: Callable[[], Arm], w: Workload, args: argparse.Namespace) -> Arm:
    """Build the arm, run its warm-up (compiling) steps and one profiled step."""
    a = make()
    t0 = time.perf_counter()
    for i in range(args.warmup):
        if a.first_call is not None:
            with a.first_call():
                a.step(w, i)
            a.first_call = None
        else:
            a.step(w, i)
    a.compile_s = time.perf_counter() - t0
    show = None
    if getattr(args, "breakdown", False) and not a.name.startswith("amb"):
        lines: list[str] = []
        show = lines.append
    a.peak = allocator_peak(lambda: a.step(w, args.warmup), next(a.model.parameters()).device, show)
    print(f"  {a.name}: first steps {a.compile_s:.1f} s, peak {a.peak / 2**20:.1f} MiB", flush=True)
    if show is not None:
        print("\n".join("    " + line for line in lines[0].splitlines()), flush=True)
    return a


def timed_round(arms: list[Arm], w: Workload, i: int) -> None:
    """One timed step of every arm, in turn (load changes hit all arms alike)."""
    for a in arms:
        cuda = next(a.model.parameters()).device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a.step(w, i)
        if cuda:
            torch.cuda.synchronize()
        a.times.append(time.perf_counter() - t0)


def run_model(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    w = workload(name, device, args.quick)
    shares = [float(s) for s in args.shares.split(",")]
    ambs = [float(b) for b in args.ambs.split(",")] if args.ambs else []
    torch._dynamo.reset()
    arms = [prepare_arm(make, w, args) for make in make_arms(w, shares, ambs, args.headroom)]
    if args.checkpointing and name.startswith("gpt2"):
        for make in gc_arms(w, lambda: arms[-1].peak):
            arms.append(prepare_arm(make, w, args))
    for k in range(args.steps):
        timed_round(arms, w, args.warmup + 1 + k)
    plain = arms[0]
    rows = []
    for a in arms:
        calls = a.handle.calls if a.handle is not None else None
        row: dict[str, Any] = {
            "arm": a.name, "peak_bytes": a.peak, "peak_over_plain": a.peak / plain.peak,
            "step_s": statistics.median(a.times), "x_plain": statistics.median(a.times) / statistics.median(plain.times),
            "compiled_calls": calls, "plain_calls": plain.handle.calls,
            "graphs_compiled": getattr(a.handle, "compiles", getattr(a.handle, "graphs", None)),
            "recompiles": recompiles(a.handle),
            "first_steps_s": round(a.compile_s, 2),
        }
        if a.name.startswith("tierflow"):
            if a.name.endswith("checkpointing peak"):
                budget = next(b.peak for b in arms if b.name == "gradient_checkpointing")
                row["x_checkpointing"] = statistics.median(a.times) / statistics.median(
                    next(b.times for b in arms if b.name == "gradient_checkpointing"))
            else:
                budget = float(a.name.split()[1].rstrip("%")) / 100 * plain.peak
            row.update({
                "budget_bytes": int(budget), "within": a.peak <= budget,
                "bitwise_losses": a.losses == plain.losses,
                "bitwise_params": all(torch.equal(p, q) for p, q in zip(a.model.parameters(), plain.model.parameters(),
                                                                        strict=True)),
                "graphs": a.handle.stats.compiled_graphs,
            })
        rows.append(row)
    if args.eager:
        for s in shares:
            m = copy.deepcopy(w.model)
            o = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)
            arm = Arm(f"eager runtime {s:.0%}", m, m, o)
            budget = int(s * plain.peak)
            with tierflow.offload(m, o, budget=budget) as run:
                for j in range(args.warmup + 2 + args.steps):
                    t0 = time.perf_counter()
                    arm.step(w, j)
                    arm.times.append(time.perf_counter() - t0)
            t = statistics.median(arm.times[-args.steps:])
            rows.append({"arm": arm.name, "budget_bytes": budget, "step_s": t,
                         "x_plain": t / statistics.median(plain.times),
                         "peak_bytes": run.stats.peak_device_bytes_planned,
                         "peak_source": "runtime's accounting (planned steps)",
                         "sequential": True})
    return {"model": w.name, "rows": rows}


def recompiles(handle: Any) -> int | None:
    """Graphs that recompiled a frame Dynamo compiled before (its compile ids)."""
    if isinstance(handle, tc.CallCounter):
        return handle.recompiles
    if isinstance(handle, tc.CompiledOffload):
        return sum(1 for g in handle.graphs if g.recompile)
    return None


def print_rows(res: dict[str, Any]) -> None:
    print(f"\n{res['model']}")
    print("| arm | peak MiB | x plain peak | budget MiB | within | step s | x plain | calls (plain) | graphs | bitwise |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        bud = f"{r['budget_bytes'] / 2**20:.1f}" if "budget_bytes" in r else ""
        bit = ""
        if "bitwise_losses" in r:
            bit = "yes" if r["bitwise_losses"] and r["bitwise_params"] else "NO"
        calls = f"{r.get('compiled_calls')} ({r.get('plain_calls')})" if r.get("compiled_calls") is not None else ""
        within = {True: "yes", False: "NO"}.get(r.get("within"), "")
        over = f"{r['peak_over_plain']:.2f}" if "peak_over_plain" in r else ""
        print(f"| {r['arm']} | {r['peak_bytes'] / 2**20:.1f} | {over} | {bud} | {within} | {r['step_s']:.3f} | "
              f"{r['x_plain']:.2f} | {calls} | {r.get('graphs_compiled', '')}{_re(r)} | {bit} |")
        for g in r.get("graphs", []):
            print(f"|  graph {g['index']}: saved {g['saved']} ({g['saved_bytes'] / 2**20:.1f} MiB), kept {g['kept']}, "
                  f"offloaded {g['offloaded']} ({g['offloaded_bytes'] / 2**20:.1f} MiB), recomputed {g['recomputed']}; "
                  f"trace peak {g['predicted_peak_bytes'] / 2**20:.1f} -> {g['predicted_peak_bytes_planned'] / 2**20:.1f} MiB"
                  " | | | | | | | | | |")


def _re(row: dict[str, Any]) -> str:
    n = row.get("recompiles")
    return "" if n is None else f" ({n} recompiles)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp,gpt2")
    ap.add_argument("--shares", default="0.5,0.3")
    ap.add_argument("--ambs", default="0.5,0.2,0.05", help="activation_memory_budget values ('' for none)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--headroom", type=float, default=0.1, help="tierflow.compiled.compile's headroom")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-eager", dest="eager", action="store_false")
    ap.add_argument("--checkpointing", action="store_true",
                    help="gpt2: also HF gradient_checkpointing_enable() compiled, and tierflow at its peak")
    ap.add_argument("--quick", action="store_true", help="small models (the CPU dry run)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared, loaded CPU, more threads than free cores "
                    "makes inductor's OpenMP kernels wait on each other, and step times swing by 5x)")
    ap.add_argument("--breakdown", action="store_true",
                    help="print what is live at each plain/tierflow arm's allocator peak (benchmarks/peak_breakdown.py)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64
    return run_models(args, run_model, print_rows)


def run_models(args: argparse.Namespace, run: Callable[..., dict[str, Any]],
               show: Callable[[dict[str, Any]], None]) -> int:
    """Each of ``args.models`` through ``run``, its rows printed by ``show``; the JSON of
    all of them into ``args.json``."""
    device = torch.device(args.device)
    out = {"torch": torch.__version__, "device": str(device), "results": []}
    for name in args.models.split(","):
        print(f"{name}:", flush=True)
        res = run(name, args, device)
        show(res)
        out["results"].append(res)
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
