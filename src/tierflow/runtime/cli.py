"""``tierflow train``: train a zoo model under a device budget with the runtime.

Example::

    tierflow train --model gpt-tiny --batch 4 --budget 50% --steps 8 --ssd-dir /tmp --check-parity
    tierflow train --model gpt-tiny --budget 50% --steps 20 --check-parity --nproc 2 --strategy fsdp
    torchrun --nproc-per-node 2 -m tierflow.cli train --model gpt-tiny --strategy ddp --check-parity

Under ``torch.distributed`` (``--nproc N``, or started by torchrun: ``RANK``,
``WORLD_SIZE`` and ``MASTER_ADDR`` set) every rank trains its slice of the batch under
its own ``tierflow.offload``; rank 0 prints one row per rank.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys

from .. import _cli_util as u
from ..units import fmt_bytes, fmt_seconds


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a zoo model within a device budget (profile, plan, execute)",
        description="Train a built-in model for a few steps under tierflow.offload: the first iteration is "
        "profiled, a policy plans, later iterations follow the plan; prints measured vs predicted.",
    )
    p.add_argument("--model", required=True, help="zoo model name (see 'tierflow capture --list')")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: the model's)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (transformers)")
    p.add_argument("--budget", default=None,
                   help="device budget: bytes (4GiB) or a share of the unconstrained peak (30%%); default none")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps (default 8)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="compute device (default cpu)")
    p.add_argument("--policy", default="tierflow", help="policy (default tierflow; see 'tierflow policies')")
    p.add_argument("--set", dest="options", action="append", default=[], metavar="KEY=VALUE",
                   help="a policy option, e.g. --set min_bytes=4096 (repeatable; 'tierflow policies' lists them)")
    p.add_argument("--ssd-dir", default=None, help="directory for the SSD tier's file (default: no SSD tier)")
    p.add_argument("--check-parity", action="store_true",
                   help="also train without tierflow and compare losses, gradients, parameters bitwise")
    p.add_argument("--optimizer", choices=("adamw", "adamw-foreach", "adamw-fused", "sgd", "sgd-foreach"),
                   default="adamw", help="torch's default implementation, or a multi-tensor one (default adamw)")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="train on N local processes under torch.distributed (gloo on CPU, nccl on CUDA), "
                   "one tierflow.offload per rank; --batch is then per rank (as 'torchrun --nproc-per-node N "
                   "-m tierflow.cli train ...')")
    p.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp",
                   help="with --nproc or torchrun: DistributedDataParallel, or FSDP2 (fully_shard per block)")
    p.add_argument("--host-steps", choices=("auto", "yes", "no"), default="auto",
                   help="may the plan run optimizer updates on the host? auto (default): on CPU yes, on CUDA "
                   "only for policies built on them (the host's kernels can round differently from the GPU's)")
    p.add_argument("--follow", choices=("ops", "hooks"), default="ops",
                   help="how planned steps are followed: ops (default: every op through the runtime) or hooks "
                   "(at module, saved-tensor and gradient hooks, no per-op Python; see docs/runtime.md)")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, choices=("inductor", "aot_eager"),
                   help="torch.compile the model (inductor unless named) and carry the plan inside its graphs "
                   "(tierflow.compiled; --budget is then a share of each graph's own peak, or bytes); prints what "
                   "each graph kept and offloaded (see docs/compiled.md)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--report", default=None, metavar="HTML",
                   help="also write the HTML report of the followed plan, measured beside predicted")
    p.set_defaults(func=_train)


_HOST_STEPS = {"auto": None, "yes": True, "no": False}


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _child_argv(args: argparse.Namespace) -> list[str]:
    """The ``tierflow train`` command line of one rank: these arguments less ``--nproc``."""
    argv = ["train", "--model", args.model, "--steps", str(args.steps), "--device", args.device,
            "--policy", args.policy, "--optimizer", args.optimizer, "--strategy", args.strategy,
            "--host-steps", args.host_steps, "--follow", args.follow]
    for flag, v in (("--batch", args.batch), ("--seq", args.seq), ("--budget", args.budget),
                    ("--ssd-dir", args.ssd_dir), ("--report", args.report)):
        if v is not None:
            argv += [flag, str(v)]
    for item in args.options:
        argv += ["--set", item]
    argv += ["--check-parity"] * bool(args.check_parity) + ["--json"] * bool(args.json)
    return argv


def _policy_options(args: argparse.Namespace) -> dict:
    """``--set`` items, checked against the policy's declared options."""
    from ..policies import options_from_settings

    return options_from_settings([args.policy], args.options)[args.policy]


