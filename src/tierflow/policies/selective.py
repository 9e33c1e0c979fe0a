"""``selective``: PyTorch selective activation checkpointing, as torchtitan configures it.

What its users run: torchtitan's ``SelectiveAC`` (op-level SAC, the default
activation-checkpointing mode of its Llama recipes; pytorch/torchtitan
``torchtitan/distributed/activation_checkpoint.py``): every block of
``model.layers`` is wrapped in ``checkpoint_wrapper`` with
``torch.utils.checkpoint.create_selective_checkpoint_contexts`` and a policy that says,
per op of the block's forward:

* ``MUST_SAVE`` for the expensive ops: PyTorch's compute-intensive list
  (``torch._functorch.partitioners.get_default_op_list``: ``mm``, ``addmm``, ``bmm``,
  ``convolution``, the SDPA flash/efficient kernels, ``_flash_attention_forward``,
  ``_efficient_attention_forward``, ``upsample_bilinear2d``, ``_scaled_mm``), the other
  SDPA kernels (cuDNN, math, overrideable), ``max``, flex attention, ``linear``,
  ``topk``, and the collectives ``reduce_scatter_tensor`` and ``all_to_all_single``;
* except every second ``mm``/``linear`` of the block (a counter per block, counting
  only ``mm`` and ``linear``: ``addmm`` and ``bmm`` are always saved), and ``mm``s of
  the MoE router gate (``force_recompute_mm_shapes_by_fqns``), which are recomputed;
* ``PREFER_RECOMPUTE`` for everything else (norms, activations, dropout, elementwise).

The saved outputs are cached in forward and handed back during recompute; the other
ops of the block are re-run in backward (``early_stop=False``: the whole block) under
the saved RNG state (``preserve_rng_state=True``).

Here each block (found as for ``checkpoint``: :mod:`tierflow.policies._recompute`)
becomes one :class:`~tierflow.plan.Recompute` whose chain is the block's forward ops
minus the saved ones, re-creating every tensor a re-run op made that backward uses and
that does not outlive the block. Ops are matched by their aten name (``aten::mm``; the
trace does not record the overload, so every ``max`` counts); a trace captured on the
CPU names flash attention ``_scaled_dot_product_flash_attention_for_cpu``, which stands
for the CUDA kernel here. torchtitan also saves device-to-host ``_to_copy`` results;
the trace does not record copy destinations, so those are recomputed here. Without
scopes the blocks are sqrt(n) segments, and names from another framework (G10's CUDA
kernels) match nothing: everything is recomputed, as ``checkpoint`` does.

The plan is used only when the trace does not fit the budget as it is (``always=True``
uses it regardless); when it exceeds the budget the policy raises
:class:`~tierflow.errors.PlanError` with the bytes.

Options:
    pattern (str): regex of the block scopes (default: found from the scopes).
    segments (int): segments without scopes (default 0: sqrt(n)).
    force_recompute (str): comma-separated scope substrings whose ``mm`` is always
        recomputed (default ``moe.router.gate``, torchtitan's).
    impure (str): ``rerun`` (default: SAC is ``torch.utils.checkpoint`` underneath and
        re-runs a BatchNorm with its side effect) or ``keep`` (as for ``checkpoint``).
    always (bool): checkpoint even when the trace fits as it is (default False).
"""

from __future__ import annotations

from ..hardware import Hardware
from ..plan import Plan
from ..trace import Trace
from . import PolicyOption, PolicyOptions, register
from ._recompute import (
    IMPURE,
    Blocks,
    block_recomputes,
    check_impure,
    find_blocks,
    recompute_plan,
    unchanged_plan,
)

# torchtitan's save set (see the module docstring), by aten name without namespace
SAVE_OPS = frozenset({
    # torch._functorch.partitioners.get_default_op_list().compute_intensive_ops
    "mm", "convolution", "convolution_backward", "bmm", "addmm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_flash_attention_forward", "_efficient_attention_forward",
    "upsample_bilinear2d", "_scaled_mm",
    # torchtitan's extra compute ops
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math",
    "_scaled_dot_product_fused_attention_overrideable", "max", "flex_attention",
    "linear", "topk",
    # communication
    "reduce_scatter_tensor", "all_to_all_single",
})
# only these count for "every second mm is recomputed"
MM_OPS = frozenset({"mm", "linear"})
# CPU captures name the kernels differently; the trace stands for the CUDA run
_ALIASES = {"_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention"}

OPTIONS = (
    PolicyOption("pattern", str, "", "regex the block scopes match in full (default: the repeated level of the scopes)"),
    PolicyOption("segments", int, 0, "checkpointed segments on a trace without scopes (0: sqrt(n) of the forward ops)"),
    PolicyOption("force_recompute", str, "moe.router.gate", "comma-separated scope substrings whose mm is always recomputed"),
    PolicyOption("impure", str, "rerun", "ops with side effects (BatchNorm): re-run them as PyTorch does, or keep what they make", IMPURE),
    PolicyOption("always", bool, False, "checkpoint even when the trace fits the budget without it"),
)


def base_name(op_name: str) -> str:
    """``aten::mm.default`` -> ``mm``; ``_c10d_functional::reduce_scatter_tensor`` ->
    ``reduce_scatter_tensor``."""
    name = op_name.split("::", 1)[-1].split(".", 1)[0]
    return _ALIASES.get(name, name)


def saved_ops(trace: Trace, blocks: Blocks, force_recompute: tuple[str, ...]) -> frozenset[int]:
    """The ops of the blocks whose outputs torchtitan's policy saves (``MUST_SAVE``)."""
    out: set[int] = set()
    for b in blocks.blocks:
        mm_count = 0  # torchtitan's counter restarts with every checkpointed call
        for i in b.ops:
            o = trace.ops[i]
            name = base_name(o.name)
            if name in MM_OPS:
                if any(f in (o.scope or "") for f in force_recompute):
                    continue
                mm_count += 1
                if mm_count % 2 == 0:
                    continue
            if name in SAVE_OPS:
                out.add(i)
    return frozenset(out)


@register("selective", options=OPTIONS)
def selective(trace: Trace, hardware: Hardware, options: PolicyOptions) -> Plan:
    """torchtitan's op-level selective activation checkpointing on every block.

    Args:
        trace: the iteration (aten op names and scopes, as ``tierflow capture`` records).
        hardware: the machine (only its name is used: recomputing moves nothing).
        options: see the module docstring.

    Raises:
        PolicyError: a bad ``pattern``, ``segments`` or ``impure``.
        PlanError: the plan does not meet the budget (with the bytes).

    Example:
        >>> make_plan("selective", trace, hw, budget="16GiB")  # doctest: +SKIP
    """
    impure = check_impure("selective", str(options.get("impure", "rerun")))
    blocks = find_blocks(trace, str(options.get("pattern", "")), int(options.get("segments", 0)))
    if trace.peak_live_bytes <= options.budget_bytes and not bool(options.get("always", False)):
        return unchanged_plan("selective", options.budget_bytes, blocks)
    force = tuple(f for f in str(options.get("force_recompute", "moe.router.gate")).split(",") if f)
    keep = saved_ops(trace, blocks, force)
    recomputes = block_recomputes(trace, blocks, saved_ops=keep, early_stop=False)
    return recompute_plan("selective", trace, hardware, options.budget_bytes, blocks, recomputes, impure,
                          {"saved_ops": len(keep),
                           "saved_bytes": int(sum(int(trace.sizes[t]) for i in keep for t in trace.ops[i].outputs))})
