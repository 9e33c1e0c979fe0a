"""``flashneuron``: FlashNeuron (Bae et al., FAST 2021), as G10 uses it as a baseline.

FlashNeuron offloads the activations the forward pass saves for backward straight from
GPU memory to the SSD (GPUDirect Storage, no host memory on the way) and reads them back
during the backward pass. Everything else (weights, gradients, workspaces) stays on the
GPU. Its offloading scheduler picks activations in forward order, the earliest first
(they have the longest wait until backward, so their transfer hides best), until the
memory curve is under the budget.

Here, on any trace:

* candidates are non-persistent ``activation``/``input`` tensors used in the forward
  phase and again in the backward phase; the gap offloaded is the one from the last
  forward use to the first backward use;
* candidates are taken in order of their last forward use while some op they cover is
  over the budget;
* each is evicted after its last forward use to the SSD (the slowest offload tier when
  the machine has no SSD) and prefetched in the backward pass as early as the budget
  allows (never before the first backward op starts).

When offloading every candidate still leaves some op over the budget (G10 reports this
as "inf" for ViT and Inception-v3) the policy raises :class:`PlanError` with the bytes.

Options:
    tier (str): destination tier name (default: the SSD tier).
"""

from __future__ import annotations

from ..hardware import Hardware
from ..plan import Plan
from ..trace import Trace
from . import PolicyOption, PolicyOptions, register
from ._common import Planner, phase_start, pick_tier

CANDIDATE_KINDS = ("activation", "input")

OPTIONS = (PolicyOption("tier", str, None, "destination tier (default: the SSD tier)"),)


def _tier(hardware: Hardware, options: PolicyOptions) -> str:
    name = options.get("tier", None)
    if name:
        hardware.tier(str(name))
        return str(name)
    ssd = [t for t in hardware.offload_tiers if hardware.tier(t).kind == "ssd"]
    # no SSD: the slowest (storage-like) offload tier stands in for it
    if ssd:
        return ssd[0]
    pick_tier(hardware, ())  # raises when there is no offload tier at all
    return hardware.offload_tiers[-1]


def forward_to_backward_gaps(trace: Trace) -> list:
    """Per candidate activation, its gap from the last forward use to the first
    backward use, in order of the last forward use."""
    bwd = phase_start(trace, "backward")
    if bwd is None:
        return []
    out = []
    for g in trace.gaps:
        t = trace.tensors[g.tensor]
        if t.persistent or t.kind not in CANDIDATE_KINDS or g.wraps:
            continue
        if trace.ops[g.after_op].phase == "forward" and g.after_op < bwd <= g.before_op:
            out.append(g)
    out.sort(key=lambda g: (g.after_op, g.tensor))
    return out


@register("flashneuron", OPTIONS)
def flashneuron(trace: Trace, hardware: Hardware, options: PolicyOptions) -> Plan:
    """FlashNeuron's plan: forward activations to the SSD, back in backward.

    Args:
        trace: the iteration (kinds and phases tell activations and backward apart).
        hardware: the machine; its SSD tier (or ``tier``) receives the activations.
        options: ``budget_bytes`` is met or the policy raises.

    Raises:
        PlanError: offloading every forward activation does not meet the budget.

    Example:
        >>> make_plan("flashneuron", trace, load_hardware("g10-a100"), budget="20GiB")  # doctest: +SKIP
    """
    tier = _tier(hardware, options)
    p = Planner(trace, hardware, options.budget_bytes)
    cands = forward_to_backward_gaps(trace)
    for g in cands:
        if p.excess() <= 0:
            break
        if p.covers_excess(g):
            p.take(g, tier)
    if p.excess() > 0:
        raise p.no_fit("flashneuron", f"with {len(p.offloads)} of {len(cands)} forward activations on {tier}")
    bwd = phase_start(trace, "backward") or 0
    p.place_prefetches({i: max(o.after_op, bwd - 1) for i, o in enumerate(p.offloads)})
    return p.plan("flashneuron", {"tier": tier, "candidates": len(cands)})
