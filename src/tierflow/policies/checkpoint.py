"""``checkpoint``: ``torch.utils.checkpoint`` (non-reentrant) around every block.

What its users run: each transformer layer or residual block wrapped in
``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` (Hugging Face's
``gradient_checkpointing_enable()``, torchtitan's ``FullAC``), or, for a plain sequence
of modules, ``checkpoint_sequential(model, segments, x)`` with about sqrt(n) segments
(Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016).

How PyTorch does it (pytorch/pytorch ``torch/utils/checkpoint.py``:
``_checkpoint_without_reentrant_generator``, ``_checkpoint_hook``,
``_recomputation_hook``):

* in forward, the block runs normally under saved-tensor hooks whose pack hook keeps
  only a placeholder for every tensor an op saves for backward; the block's inputs are
  stored as they are. A tensor the block makes is therefore freed after its last
  forward use, unless it outlives the block (its outputs);
* in backward, the first unpack of any placeholder re-runs the block's forward under
  the saved RNG state (``preserve_rng_state=True`` by default) and keeps each
  re-created tensor until it is unpacked; with ``early_stop=True`` (the default)
  re-running stops as soon as every saved tensor is back, so ops after the block's last
  saving op are not re-run;
* nothing in it skips ops with side effects: a BatchNorm in training mode updates its
  running statistics again when its block is re-run (its momentum is applied twice).

Here each block becomes one :class:`~tierflow.plan.Recompute`: the block's forward ops
(up to the last one that saves a tensor, with ``early_stop``) re-create, just before
the first backward op that needs one, every tensor the block made that backward uses
and that does not outlive the block. Blocks come from the trace's scopes, or sqrt(n)
segments without them (:mod:`tierflow.policies._recompute`). Impure ops are re-run as
PyTorch re-runs them (``impure=rerun``, the default; their side effects happen twice,
as with ``torch.utils.checkpoint``); ``impure=keep`` instead keeps what they make and
re-runs only the pure ops, as an executor that must not repeat side effects would.

The checkpointed plan is used only when the trace does not fit the budget as it is
(a user turns checkpointing on when the model does not fit; ``always=True`` turns it
on regardless). When even the checkpointed plan exceeds the budget the policy raises
:class:`~tierflow.errors.PlanError` with the bytes.

Options:
    pattern (str): regex of the block scopes (default: found from the scopes).
    segments (int): segments without scopes (default 0: sqrt(n)).
    early_stop (bool): stop re-running once every saved tensor is back (default True).
    impure (str): ``rerun`` (default) or ``keep``.
    always (bool): checkpoint even when the trace fits as it is (default False).
"""

from __future__ import annotations

from ..hardware import Hardware
from ..plan import Plan
from ..trace import Trace
from . import PolicyOption, PolicyOptions, register
from ._recompute import IMPURE, block_recomputes, check_impure, find_blocks, recompute_plan, unchanged_plan

OPTIONS = (
    PolicyOption("pattern", str, "", "regex the block scopes match in full (default: the repeated level of the scopes)"),
    PolicyOption("segments", int, 0, "checkpointed segments on a trace without scopes (0: sqrt(n) of the forward ops)"),
    PolicyOption("early_stop", bool, True, "stop re-running a block once every tensor it saved is back (PyTorch's default)"),
    PolicyOption("impure", str, "rerun", "ops with side effects (BatchNorm): re-run them as PyTorch does, or keep what they make", IMPURE),
    PolicyOption("always", bool, False, "checkpoint even when the trace fits the budget without it"),
)


@register("checkpoint", options=OPTIONS)
def checkpoint(trace: Trace, hardware: Hardware, options: PolicyOptions) -> Plan:
    """``torch.utils.checkpoint`` around every block: keep its inputs, recompute it in backward.

    Args:
        trace: the iteration; scopes (``Op.scope``) give the blocks, sqrt(n) segments
            without them.
        hardware: the machine (only its name is used: recomputing moves nothing).
        options: see the module docstring.

    Raises:
        PolicyError: a bad ``pattern``, ``segments`` or ``impure``.
        PlanError: the checkpointed plan does not meet the budget (with the bytes).

    Example:
        >>> make_plan("checkpoint", trace, hw, budget="12GiB")  # doctest: +SKIP
    """
    impure = check_impure("checkpoint", str(options.get("impure", "rerun")))
    blocks = find_blocks(trace, str(options.get("pattern", "")), int(options.get("segments", 0)))
    if trace.peak_live_bytes <= options.budget_bytes and not bool(options.get("always", False)):
        return unchanged_plan("checkpoint", options.budget_bytes, blocks)
    recomputes = block_recomputes(trace, blocks, early_stop=bool(options.get("early_stop", True)))
    return recompute_plan("checkpoint", trace, hardware, options.budget_bytes, blocks, recomputes, impure)
