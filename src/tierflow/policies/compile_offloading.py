"""``compile_offloading``: ``torch.compile``'s ``enable_activation_offloading`` on a trace.

What its users run: ``torch._functorch.config.enable_activation_offloading = True``
(torch 2.13, "testing purpose" in its config), with the forward graph's nodes to move
marked ``node.meta["should_offload"] = True``. How torch does it (pytorch/pytorch
``torch/_functorch/_activation_offloading/activation_offloading.py``:
``choose_offload_sets``, ``can_offload``, ``offload_activation_fw``,
``reload_activation_bw``, ``reorder_for_prefetch``; called at the end of
``min_cut_rematerialization_partition``):

* **which**: nothing in torch sets ``should_offload``; the user (a custom graph pass)
  marks nodes. A marked node is offloaded if it is a saved activation (an output of the
  forward graph beyond the model's outputs), not a model output, not a static input
  (a parameter), not a view or ``getitem``, and contiguous;
* **when**: a ``prims.device_put(x, cpu, non_blocking=True)`` right after the tensor's
  last effective use in the forward (a view's users count), and a ``device_put`` back
  just before its first use in the backward, both on the compute stream;
* with ``activation_offload_separate_stream`` the copies run on a side stream, and with
  ``activation_reload_prefetch`` each reload is moved earlier in the backward: walking
  the backward graph in reverse from the reload, the compute nodes' (ops with a FLOP
  formula) benchmarked times are subtracted from the copy's estimated time (bytes at
  ``activation_offload_cpu_gpu_bw``, 50 GB/s by default), first in, first out, until it
  is covered; a reload never moves before the backward's start.

How this policy marks, since torch does not decide (documented as the policy's choice):
``marks=all`` marks every saved activation of at least ``min_bytes`` (what a user
writes first: "offload what the backward needs"); ``marks=largest`` marks the largest
ones first until the trace fits the budget (a user's own greedy pass; tierflow's
compiled plan is the same idea with a gap test). On a trace, a saved activation is a
non-persistent tensor used in forward and again in backward; parameters and the batch
(persistent or external) are never candidates; views and contiguity are not in a trace
and are not checked (a compiled trace's views share their base's tensor).

The plan: each marked tensor is evicted to the host when its last forward use ends and
fetched back when the op before its first backward use ends (same stream: the op waits
for the whole copy), or, with ``separate_stream`` and ``prefetch``, when the op found by
torch's reverse walk ends, using the trace's op times and the hardware's host link for
the copy time (``bandwidth_gbps`` overrides it as torch's config does). Not modelled:
with ``separate_stream`` off the copy out also holds the compute stream (tierflow's
evictions run beside it: ``meta["uncharged_pack_s"]`` gives those seconds, as for
``save_on_cpu``).

The offload is used only when the trace does not fit the budget as it is (``always``
turns it on regardless); when the plan still exceeds the budget, or the host tier
cannot hold the activations, :class:`~tierflow.errors.PlanError` gives the bytes.

Options:
    marks (str): ``all`` (default) or ``largest`` (see above).
    min_bytes (int): smallest tensor marked (default 0: torch has no threshold).
    separate_stream (bool): ``activation_offload_separate_stream`` (default False).
    prefetch (bool): ``activation_reload_prefetch`` (default False; needs separate_stream).
    bandwidth_gbps (float): ``activation_offload_cpu_gpu_bw`` for the prefetch walk
        (default 0: the hardware's device->host link).
    always (bool): offload even when the trace fits as it is (default False).
"""

from __future__ import annotations

from ..errors import PolicyError
from ..hardware import Hardware
from ..plan import Plan
from ..trace import Gap, Trace
from . import PolicyOption, PolicyOptions, register
from ._common import Planner, pick_tier
from .flashneuron import forward_to_backward_gaps

MARKS = ("all", "largest")

OPTIONS = (
    PolicyOption("marks", str, "all", "which saved activations the user marks should_offload: all, or largest until it fits", MARKS),
    PolicyOption("min_bytes", int, 0, "smallest saved activation marked, in bytes"),
    PolicyOption("separate_stream", bool, False, "activation_offload_separate_stream: copies on a side stream"),
    PolicyOption("prefetch", bool, False, "activation_reload_prefetch: move reloads earlier by the copy time (separate stream)"),
    PolicyOption("bandwidth_gbps", float, 0.0, "activation_offload_cpu_gpu_bw for the prefetch walk (0: the hardware's link)"),
    PolicyOption("always", bool, False, "offload even when the trace fits the budget without it"),
)


