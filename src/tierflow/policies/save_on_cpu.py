"""``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around the forward.

What its users run: the forward pass (or part of it) under
``with torch.autograd.graph.save_on_cpu(pin_memory=True):``. How PyTorch does it
(pytorch/pytorch ``torch/autograd/graph.py``, class ``save_on_cpu``): its pack hook,
called whenever an op saves a tensor for backward, allocates a pinned host tensor and
``copy_``s the device tensor into it with ``non_blocking=True`` *on the current (compute)
stream*; autograd keeps only the host copy, so the device tensor is freed after its
last forward use. Its unpack hook, called when a backward op needs the tensor, copies it
back with ``.to(device, non_blocking=True)``, again on the compute stream. There is no
prefetch and no side stream: both copies sit in the compute stream's queue, so the ops
after them wait for them.

Here, on a trace:

* every saved activation (a non-persistent ``activation``/``input`` tensor used in
  forward and again in backward) is evicted to pinned host memory after its last
  forward use;
* it is fetched back when the op before the first backward op that needs it ends
  (``needed_by`` that op): the copy cannot overlap the compute before it, and the op
  that needs it waits for all of it, as on the compute stream.

What the plan vocabulary cannot say, and how it is approximated:

* the pack copy runs on the compute stream, so the forward pass waits for every
  device-to-host copy; tierflow's evictions run on a copy engine beside the compute
  stream, so that wait is *not* charged. ``meta["uncharged_pack_s"]`` gives its size
  (the copies' seconds at the link's bandwidth). A move that occupies the compute
  stream (a ``Move`` flag, or a simulator option) would make this faithful;
* PyTorch also packs parameters an op saves (a matmul's weight) and copies them out
  and back, and packs a tensor saved by two ops twice; neither frees device memory,
  and their traffic is not charged here;
* a tensor used by several backward ops is fetched once and stays until its last use
  (PyTorch unpacks a copy per saving op).

The offload is used only when the trace does not fit the budget as it is (``always``
turns it on regardless); when the plan still exceeds the budget, or pinned host memory
cannot hold the activations, the policy raises :class:`~tierflow.errors.PlanError`
with the bytes.

Options:
    always (bool): offload even when the trace fits as it is (default False).
"""

from __future__ import annotations

from ..hardware import Hardware
from ..plan import Plan
from ..trace import Gap, Trace
from . import PolicyOption, PolicyOptions, register
from ._common import Planner, pick_tier
from .flashneuron import forward_to_backward_gaps

OPTIONS = (
    PolicyOption("always", bool, False, "offload even when the trace fits the budget without it"),
)


def offload_at_use(
    policy: str,
    trace: Trace,
    hardware: Hardware,
    budget: float,
    always: bool,
    gaps: list[Gap],
    fetch_lead: int,
    meta: dict,
    pack_on_compute: bool,
) -> Plan:
    """Evict every gap to pinned host memory after its last forward use and fetch it
    back when op ``needed_by - 1 - fetch_lead`` ends (never before the eviction).
    With ``pack_on_compute``, ``meta["uncharged_pack_s"]`` records the seconds of the
    device-to-host copies the compute stream would wait for (see the module docstring).

    Raises:
        PlanError: the plan exceeds the budget or host memory (with the bytes).
    """
    tier = pick_tier(hardware, ("host",))
    if trace.peak_live_bytes <= budget and not always:
        return Plan(policy=policy, budget_bytes=budget,
                    meta={"offloads": 0, "tier": tier, "note": "fits without offloading", **meta})
    p = Planner(trace, hardware, budget)
    for g in gaps:
        p.take(g, tier, prefetch_after=max(g.after_op + 1, g.before_op - 1 - fetch_lead))
    if not p.fits():
        raise p.no_fit(policy, f"with {len(p.offloads)} of {len(gaps)} saved activations on {tier}")
    pack_s = sum(hardware.transfer_time(int(trace.sizes[o.tensor]), hardware.device, tier) for o in p.offloads)
    return p.plan(policy, {"tier": tier, "candidates": len(gaps),
                           "uncharged_pack_s": float(pack_s) if pack_on_compute else 0.0, **meta})


@register("save_on_cpu", options=OPTIONS)
def save_on_cpu(trace: Trace, hardware: Hardware, options: PolicyOptions) -> Plan:
    """``save_on_cpu(pin_memory=True)``: every saved activation to host, back at unpack.

    Args:
        trace: the iteration (kinds and phases tell saved activations apart).
        hardware: the machine; its host tier receives the activations.
        options: ``always`` (see the module docstring).

    Raises:
        PlanError: the plan exceeds the budget or host memory (with the bytes).

    Example:
        >>> make_plan("save_on_cpu", trace, hw, budget="12GiB")  # doctest: +SKIP
    """
    gaps = forward_to_backward_gaps(trace)
    return offload_at_use("save_on_cpu", trace, hardware, options.budget_bytes, bool(options.get("always", False)),
                          gaps, fetch_lead=0,
                          meta={"pin_memory": True}, pack_on_compute=True)
