"""Check a captured trace against what PyTorch itself records for the same step.

Method. The step is run in plain PyTorch — ``loss_fn(model(inputs), target)``,
``backward()``, ``optimizer.step()``, ``zero_grad(set_to_none=True)`` — with no tierflow
code in the loop, after ``warmup`` unrecorded steps so that the optimizer state exists:

* on CPU under ``torch.profiler.profile(profile_memory=True)``: the profiler records
  every allocation and free of the CPU allocator as an allocation event (signed bytes,
  read from its event tree); their running sum, in time order, added to the bytes already allocated when the step
  starts (the distinct storages of parameters, buffers, optimizer state and the batch),
  peaks at the step's peak;
* on CUDA with ``torch.cuda.reset_peak_memory_stats`` / ``max_memory_allocated``, the
  caching allocator's own high-water mark (which rounds each block up to 512 bytes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree


def _storages(*objs: Any) -> dict[int, int]:
    out: dict[int, int] = {}
    for x in pytree.tree_leaves(objs):
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            out[st._cdata] = st.nbytes()
    return out


def _allocations(events: Any) -> list[tuple[int, int]]:
    """``(time_ns, signed bytes)`` of every allocator event in a profiler event tree."""
    from torch._C._profiler import _EventType

    out: list[tuple[int, int]] = []
    stack = list(events)
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            out.append((e.start_time_ns, int(e.extra_fields.alloc_size)))
        stack.extend(e.children)
    return out


def torch_step_peak(
    model: torch.nn.Module,
    inputs: Any,
    target: Any,
    loss_fn: Callable,
    optimizer: torch.optim.Optimizer,
    warmup: int = 1,
) -> dict[str, float]:
    """Peak bytes and wall time of one plain PyTorch training step, as PyTorch records them.

    Args:
        model, inputs, target, loss_fn: the step is ``loss_fn(model(inputs), target)``.
        optimizer: an optimizer over the model's parameters.
        warmup: plain steps run first (optimizer state, allocator warm-up).

    Returns:
        ``{"peak_bytes", "baseline_bytes", "step_s"}``: the peak of allocated bytes during
        the step, the bytes allocated when it started, and its wall time (a second,
        unprofiled run of the step).

    Raises:
        ValueError: the model is on a device other than cpu or cuda.

    Example:
        >>> net = torch.nn.Linear(4, 2)
        >>> r = torch_step_peak(net, torch.randn(3, 4), torch.tensor([0, 1, 1]),
        ...                     torch.nn.functional.cross_entropy, torch.optim.SGD(net.parameters(), lr=0.1))
        >>> r["peak_bytes"] > r["baseline_bytes"]
        True
    """
    dev = next(model.parameters()).device

    def step() -> None:
        loss = loss_fn(model(inputs), target)
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model.train()
    optimizer.zero_grad(set_to_none=True)
    for _ in range(warmup):
        step()
    state = [v for s in optimizer.state.values() for v in s.values()]
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        step()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
    elif dev.type == "cpu":
        base = sum(
            _storages(list(model.parameters()), list(model.buffers()), state, inputs, target).values()
        )
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        mem = sorted(_allocations(prof.profiler.kineto_results.experimental_event_tree()))
        cur = peak = base
        for _, delta in mem:
            cur += delta
            peak = max(peak, cur)
    else:
        raise ValueError(f"torch_step_peak: device must be cpu or cuda, got {dev}")
    t0 = time.perf_counter()
    step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return {"peak_bytes": float(peak), "baseline_bytes": float(base), "step_s": time.perf_counter() - t0}