def prefetch_points(trace: Trace, gaps: list[Gap], copy_s: dict[int, float]) -> dict[int, int]:
    """Per tensor, the op after which torch's ``reorder_for_prefetch`` issues its reload.

    Walking the backward in reverse, reloads queue up (first in, first out) at the op
    that first needs them; each compute op's time pays down the head of the queue, and
    a reload is placed before the op that covers it; at the backward's start the rest
    are placed there."""
    from .compile_memory_budget import _torch_op_lists, base_name

    compute = _torch_op_lists()["compute_intensive_ops"]
    bwd = [i for i, o in enumerate(trace.ops) if o.phase == "backward"]
    if not bwd:
        return {}
    start = bwd[0]
    by_use: dict[int, list[int]] = {}
    for g in gaps:
        by_use.setdefault(g.before_op, []).append(g.tensor)
    out: dict[int, int] = {}
    queue: list[list[float]] = []  # [tensor, remaining seconds]
    for i in reversed(bwd):
        # the op's own reloads wait before it: queue them (the op itself covers none)
        for t in sorted(by_use.get(i, ())):
            queue.append([t, copy_s[t]])
        if i in by_use:
            continue
        if queue and base_name(trace.ops[i].name) in compute:
            queue[0][1] -= trace.ops[i].duration_s
            if queue[0][1] <= 0:
                t, _ = queue.pop(0)
                out[int(t)] = i - 1  # placed before op i: issued when op i - 1 ends
    for t, _ in queue:
        out[int(t)] = start - 1
    return out


@register("compile_offloading", options=OPTIONS)
def compile_offloading(trace: Trace, hardware: Hardware, options: PolicyOptions) -> Plan:
    """``torch.compile`` with ``enable_activation_offloading``: marked saved activations
    to the host after their last forward use, back before their first backward use.

    Args:
        trace: the iteration (phases and kinds tell saved activations apart).
        hardware: the machine; its host tier receives the activations.
        options: see the module docstring.

    Raises:
        PolicyError: a negative ``min_bytes`` or ``bandwidth_gbps``, or ``prefetch``
            without ``separate_stream`` (torch only prefetches on the side stream).
        PlanError: the plan exceeds the budget or host memory (with the bytes).

    Example:
        >>> make_plan("compile_offloading", trace, hw, budget="60%", marks="largest")  # doctest: +SKIP
    """
    marks = str(options.get("marks", "all"))
    min_bytes = int(options.get("min_bytes", 0))
    side = bool(options.get("separate_stream", False))
    prefetch = bool(options.get("prefetch", False))
    gbps = float(options.get("bandwidth_gbps", 0.0))
    if min_bytes < 0 or gbps < 0:
        raise PolicyError(f"compile_offloading: min_bytes ({min_bytes}) and bandwidth_gbps ({gbps}) must be >= 0")
    if prefetch and not side:
        raise PolicyError("compile_offloading: prefetch needs separate_stream (torch prefetches reloads only on the side stream)")
    tier = pick_tier(hardware, ("host",))
    budget = options.budget_bytes
    if trace.peak_live_bytes <= budget and not bool(options.get("always", False)):
        return Plan(policy="compile_offloading", budget_bytes=budget,
                    meta={"offloads": 0, "tier": tier, "note": "fits without offloading"})
    gaps = [g for g in forward_to_backward_gaps(trace) if int(trace.sizes[g.tensor]) >= min_bytes
            and g.before_op - g.after_op > 1]
    if marks == "largest":
        gaps.sort(key=lambda g: (-int(trace.sizes[g.tensor]), g.after_op, g.tensor))
    if prefetch:
        rate = gbps * 2**30 if gbps else None

        def seconds(t: int) -> float:
            b = int(trace.sizes[t])
            return b / rate if rate else hardware.transfer_time(b, tier, hardware.device)

        where = prefetch_points(trace, gaps, {g.tensor: seconds(g.tensor) for g in gaps})
    p = Planner(trace, hardware, budget)
    for g in gaps:
        if marks == "largest" and p.fits():
            break
        after = g.before_op - 1
        if prefetch:
            after = max(g.after_op + 1, min(where.get(g.tensor, after), after))
        p.take(g, tier, prefetch_after=after)
    what = f"with {len(p.offloads)} of {len(gaps)} saved activations marked ({marks}) on {tier}"
    if not p.fits():
        raise p.no_fit("compile_offloading", what)
    pack_s = 0.0 if side else sum(hardware.transfer_time(int(trace.sizes[o.tensor]), hardware.device, tier)
                                  for o in p.offloads)
    return p.plan("compile_offloading", {"tier": tier, "marks": marks, "candidates": len(gaps),
                                         "separate_stream": side, "prefetch": prefetch,
                                         "uncharged_pack_s": float(pack_s)})


__all__ = ["compile_offloading", "prefetch_points"]
