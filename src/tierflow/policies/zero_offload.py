"""``zero_offload`` and ``zero_offload+checkpoint``: DeepSpeed ZeRO-Offload (Ren et al.,
USENIX ATC 2021), ZeRO stage 2 with ``"offload_optimizer": {"device": "cpu"}``, alone
and with activation checkpointing, as its users run it.

What DeepSpeed does (deepspeedai/DeepSpeed ``deepspeed/runtime/zero/stage_1_and_2.py``,
``DeepSpeedZeroOptimizer``; options in ``deepspeed/runtime/zero/config.py`` and
``offload_config.py``):

* the fp32 master weights, their gradients and the Adam moments live in pinned host
  memory (``single_partition_of_fp32_groups`` and its ``.grad``); the optimizer is
  ``DeepSpeedCPUAdam``, which steps on the host. Optimizer state is never on the GPU;
* in backward, each parameter's gradient hook copies the gradient into a contiguous
  GPU bucket (``reduce_independent_p_g_buckets_and_remove_grads``; offload forces
  ``contiguous_gradients``); when the next gradient would overflow
  ``reduce_bucket_size`` elements (default 5e8), the bucket is reduced and each
  gradient copied to the host fp32 buffer (``reduce_ipg_grads`` ->
  ``copy_grads_in_partition`` -> ``async_inplace_copy_grad_to_fp32_buffer_from_gpu``)
  and freed on the GPU. The bucket buffer (``setup_buckets``: ``reduce_bucket_size``
  elements of the model's dtype, two with ``overlap_comm``, off by default for stage
  2) is allocated when backward starts and released when it ends;
* ``step()`` runs CPU Adam over the host partition, copies the updated fp32 weights to
  a pinned 16-bit buffer and from there to the GPU parameters (``non_blocking``);
* parameters and activations stay on the GPU: ZeRO-Offload moves no activation.

Here: every parameter the trace's optimizer updates gets a
:class:`~tierflow.plan.HostStep` (its optimizer ops leave the device, its state lives
on the host, its gradient goes to the host after the last backward op that writes it,
the updated parameter comes back); there are no moves. The plan contract sends each
gradient when its last write ends: bucketing cannot be expressed in a plan, so the
gradients leave the device per tensor, at least as early as DeepSpeed's (a bucket is
sent when it fills); the bucket buffer itself is charged against the budget over the
backward ops (``reduce_bucket_size`` elements at the trace's element size, twice with
``overlap_comm``), so a plan this policy returns leaves DeepSpeed room for it. Nor can
a plan say when the update may start: the simulator starts each parameter's update as
its gradient lands, overlapping backward, where DeepSpeed's ``step()`` runs CPU Adam
after backward ends, so a simulated step is optimistic by up to the backward time.

``zero_offload+checkpoint`` adds the ``checkpoint`` peer's recomputation (one
:class:`~tierflow.plan.Recompute` per block, :mod:`tierflow.policies._recompute`), as
DeepSpeed users turn on activation checkpointing (``deepspeed.checkpointing`` or Hugging
Face's ``gradient_checkpointing_enable()``) beside ZeRO-Offload. As the ``checkpoint``
policy does, it checkpoints only when ZeRO-Offload alone does not fit (``always`` turns
it on regardless).

When the plan does not fit the budget, or host memory cannot hold the parameters,
gradients and optimizer state, the policy raises :class:`~tierflow.errors.PlanError`
with the bytes; a trace without an optimizer step (G10's workloads) has nothing to
offload and raises it too.

Options (DeepSpeed's names and defaults):
    reduce_bucket_size (int): gradient bucket in elements (5e8).
    overlap_comm (bool): double-buffered bucket (False for stage 2).
    pattern, segments, early_stop, impure, always: ``zero_offload+checkpoint`` only,
        as for ``checkpoint``.
"""

from __future__ import annotations

import numpy as np

from ..errors import PolicyError
from ..hardware import Hardware
from ..plan import Plan, Recompute
from ..trace import Trace
from . import PolicyOption, PolicyOptions, register
from ._common import no_fit, phase_start, pick_tier
from ._zero import check_host_room, element_bytes, host_step_delta, host_steps, param_updates
from .checkpoint import OPTIONS as CHECKPOINT_OPTIONS

#: DeepSpeed's ``zero_optimization.reduce_bucket_size`` default (elements).
REDUCE_BUCKET_SIZE = 500_000_000

OPTIONS = (
    PolicyOption("reduce_bucket_size", int, REDUCE_BUCKET_SIZE,
                 "elements per gradient reduce bucket, a GPU buffer held through backward (DeepSpeed default 5e8)"),
    PolicyOption("overlap_comm", bool, False,
                 "two reduce buckets instead of one (DeepSpeed's default is off for stage 2)"),
)


def bucket_bytes(trace: Trace, options: PolicyOptions, overlap_default: bool) -> tuple[int, str]:
    """Device bytes of DeepSpeed's gradient bucket buffer(s), and the element size's source."""
    elements = int(options.get("reduce_bucket_size", REDUCE_BUCKET_SIZE))
    if elements < 0:
        raise PolicyError(f"reduce_bucket_size {elements} is negative")
    size, source = element_bytes(trace)
    buffers = 2 if bool(options.get("overlap_comm", overlap_default)) else 1
    return elements * size * buffers, source


def _backward_span(trace: Trace) -> tuple[int, int]:
    first = phase_start(trace, "backward")
    if first is None:
        return 0, -1
    last = max(i for i, o in enumerate(trace.ops) if o.phase == "backward")
    return first, last


