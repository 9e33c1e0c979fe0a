"""Train a zoo model under :func:`~tierflow.runtime.offload`: what ``tierflow train`` and
the demo run, with an optional bitwise parity check against plain PyTorch (or, under
``torch.distributed`` with a ``strategy``, against the same DDP or FSDP2 run without
tierflow, each rank checking its own losses, gradients and parameters)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import TierflowError
from ..units import fmt_bytes, fmt_seconds
from .executor import PolicyArg, offload
from .stats import RunStats
from .storages import _plain


@dataclass
class TrainResult:
    """One ``train`` run.

    Attributes:
        model, batch, device, policy: what ran.
        steps: optimizer steps taken.
        losses: the loss of every step (floats).
        parity: ``True``/``False`` when checked against a plain run (losses, every
            gradient of every step, final parameters, optimizer state and buffers, all
            ``torch.equal``), else None.
        parity_detail: the first mismatch, in words.
        plain_step_time_s: mean step time of the plain run (when it ran).
        stats: the runtime's :class:`RunStats`.
    """

    model: str
    batch: int
    device: str
    policy: str
    steps: int
    losses: list[float]
    stats: RunStats
    parity: bool | None = None
    parity_detail: str = ""
    plain_step_time_s: float | None = None
    wall_s: float = 0.0
    strategy: str | None = None
    rank: int = 0
    world_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    run: Any = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """The JSON the CLI prints: the keys the issue names first, then detail."""
        s = self.stats
        return {
            "steps": self.steps,
            "step_time_s": s.step_time_s,
            "peak_device_bytes": s.peak_device_bytes,
            "budget_bytes": None if not math.isfinite(s.budget_bytes) else int(s.budget_bytes),
            "moved_bytes": dict(s.moved_bytes),
            "predicted_step_time_s": s.predicted_step_time_s,
            "parity": self.parity,
            "model": self.model,
            "batch": self.batch,
            "device": self.device,
            "policy": s.policy or self.policy,
            "plain_step_time_s": self.plain_step_time_s,
            "losses": self.losses,
            "stats": s.to_dict(),
            "parity_detail": self.parity_detail,
            "strategy": self.strategy,
            "rank": self.rank,
            "world_size": self.world_size,
        }


OPTIMIZERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "sgd-foreach": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
}


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t`` (a kept gradient would otherwise take device memory the run
    under test must count as used by someone else)."""
    return t.clone() if t.device.type == "cpu" else t.to("cpu")


