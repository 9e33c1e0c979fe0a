"""``myelin``: CPU memory as scratch space for model states, after Myelin (Singh and
Bhatele, 2021, arXiv 2110.13005).

Myelin keeps the *model states* (parameters, their gradients and the optimizer state)
in host memory between the operations that use them, moving them with asynchronous,
message-driven transfers so that an operation's states are back on the GPU when its
turn comes; activations stay on the GPU. That is what lets it hold about 4x the
parameters per GPU.

Here, on any trace:

* model states are persistent tensors (parameters, optimizer state) and ``gradient``
  tensors; each inactive gap between two uses (wrapping across the iteration for
  persistent ones) can be parked in host memory;
* ``park="needed"`` (default): gaps are parked, longest idle first, while some op they
  cover is over the budget, and each comes back as early as the budget allows: the
  fewest bytes over PCIe that meet the budget;
* ``park="all"``: every gap of at least ``min_gap_ops`` ops is parked, as Myelin's
  periodic offload does; its prefetch is issued ``lookahead`` ops before the use (as
  an operation's messages are queued ahead of it), later where the budget needs it.

Activations are never moved, so when they alone exceed the budget the policy raises
:class:`PlanError` with the bytes; so it does when host memory is full. Like the
paper, the choice assumes host memory is large enough and checks it only at the end, so
a larger host never changes a plan that fits.

Options:
    park (str): ``needed`` (default) or ``all``.
    lookahead (int): for ``park="all"``, ops between the prefetch and the use (default 8).
    min_gap_ops (int): for ``park="all"``, shortest gap parked (default 2 ops).
    tier (str): destination tier (default: host; the fastest offload tier without one).
"""

from __future__ import annotations

from ..errors import PolicyError
from ..hardware import Hardware
from ..plan import Plan
from ..trace import Gap, Trace
from . import PolicyOption, PolicyOptions, register
from ._common import Planner, gap_end, gap_ops, pick_tier

STATE_KINDS = ("parameter", "optimizer_state", "gradient")

OPTIONS = (
    PolicyOption("park", str, "needed", "park only what the budget needs, or every model state", ("needed", "all")),
    PolicyOption("lookahead", int, 8, "with park=all: ops between a prefetch and its use"),
    PolicyOption("min_gap_ops", int, 2, "with park=all: shortest gap parked, in ops"),
    PolicyOption("tier", str, None, "destination tier (default: host)"),
)


def model_state_gaps(trace: Trace) -> list[Gap]:
    """Gaps of persistent tensors and gradients, longest idle first."""
    out = [
        g
        for g in trace.gaps
        if (trace.tensors[g.tensor].persistent or trace.tensors[g.tensor].kind in STATE_KINDS)
        and gap_ops(g, trace.n_ops) >= 1
    ]
    out.sort(key=lambda g: (-g.length_s, g.tensor, g.after_op))
    return out


@register("myelin", OPTIONS)
def myelin(trace: Trace, hardware: Hardware, options: PolicyOptions) -> Plan:
    """Myelin's plan: model states parked in host memory between uses.

    Args:
        trace: the iteration.
        hardware: the machine; host memory (or ``tier``) is the scratch space.
        options: ``park`` trades traffic for faithfulness: ``needed`` moves only what
            the budget requires; ``all`` parks every state between uses (more PCIe
            traffic, the most free GPU memory). ``lookahead`` sets how far ahead
            ``all`` prefetches: more hides slower links but holds memory longer.

    Raises:
        PolicyError: an unknown ``park`` value.
        PlanError: parking every model state does not meet the budget.

    Example:
        >>> make_plan("myelin", trace, hw, budget="12GiB", park="all")  # doctest: +SKIP
    """
    park = str(options.get("park", "needed"))
    if park not in ("needed", "all"):
        raise PolicyError(f"myelin: park {park!r} is not 'needed' or 'all'")
    tier = str(options.get("tier", "")) or pick_tier(hardware, ("host",))
    hardware.tier(tier)
    n = trace.n_ops
    p = Planner(trace, hardware, options.budget_bytes, assume_room=True)
    gaps = model_state_gaps(trace)
    if park == "needed":
        for g in gaps:
            if p.excess() <= 0:
                break
            if p.covers_excess(g):
                p.take(g, tier)
        if p.excess() > 0:
            raise p.no_fit("myelin", f"with {len(p.offloads)} model-state gaps parked on {tier}")
        p.place_prefetches()
        if not p.fits():
            raise p.no_fit("myelin", f"the {len(p.offloads)} parked model-state gaps overflow {tier} memory")
    else:
        k = int(options.get("lookahead", 8))
        min_ops = int(options.get("min_gap_ops", 2))
        for g in sorted(gaps, key=lambda g: (g.after_op, g.tensor)):
            if gap_ops(g, n) >= min_ops:
                end = gap_end(g, n)
                p.take(g, tier, prefetch_after=max(end - 1 - k, g.after_op + 1))
        # a prefetch that arrives too early for the budget is issued later instead
        p.delay_prefetches()
        if not p.fits():
            raise p.no_fit("myelin", f"with every model state parked on {tier} ({len(p.offloads)} gaps)")
    return p.plan("myelin", {"park": park, "tier": tier, "candidates": len(gaps)})