def _step_bar(update):
    """``train``'s progress callback drawing on the bar ``update`` (see u.progress)."""
    def on_step(what: str, done: int, steps: int, step_s: float, moved: int) -> None:
        base = 0 if what == "plain" else steps
        label = ("plain PyTorch (parity)" if what == "plain" else "tierflow") + f": step {done}/{steps}"
        label += f", {fmt_seconds(step_s)}" + (f", moved {fmt_bytes(moved)}" if what != "plain" else "")
        update(base + done, description=label)
    return on_step


def _train(args: argparse.Namespace) -> int:
    from ..errors import TierflowError
    from .training import train

    if args.steps < 1:
        raise TierflowError(f"--steps must be >= 1, got {args.steps}")
    if getattr(args, "compile", None):
        return _train_compiled(args)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise TierflowError("--device cuda: CUDA is not available on this machine")
    policy_options = _policy_options(args)  # a bad option fails before any rank starts
    if args.nproc is not None and not _under_torchrun():
        return _launch(args)
    if _under_torchrun():
        return _train_rank(args, policy_options)
    total = args.steps * (2 if args.check_parity else 1)
    with u.progress(f"training {args.model}", total, enabled=not args.json) as update:
        res = train(args.model, batch=args.batch, budget=args.budget, steps=args.steps, device=args.device,
                    policy=args.policy, ssd_dir=args.ssd_dir, check_parity=args.check_parity, seq=args.seq,
                    optimizer=args.optimizer, policy_options=policy_options, host_steps=_HOST_STEPS[args.host_steps],
                    follow=args.follow, progress=_step_bar(lambda done, description: update(
                        done - (0 if args.check_parity else args.steps), description=description)))
    if args.report:
        _write_report(args.report, res)
    if args.json:
        u.print_json(res.to_dict())
        return 0 if res.parity is not False else 1
    s = res.stats
    con = u.console()
    from rich.table import Table

    t = Table(title=f"tierflow train: {res.model} (batch {res.batch}) on {res.device}, policy {s.policy}")
    t.add_column("")
    t.add_column("value", justify="right")
    budget = "none" if not math.isfinite(s.budget_bytes) else fmt_bytes(s.budget_bytes)
    rows = [
        ("steps (profiled / planned / fell back)", f"{s.steps} ({s.profiled_steps} / {s.planned_steps} / {s.reactive_steps})"),
        ("planned steps followed", "at ticks (hooks)" if s.follow == "hooks" else f"op by op{s.follow[3:]}"),
        ("step time, measured", fmt_seconds(s.step_time_s)),
        ("step time, predicted (simulator)", fmt_seconds(s.predicted_step_time_s) if s.predicted_step_time_s else "n/a"),
        *([("  predicted at the plan, before its first step", fmt_seconds(s.predicted_step_time_s_at_plan))]
          if s.predicted_step_time_s_at_plan and s.predicted_step_time_s_at_plan != s.predicted_step_time_s else []),
        ("step time, trace ideal", fmt_seconds(s.ideal_step_time_s) if s.ideal_step_time_s else "n/a"),
        ("step time, plain PyTorch", fmt_seconds(res.plain_step_time_s) if res.plain_step_time_s else "not run"),
        ("peak device bytes / budget", f"{fmt_bytes(s.peak_device_bytes)} / {budget}"),
        ("moved to/from host", fmt_bytes(s.moved_bytes.get("host", 0))),
        ("moved to/from ssd", fmt_bytes(s.moved_bytes.get("ssd", 0))),
        ("stalls (on-demand fetches)", f"{s.stalls} ({fmt_seconds(s.stall_s)})"),
        ("planned moves / unplanned evictions", f"{s.planned_moves} / {s.unplanned_evictions}"),
        ("stale plans / plans made", f"{s.stale_plans} / {s.replans}"),
        *_plan_count_rows(s),
    ]
    for reason, n in sorted(s.departures.items(), key=lambda kv: -kv[1])[:4]:  # where it left the plan
        rows.append((f"left the plan: {reason}", str(n)))
    if s.host_steps:
        rows.append(("host optimizer steps (params, updates)",
                     f"{s.host_stepped_params}, {s.host_steps}: {fmt_seconds(s.host_step_s)} on the host, "
                     f"{fmt_seconds(s.host_step_wait_s)} waited"))
    rows += [
        ("parity with plain PyTorch", "not checked" if res.parity is None else
         ("bitwise equal" if res.parity else f"DIFFERS: {res.parity_detail}")),
    ]
    for k, v in rows:
        t.add_row(k, v)
    con.print(t)
    return 0 if res.parity is not False else 1


