"""``vdnn``: vDNN (Rhu et al., MICRO 2016), virtualized DNN memory.

vDNN swaps the feature maps a layer saves for backward to pinned host memory once the
forward pass has used them for the last time, and brings each back one layer ahead of
its use: when the backward computation of layer ``n`` starts, the feature maps of
layer ``n - 1`` are prefetched. Weights, gradients and workspaces stay on the GPU.
Its three configurations:

* ``all`` (vDNN_all): every saved feature map is offloaded;
* ``conv`` (vDNN_conv): only the inputs of convolution layers;
* ``dyn`` (vDNN_dyn, the default): the first of *no offload*, ``conv``, ``all`` whose
  plan meets the budget (vDNN picks the least offloading that fits).

On a trace, a *layer* of the backward pass is an op that reads an offloaded feature
map; "one layer ahead" means the prefetch for the op that needs a tensor is issued when
the previous such op starts (after the op before it ends). A feature map is a
non-persistent ``activation``/``input`` tensor used in forward and again in backward.

When even ``all`` leaves some op over the budget, or host memory cannot hold what
vDNN offloads, the policy raises :class:`PlanError` with the bytes.

Options:
    mode (str): ``dyn`` (default), ``all`` or ``conv``.
    tier (str): destination tier (default: host; the fastest offload tier without one).
"""

from __future__ import annotations

import bisect

from ..errors import PlanError, PolicyError
from ..hardware import Hardware
from ..plan import Plan
from ..trace import Trace
from . import PolicyOption, PolicyOptions, register
from ._common import Planner, phase_start, pick_tier
from .flashneuron import forward_to_backward_gaps

MODES = ("dyn", "all", "conv")

OPTIONS = (
    PolicyOption("mode", str, "dyn", "vDNN's configuration: dyn (least that fits), all or conv", MODES),
    PolicyOption("tier", str, None, "destination tier (default: host)"),
)


def _conv_inputs(trace: Trace) -> set[int]:
    out: set[int] = set()
    for o in trace.ops:
        if o.phase == "forward" and "conv" in o.name.lower():
            out.update(o.inputs)
    return out


def _plan_config(trace: Trace, hardware: Hardware, budget: float, gaps: list, tier: str) -> Planner:
    """Offload every gap in ``gaps``; prefetch one backward layer ahead. Like vDNN, the
    choice assumes pinned host memory can hold it (checked by ``fits``), so the plan
    does not change with the host's size."""
    p = Planner(trace, hardware, budget, assume_room=True)
    layers = sorted({g.before_op for g in gaps})
    bwd = phase_start(trace, "backward") or 0
    for g in gaps:
        k = bisect.bisect_left(layers, g.before_op)
        prev = layers[k - 1] if k > 0 else bwd
        # issued when the previous backward layer starts; a gap that short is not swapped
        q = min(max(prev - 1, bwd - 1), g.before_op - 1)
        if q > g.after_op:
            p.take(g, tier, prefetch_after=q)
    return p


@register("vdnn", OPTIONS)
def vdnn(trace: Trace, hardware: Hardware, options: PolicyOptions) -> Plan:
    """vDNN's plan: saved feature maps to host, prefetched one layer ahead.

    Args:
        trace: the iteration.
        hardware: the machine; host memory (or ``tier``) receives the feature maps.
        options: ``mode`` picks the configuration (see the module docstring): ``all``
            moves the most and fits the smallest budgets, ``conv`` moves less but frees
            less, ``dyn`` takes the first of none/conv/all that fits.

    Raises:
        PolicyError: an unknown ``mode``.
        PlanError: the configuration (for ``dyn``: ``all``) does not meet the budget.

    Example:
        >>> make_plan("vdnn", trace, hw, budget="20GiB", mode="all")  # doctest: +SKIP
    """
    mode = str(options.get("mode", "dyn"))
    if mode not in MODES:
        raise PolicyError(f"vdnn: mode {mode!r} is not one of {', '.join(MODES)}")
    tier = str(options.get("tier", "")) or pick_tier(hardware, ("host",))
    hardware.tier(tier)
    gaps = forward_to_backward_gaps(trace)
    conv = _conv_inputs(trace)
    configs = {
        "none": [],
        "conv": [g for g in gaps if g.tensor in conv],
        "all": gaps,
    }
    order = {"dyn": ("none", "conv", "all"), "all": ("all",), "conv": ("conv",)}[mode]
    last: Planner | None = None
    for name in order:
        p = _plan_config(trace, hardware, options.budget_bytes, configs[name], tier)
        if p.fits():
            return p.plan("vdnn", {"mode": mode, "config": name, "tier": tier, "candidates": len(configs[name])})
        last = p
    assert last is not None
    err: PlanError = last.no_fit("vdnn", f"with vDNN_{order[-1]} ({len(last.offloads)} feature maps on {tier})")
    raise err