def _run_steps(model, opt, batch, loss_fn, steps: int, keep_grads: bool, aside=contextlib.nullcontext,
               after_step: Callable[[int, float], None] | None = None):
    """The user's loop, exactly as written without tierflow. Returns losses and, when
    asked, every step's gradients (copied to the host before the step, inside
    ``aside()``: under tierflow the run's ``untracked`` block).
    ``after_step(steps done, its seconds)`` is called after each step (progress)."""
    x, y = batch
    losses, grads, times = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = loss_fn(model(x), y)
        loss.backward()
        with aside():
            if keep_grads:  # (a DTensor's: this rank's shard)
                grads.append([None if p.grad is None else _to_host(_plain(p.grad)) for p in model.parameters()])
            losses.append(_to_host(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        if after_step is not None:
            after_step(len(times), times[-1])
    return losses, grads, times


def _compare(a_losses, a_grads, b_losses, b_grads, a_model, b_model, a_opt=None, b_opt=None) -> tuple[bool, str]:
    for i, (x, y) in enumerate(zip(a_losses, b_losses)):
        if not torch.equal(x, y):
            return False, f"step {i}: loss {x.item()!r} vs {y.item()!r}"
    names = [n for n, _ in a_model.named_parameters()]
    for i, (ga, gb) in enumerate(zip(a_grads, b_grads)):
        for n, x, y in zip(names, ga, gb):
            if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
                return False, f"step {i}: gradient of {n} differs"
    for (n, p), q in zip(a_model.named_parameters(), b_model.parameters()):
        if not torch.equal(_plain(p), _plain(q)):  # this rank's shard of a DTensor: no collective
            return False, f"final parameter {n} differs"
        if a_opt is not None and b_opt is not None:
            sa, sb = a_opt.state.get(p, {}), b_opt.state.get(q, {})
            if sorted(sa) != sorted(sb):
                return False, f"optimizer state of {n}: keys {sorted(sa)} vs {sorted(sb)}"
            for k, v in sa.items():
                w = sb[k]
                if isinstance(v, torch.Tensor) and not torch.equal(_plain(v).cpu(), _plain(w).cpu()):
                    return False, f"optimizer state {k} of {n} differs"
    for (n, x), (_, y) in zip(a_model.named_buffers(), b_model.named_buffers()):
        if not torch.equal(_plain(x), _plain(y)):
            return False, f"final buffer {n} differs"
    return True, ""


def train(
    model: str,
    batch: int | None = None,
    budget: str | int | float | None = "60%",
    steps: int = 5,
    device: str = "cpu",
    policy: PolicyArg = "tierflow",
    ssd_dir: str | None = None,
    check_parity: bool = False,
    seq: int | None = None,
    optimizer: str = "adamw",
    seed: int = 0,
    strategy: str | None = None,
    progress: Callable[[str, int, int, float, int], None] | None = None,
    **options: Any,
) -> TrainResult:
    """Train zoo model ``model`` for ``steps`` steps under :func:`offload`.

    Args:
        model: a zoo name (``gpt-tiny``, ``vit-tiny``, ``resnet-tiny``, ...).
        batch, seq: batch size and sequence length (zoo defaults when None).
        budget: as for :func:`offload` (bytes or a share of the unconstrained peak).
        steps: optimizer steps (the first one or two are profiling).
        device: ``cpu`` or ``cuda``.
        policy: a policy name or a plan function.
        ssd_dir: enables the SSD tier.
        check_parity: also train an identical model without tierflow (same seed, same
            batch) and compare every loss, every gradient and the final parameters
            bitwise. Doubles the work.
        optimizer: ``adamw`` (lr 1e-3) or ``sgd`` (momentum 0.9, lr 1e-2), torch's
            default implementation for the device; ``adamw-foreach``, ``adamw-fused``,
            ``sgd-foreach``: the multi-tensor ones (stepped in chunks under a budget:
            :mod:`tierflow.runtime.optim_chunks`).
        strategy: with ``torch.distributed`` initialised, ``"ddp"`` (the model in
            ``DistributedDataParallel``) or ``"fsdp"`` (FSDP2: ``fully_shard`` on every
            block of the model's ``ModuleList``s, then on the model). ``batch`` is then
            per rank: every rank draws the same global batch of ``batch x world size``
            and takes its own slice. The parity check compares this rank's losses,
            gradients and parameters (its shards under FSDP2) with the same
            distributed run without tierflow.
        progress: called after every step as ``progress(what, done, steps,
            step_s, moved_bytes)``: ``what`` is ``"plain"`` (the parity run) or
            ``"tierflow"``, ``moved_bytes`` the bytes tierflow moved so far (0 for the
            plain run). Library code prints nothing; the CLI draws a bar from it.
        options: passed to :func:`offload` (``host_bytes``, ``policy_options``, ...).

    Raises:
        tierflow.errors.PolicyError: an unknown policy, or a policy option it does not
            declare or a bad value (checked before anything runs).
        tierflow.errors.TraceError: unknown model. The runtime's errors as for
        :func:`offload`.
    """
    from ..capture import zoo
    from ..policies import check_options
    from .distributed import world

    if isinstance(policy, str):  # a typo in an option fails now, not after profiling
        options["policy_options"] = check_options(policy, options.get("policy_options") or {})
    spec = zoo.spec(model)
    batch = spec.batch if batch is None else batch
    if spec.seq is None:
        seq = None
    rank, size = world()
    if optimizer not in OPTIMIZERS:
        raise TierflowError(f"unknown optimizer {optimizer!r} (optimizers: {', '.join(OPTIMIZERS)})")
    if strategy is not None and strategy not in ("ddp", "fsdp"):
        raise TierflowError(f"unknown strategy {strategy!r} (strategies: ddp, fsdp)")

    def build():
        m = zoo.build(model, device=device, seed=seed)
        net = _wrap(m.model, strategy, torch.device(device))
        params = list(net.parameters())
        opt = OPTIMIZERS[optimizer](params)
        make = m.make_batch
        if strategy is not None:
            def make(b, t=None, _make=m.make_batch):  # this rank's slice of the global batch
                x, y = _make(b * size, t)
                return x[rank * b:(rank + 1) * b].contiguous(), y[rank * b:(rank + 1) * b].contiguous()
        return m._replace(model=net, make_batch=make), opt

    t_start = time.perf_counter()
    plain = None
    plain_time = None
    if check_parity:
        m0, o0 = build()
        b0 = m0.make_batch(batch, seq)
        torch.manual_seed(seed)
        tick0 = None if progress is None else (lambda k, dt: progress("plain", k, steps, dt, 0))
        l0, g0, t0 = _run_steps(m0.model, o0, b0, m0.loss_fn, steps, True, after_step=tick0)
        plain = (m0, l0, g0, o0)
        plain_time = sum(t0[1:]) / max(1, len(t0) - 1) if len(t0) > 1 else t0[0]
    m1, o1 = build()
    b1 = m1.make_batch(batch, seq)
    torch.manual_seed(seed)
    with offload(m1.model, o1, budget=budget, policy=policy, ssd_dir=ssd_dir, **options) as run:
        tick1 = None if progress is None else (
            lambda k, dt: progress("tierflow", k, steps, dt, int(sum(run.stats.moved_bytes.values()))))
        l1, g1, _ = _run_steps(m1.model, o1, b1, m1.loss_fn, steps, check_parity, run.untracked, after_step=tick1)
    parity, detail = None, ""
    if plain is not None:
        parity, detail = _compare(plain[1], plain[2], l1, g1, plain[0].model, m1.model, plain[3], o1)
    res = TrainResult(model, batch, device, policy if isinstance(policy, str) else "custom", steps,
                      [float(x) for x in l1], run.stats, parity, detail, plain_time,
                      time.perf_counter() - t_start, strategy, rank, size)
    res.run = run  # the profiled trace, plan and prediction, for reports (not in to_dict)
    return res


def _wrap(net: torch.nn.Module, strategy: str | None, device: torch.device) -> torch.nn.Module:
    """``net`` under DDP or FSDP2 (see :func:`train`), or as it is."""
    if strategy is None:
        return net
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise TierflowError(f"strategy {strategy!r}: torch.distributed is not initialised "
                            "(run under torchrun, or 'tierflow train --nproc N')")
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    for mod in list(net.modules()):
        if isinstance(mod, torch.nn.ModuleList):
            for block in mod:
                fully_shard(block)
    fully_shard(net)
    return net


def demo_run(model: str = "gpt-tiny", steps: int = 6, ssd_dir: str | None = None, budget: str = "50%",
             policy: str = "tierflow", console: Any = None, host_bytes: int | str = "1MiB") -> TrainResult:
    """The runtime's part of ``make demo``: train ``model`` a few steps in CPU mode under
    a budget, with the host tier and (given ``ssd_dir``, else a temporary directory) the
    SSD tier, check parity with plain PyTorch, and print predicted vs measured. The host
    pool is kept small (``host_bytes``) so that the plan also uses the SSD file, as a
    model far larger than its host memory would.

    Returns the :class:`TrainResult`; prints through ``console`` (a rich Console) when given.
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tierflow-demo-") as tmp:
        res = train(model, budget=budget, steps=steps, device="cpu", policy=policy,
                    ssd_dir=ssd_dir or tmp, check_parity=True, host_bytes=host_bytes)
    if console is not None:
        s = res.stats
        console.print(f"[bold]runtime[/bold]: {model} on cpu, {steps} steps, policy {s.policy}, "
                      f"budget {fmt_bytes(s.budget_bytes)}")
        console.print(f"  measured step {fmt_seconds(s.step_time_s)} (plain PyTorch "
                      f"{fmt_seconds(res.plain_step_time_s or 0)}), predicted "
                      f"{fmt_seconds(s.predicted_step_time_s) if s.predicted_step_time_s else 'n/a'}")
        console.print(f"  peak device {fmt_bytes(s.peak_device_bytes)} <= budget: "
                      f"{s.peak_device_bytes <= s.budget_bytes}; moved host {fmt_bytes(s.moved_bytes.get('host', 0))}, "
                      f"ssd {fmt_bytes(s.moved_bytes.get('ssd', 0))}; stalls {s.stalls}")
        console.print(f"  parity with plain PyTorch (losses, gradients, parameters bitwise): {res.parity}")
    return res


__all__ = ["TrainResult", "demo_run", "train"]