def plans_summary(s) -> str:
    """How many plans a run made and why, in words: ``"3 plans made (first 1, new
    signature 2)"``.

    Args:
        s: the run's :class:`~tierflow.runtime.stats.RunStats`.

    Example:
        >>> from tierflow.runtime.stats import RunStats
        >>> plans_summary(RunStats(replans=1, plans_by_reason={"first": 1}))
        '1 plan made (first 1)'
    """
    why = ", ".join(f"{k} {v}" for k, v in s.plans_by_reason.items())
    return f"{s.replans} plan{'' if s.replans == 1 else 's'} made" + (f" ({why})" if why else "")


def _plan_count_rows(s) -> list[tuple[str, str]]:
    """The rows of ``tierflow train``'s table on plans per signature and the work
    between iterations (runtime/signatures.py, runtime/outside.py)."""
    rows = [("plans made, by why", plans_summary(s))]
    if s.signature_hits or s.signatures_cached > 1 or s.reactive_signature_steps:
        rows.append(("signatures: cached / hits / evicted / run on the pager",
                     f"{s.signatures_cached} / {s.signature_hits} / {s.signatures_evicted} / "
                     f"{s.reactive_signature_steps}"))
    if s.outside_forwards:
        rows.append(("forwards outside training (validation)", str(s.outside_forwards)))
    if s.checkpoint_copies:
        rows.append(("state dict copies of away tensors", str(s.checkpoint_copies)))
    return rows