def _plan(policy: str, trace: Trace, hardware: Hardware, options: PolicyOptions, checkpointing: bool) -> Plan:
    updates = param_updates(trace, policy)
    tier = pick_tier(hardware, ("host",))
    steps = host_steps(updates, tier)
    sizes = trace.sizes
    host_need = int(sum(int(sizes[u.param]) + int(sizes[u.grad]) + int(sizes[list(u.state)].sum()) for u in updates))
    check_host_room(hardware, {tier: host_need}, policy)

    delta = host_step_delta(trace, updates, policy)
    bucket, elem_source = bucket_bytes(trace, options, overlap_default=False)
    reserve = np.zeros(trace.n_ops, dtype=np.int64)
    lo, hi = _backward_span(trace)
    reserve[lo : hi + 1] = bucket
    base = trace.live_bytes + delta + reserve

    recomputes: tuple[Recompute, ...] = ()
    meta: dict = {
        "tier": tier,
        "host_steps": len(steps),
        "host_bytes": host_need,
        "bucket_bytes": bucket,
        "element_bytes_from": elem_source,
        "gradients": "per tensor (the plan contract has no buckets)",
    }
    curve = base
    if checkpointing:
        curve, recomputes, info = _with_checkpoint(trace, options, base, delta + reserve)
        meta.update(info)
    peak = int(curve.max()) if len(curve) else 0
    if peak > options.budget_bytes:
        what = f"with {len(steps)} parameters host-stepped on {tier} (optimizer state off the device, gradients sent as produced), a {bucket}-byte gradient bucket held in backward"
        if checkpointing:
            what += f" and {len(recomputes)} blocks recomputed"
        raise no_fit(policy, trace, hardware, options.budget_bytes, what, curve, host_optimizer=True)
    meta["planned_peak_bytes"] = peak
    return Plan(policy=policy, budget_bytes=options.budget_bytes, meta=meta, recomputes=recomputes, host_steps=steps)


def _with_checkpoint(
    trace: Trace, options: PolicyOptions, base: np.ndarray, extra: np.ndarray
) -> tuple[np.ndarray, tuple[Recompute, ...], dict]:
    """The checkpoint peer's recomputes on top of ZeRO-Offload (only where ZeRO-Offload
    alone is over the budget, unless ``always``)."""
    from ._recompute import (
        block_recomputes,
        check_impure,
        find_blocks,
        keep_impure,
        planned_device_bytes,
        recompute_seconds,
    )

    impure = check_impure("zero_offload+checkpoint", str(options.get("impure", "rerun")))
    blocks = find_blocks(trace, str(options.get("pattern", "")), int(options.get("segments", 0)))
    info: dict = {"blocks": len(blocks.blocks), "blocks_from": blocks.found_by}
    if int(base.max()) <= options.budget_bytes and not bool(options.get("always", False)):
        info.update({"recomputes": 0, "note": "fits without checkpointing"})
        return base, (), info
    recomputes = block_recomputes(trace, blocks, early_stop=bool(options.get("early_stop", True)))
    if impure == "keep":
        recomputes = keep_impure(trace, recomputes)
    # the recompute curve and the host steps change disjoint tensors (forward
    # activations; gradients, optimizer state and the update's temporaries): add them
    curve = planned_device_bytes(trace, recomputes) + extra
    info.update({
        "recomputes": len(recomputes),
        "recomputed_bytes": int(sum(int(trace.sizes[t]) for r in recomputes for t in r.tensors)),
        "recompute_s": recompute_seconds(trace, recomputes),
        "impure": impure,
        "impure_reruns": sum(1 for r in recomputes for i in r.ops if not trace.ops[i].pure),
    })
    return curve, recomputes, info


@register("zero_offload", options=OPTIONS, host_optimizer=True)
def zero_offload(trace: Trace, hardware: Hardware, options: PolicyOptions) -> Plan:
    """DeepSpeed ZeRO-Offload: gradients and optimizer state on the host, update there.

    Args:
        trace: the iteration; it must have an optimizer step.
        hardware: the machine; host memory holds the optimizer's side.
        options: ``reduce_bucket_size`` and ``overlap_comm`` size the GPU gradient
            bucket DeepSpeed holds through backward (a smaller bucket fits smaller
            budgets; DeepSpeed's default is 5e8 elements, one buffer).

    Raises:
        PlanError: no optimizer step; the plan exceeds the budget; host memory too small.

    Example:
        >>> make_plan("zero_offload", trace, hw, reduce_bucket_size=50_000_000)  # doctest: +SKIP
    """
    return _plan("zero_offload", trace, hardware, options, checkpointing=False)


@register("zero_offload+checkpoint", options=OPTIONS + CHECKPOINT_OPTIONS, host_optimizer=True)
def zero_offload_checkpoint(trace: Trace, hardware: Hardware, options: PolicyOptions) -> Plan:
    """ZeRO-Offload with activation checkpointing around every block.

    Args:
        trace: the iteration; scopes give the blocks (sqrt(n) segments without them).
        hardware: the machine.
        options: ZeRO-Offload's (``reduce_bucket_size``, ``overlap_comm``) and the
            ``checkpoint`` policy's (``pattern``, ``segments``, ``early_stop``,
            ``impure``, ``always``).

    Raises:
        PolicyError: a bad checkpoint option.
        PlanError: as ``zero_offload``, with the blocks recomputed.

    Example:
        >>> make_plan("zero_offload+checkpoint", trace, hw, budget="20GiB")  # doctest: +SKIP
    """
    return _plan("zero_offload+checkpoint", trace, hardware, options, checkpointing=True)