def _train_compiled(args: argparse.Namespace) -> int:
    """``tierflow train --compile``: the zoo model compiled through
    :func:`tierflow.compiled.compile`, trained for ``--steps`` steps, and what each
    compiled graph's plan kept and offloaded."""
    import time

    import torch

    import tierflow.compiled as tc

    from ..capture import zoo
    from ..errors import TierflowError
    from .training import OPTIMIZERS

    if args.device == "cuda" and not torch.cuda.is_available():
        raise TierflowError("--device cuda: CUDA is not available on this machine")
    if args.nproc is not None or args.check_parity or args.report:
        raise TierflowError("--compile runs one process without --check-parity or --report")
    spec = zoo.spec(args.model)
    m = zoo.build(args.model, device=args.device, seed=0)
    opt = OPTIMIZERS[args.optimizer](list(m.model.parameters()))
    x, y = m.make_batch(spec.batch if args.batch is None else args.batch, args.seq if spec.seq is not None else None)
    try:
        run = tc.compile(m.model, budget=args.budget, backend=args.compile, optimizer=opt)
    except ValueError as e:
        raise TierflowError(str(e)) from None
    losses = []
    with run:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            loss = m.loss_fn(run.model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            run.record_step(time.perf_counter() - t0)
    st = run.stats
    if args.json:
        u.print_json({"model": args.model, "losses": losses, "stats": st.to_dict()})
        return 0
    from rich.table import Table

    t = Table(title=f"tierflow train --compile {args.compile}: {args.model} on {args.device}, "
              f"budget {args.budget or 'none'}")
    # (trace peak and planned peak: one basis, the graph's own ops on its partition's
    # trace; the plan's curve, which the target is set on, adds estimates: its own column)
    for col in ("graph", "calls", "saved", "kept", "offloaded", "recomputed", "grads moved", "trace peak",
                "planned peak", "plan curve / target", "predicted step"):
        t.add_column(col, justify="right")
    for g in st.compiled_graphs:
        t.add_row(str(g["index"]), str(g["calls"]), f"{g['saved']} ({fmt_bytes(g['saved_bytes'])})", str(g["kept"]),
                  f"{g['offloaded']} ({fmt_bytes(g['offloaded_bytes'])})", str(g["recomputed"]),
                  f"{g.get('grads_offloaded', 0)} ({fmt_bytes(g.get('grads_offloaded_bytes', 0))})",
                  fmt_bytes(g["predicted_peak_bytes"]), fmt_bytes(g["predicted_peak_bytes_planned"]),
                  "none" if g["target_bytes"] is None else f"{fmt_bytes(g.get('plan_peak_bytes', 0))} / "
                  f"{fmt_bytes(g['target_bytes'])}" + (" (not reached)" if g["unreachable"] else ""),
                  "" if g.get("predicted_step_s") is None else fmt_seconds(g["predicted_step_s"]))
    con = u.console()
    con.print(t)
    for g in st.compiled_graphs:  # (said as a warning when compiled; again beside the table)
        if g.get("floor_above_budget"):
            con.print(f"graph {g['index']}: floor {fmt_bytes(g['floor_bytes'])} ({g['floor_op']}) is above the "
                      f"budget {fmt_bytes(g['budget_bytes'])}: no plan of it fits")
    con.print(f"steps {st.steps}, median step {fmt_seconds(st.step_time_s)} (after the first, which compiles); "
              f"compiled calls {st.compiled_calls}, graphs compiled {st.compiled_compiles} "
              f"({sum(1 for g in st.compiled_graphs if g.get('frame_compile', -1) > 0)} recompiles), "
              f"offloads {st.compiled_offloads}; last loss {losses[-1]:.4f}")
    return 0


def _write_report(path: str, res) -> None:
    """The report of the plan the run followed: the simulator's prediction and, beside
    it, the measured step time and device peak."""
    from ..errors import TierflowError
    from ..report import Measured, write_report

    run = res.run
    if run is None or run.trace is None or run.prediction is None:
        raise TierflowError("--report: the run made no plan to report on (it never profiled an iteration)")
    s = res.stats
    per = max(1, s.planned_steps)  # the levers act in the iterations that follow the plan
    measured = {run.prediction.policy: Measured(
        time_s=s.step_time_s, peak_bytes={run.hardware.device: int(s.peak_device_bytes)},
        source=f"measured on {res.device}; {plans_summary(s)}",
        levers={"recompute_ops": s.recomputed_ops / per, "recompute_s": s.recompute_s / per,
                "host_steps": s.host_steps / per, "host_step_s": s.host_step_s / per},
    )}
    write_report(path, run.trace, run.hardware, [run.prediction], measured=measured,
                 command=f"tierflow train --model {res.model}")


def _launch(args: argparse.Namespace) -> int:
    """``--nproc N``: run this command on N local ranks; print rank 0's output and the
    errors of ranks that failed."""
    from ..errors import TierflowError
    from .distributed import launch

    if args.nproc < 1:
        raise TierflowError(f"--nproc must be >= 1, got {args.nproc}")
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < args.nproc:
            raise TierflowError(f"--nproc {args.nproc} --device cuda: only {torch.cuda.device_count()} GPU(s) here")
    codes, outs, errs = launch(args.nproc, [sys.executable, "-m", "tierflow.cli", *_child_argv(args)])
    sys.stdout.write(outs[0])
    failed = [r for r, c in enumerate(codes) if c > 0]
    texts: dict[str, list[int]] = {}  # every rank failing alike (a budget too small): said once
    for r in failed:
        if errs[r].strip():
            texts.setdefault(errs[r].strip(), []).append(r)
    for text, ranks in texts.items():
        sys.stderr.write(text + ("\n" if len(texts) == 1 else f"  (rank{'s' * (len(ranks) > 1)} "
                                                              f"{','.join(map(str, ranks))})\n"))
    for r, c in enumerate(codes):
        if c < 0 and c != -9:  # (-9: ended by the launcher after another rank failed)
            tail = "\n".join(errs[r].strip().splitlines()[-5:])
            sys.stderr.write(f"error: rank {r} was ended by signal {-c}" + (f":\n{tail}" if tail else "") + "\n")
    if failed:
        return codes[failed[0]]
    return 1 if any(codes) else 0


def _train_rank(args: argparse.Namespace, policy_options: dict) -> int:
    """One rank of a distributed ``tierflow train``; rank 0 prints every rank's result."""
    import torch
    import torch.distributed as dist

    from .training import train

    device = args.device
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    try:
        res = train(args.model, batch=args.batch, budget=args.budget, steps=args.steps, device=device,
                    policy=args.policy, ssd_dir=args.ssd_dir, check_parity=args.check_parity, seq=args.seq,
                    optimizer=args.optimizer, strategy=args.strategy, policy_options=policy_options,
                    host_steps=_HOST_STEPS[args.host_steps], follow=args.follow)
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, res.to_dict())
        if args.report and dist.get_rank() == 0:
            _write_report(args.report, res)
    finally:
        if owned:
            # FSDP2's modules live in reference cycles, and the last step's collectives
            # (gloo's async work, holding tensors) with them: free them now, while the
            # group and the interpreter are alive; left to the interpreter's exit, gloo's
            # threads drop tensors without the GIL and the process aborts
            # ("terminate called without an active exception").
            gc.collect()
            dist.barrier()
            dist.destroy_process_group()
    ok = all(r["parity"] is not False for r in every)
    if res.rank != 0:
        return 0 if ok else 1
    digests = {r["stats"]["plan_digest"] for r in every}
    parities = [r["parity"] for r in every]
    summary = {
        "world_size": len(every), "strategy": args.strategy,
        "parity": None if any(p is None for p in parities) else all(parities),
        "plans_agree": len(digests) == 1, "ranks": every,
    }
    if args.json:
        u.print_json(summary)
        return 0 if ok else 1
    from rich.table import Table

    r0 = every[0]
    t = Table(title=f"tierflow train: {r0['model']} (batch {r0['batch']} per rank) on {len(every)} ranks, "
                    f"{args.strategy}, {r0['device']}, policy {r0['policy']}")
    t.caption = ("steps: all (profiled/planned/fell back); step: measured under tierflow; plain: the same "
                 "distributed run without tierflow; host, ssd: bytes moved; plan: digest of the plan followed")
    for col in ("rank", "steps", "step", "plain", "predicted", "peak / budget", "host", "ssd", "stalls", "plan",
                "parity"):
        t.add_column(col, justify="left" if col in ("plan", "parity") else "right")
    for r in every:
        s = r["stats"]
        budget = "none" if r["budget_bytes"] is None else fmt_bytes(r["budget_bytes"])
        t.add_row(
            str(r["rank"]), f"{s['steps']} ({s['profiled_steps']}/{s['planned_steps']}/{s['reactive_steps']})",
            fmt_seconds(s["step_time_s"]),
            fmt_seconds(r["plain_step_time_s"]) if r["plain_step_time_s"] else "not run",
            fmt_seconds(s["predicted_step_time_s"]) if s["predicted_step_time_s"] else "n/a",
            f"{fmt_bytes(s['peak_device_bytes'])} / {budget}", fmt_bytes(s["moved_bytes"].get("host", 0)),
            fmt_bytes(s["moved_bytes"].get("ssd", 0)), str(s["stalls"]), s["plan_digest"] or "none",
            "not checked" if r["parity"] is None else ("bitwise equal" if r["parity"] else f"DIFFERS: {r['parity_detail']}"),
        )
    con = u.console()
    con.print(t)
    con.print(f"ranks follow the same plan: {'yes' if len(digests) == 1 else 'NO'}; parity is each rank's "
              f"losses, gradients and parameters{' (its shards)' if args.strategy == 'fsdp' else ''} against the "
              f"same {args.strategy} run without tierflow")
    return 0 if ok else 1
