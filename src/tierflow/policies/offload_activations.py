"""``offload_activations``: torchtune's ``OffloadActivations`` with streams.

What its users run: torchtune's recipes with ``enable_activation_offloading=True``,
which wrap the model's forward in ``OffloadActivations(use_streams=True)`` from
``get_act_offloading_ctx_manager`` (pytorch/torchtune
``torchtune/training/_activation_offloading.py``). How it works there:

* pack (forward): a saved tensor of at least ``min_offload_size`` bytes (1024) that is
  on the GPU and is not a parameter or buffer is copied to a pinned host tensor on a
  *side stream* (``s1``, after waiting for the compute stream), so the copy overlaps
  compute. The device tensor is kept in a forward stash until ``max_fwd_stash_size``
  (5) later packs, then released after the compute stream waits for its copy;
* the output head runs under ``NoOpManager`` (torchtune disables offloading for
  ``model.output``: bringing its large input straight back is expensive), and the loss,
  computed outside the context, is not offloaded either;
* unpack (backward): a tensor still in the forward stash (the last few packed: the
  backward pass starts before they are released) is returned from the GPU; any other
  is copied back on the side stream when its backward op unpacks it, and the compute
  stream waits for that copy. There is no prefetch of the next layer: the copy is
  issued when the autograd engine reaches the op, which (the CPU launching kernels
  ahead of the GPU) can overlap the GPU's work on the ops before it.

Here, on a trace: every saved activation (a non-persistent ``activation``/``input``
tensor used in forward and again in backward) of at least ``min_offload_size`` bytes,
whose last forward use is inside the model (a scoped op) but not in the head, is
evicted to pinned host memory after its last forward use, except the last
``max_fwd_stash_size`` of them in forward order (still stashed when backward starts);
each is fetched back when op ``needed_by - 1 - run_ahead`` ends: ``run_ahead`` is how
many ops the CPU's kernel launches run ahead of the GPU (default 1, the least overlap
a GPU-bound step gets; with ``use_streams=False`` the copy is on the compute stream and
waits for the op before: ``run_ahead`` 0, no stash). Not modelled: the compute stream's
wait for a pack copy five packs later (the simulator holds the device bytes until the
eviction ends instead), one side stream carrying both directions (tierflow's links
have a copy engine per direction), packs of the same tensor by several ops, and the
weights a matmul saves: autograd saves the transposed *view* of the weight, which is no
``nn.Parameter``, so torchtune copies it out and back too (no device memory is freed by
that; its traffic is not charged here). The stash is counted in offloaded activations
only (torchtune's counter also advances on small tensors and those weight views).

The offload is used only when the trace does not fit the budget as it is (``always``
turns it on regardless); when the plan still exceeds the budget, or pinned host memory
cannot hold the activations, the policy raises :class:`~tierflow.errors.PlanError`
with the bytes.

Options:
    min_offload_size (int): smallest tensor offloaded, bytes (default 1024).
    max_fwd_stash_size (int): packs a device tensor stays stashed for (default 5).
    use_streams (bool): side-stream copies (default True).
    run_ahead (int): ops the CPU launches ahead of the GPU in backward (default 1).
    head (str): comma-separated scopes run under ``NoOpManager`` (default
        ``output,lm_head``: torchtune's models call the head ``output``, Hugging Face's
        ``lm_head``).
    always (bool): offload even when the trace fits as it is (default False).
"""

from __future__ import annotations

from ..errors import PolicyError
from ..hardware import Hardware
from ..plan import Plan
from ..trace import Gap, Trace
from . import PolicyOption, PolicyOptions, register
from .flashneuron import forward_to_backward_gaps
from .save_on_cpu import offload_at_use

OPTIONS = (
    PolicyOption("min_offload_size", int, 1024, "smallest saved tensor offloaded, in bytes"),
    PolicyOption("max_fwd_stash_size", int, 5, "packs a device tensor stays stashed for; the last ones are never offloaded"),
    PolicyOption("use_streams", bool, True, "copies on a side stream (False: on the compute stream, no stash)"),
    PolicyOption("run_ahead", int, 1, "ops the CPU launches ahead of the GPU in backward (how early a fetch is issued)"),
    PolicyOption("head", str, "output,lm_head", "comma-separated scopes of the output head, not offloaded (NoOpManager)"),
    PolicyOption("always", bool, False, "offload even when the trace fits the budget without it"),
)


def _in_scope(scope: str | None, prefixes: tuple[str, ...]) -> bool:
    return scope is not None and any(scope == p or scope.startswith(p + ".") for p in prefixes)


def offloaded_gaps(trace: Trace, min_bytes: int, stash: int, head: tuple[str, ...]) -> tuple[list[Gap], int]:
    """The gaps torchtune offloads (see the module docstring), and how many candidates
    the forward stash keeps on the device."""
    scoped = any(o.scope is not None for o in trace.ops)
    gaps = []
    for g in forward_to_backward_gaps(trace):
        if int(trace.sizes[g.tensor]) < min_bytes:
            continue
        scope = trace.ops[g.after_op].scope
        # on a trace with scopes, an op without one ran outside the model (the loss)
        if (scoped and scope is None) or _in_scope(scope, head):
            continue
        gaps.append(g)
    gaps.sort(key=lambda g: (g.after_op, g.tensor))
    kept = min(stash, len(gaps))
    return gaps[: len(gaps) - kept], kept


@register("offload_activations", options=OPTIONS)
def offload_activations(trace: Trace, hardware: Hardware, options: PolicyOptions) -> Plan:
    """torchtune's ``OffloadActivations``: saved activations to pinned host on a side
    stream, fetched back when backward reaches them.

    Args:
        trace: the iteration; scopes tell the head and the loss apart.
        hardware: the machine; its host tier receives the activations.
        options: see the module docstring.

    Raises:
        PolicyError: a negative size, stash or ``run_ahead``.
        PlanError: the plan exceeds the budget or host memory (with the bytes).

    Example:
        >>> make_plan("offload_activations", trace, hw, budget="12GiB")  # doctest: +SKIP
    """
    min_bytes = int(options.get("min_offload_size", 1024))
    stash = int(options.get("max_fwd_stash_size", 5))
    streams = bool(options.get("use_streams", True))
    run_ahead = int(options.get("run_ahead", 1))
    if min_bytes < 0 or run_ahead < 0:
        raise PolicyError(f"offload_activations: min_offload_size ({min_bytes}) and run_ahead ({run_ahead}) must be >= 0")
    if stash < 1:
        # torchtune raises ValueError for this too
        raise PolicyError(f"offload_activations: max_fwd_stash_size must be at least 1, got {stash}")
    head = tuple(h for h in str(options.get("head", "output,lm_head")).split(",") if h)
    gaps, stashed = offloaded_gaps(trace, min_bytes, stash if streams else 0, head)
    return offload_at_use(
        "offload_activations", trace, hardware, options.budget_bytes, bool(options.get("always", False)), gaps,
        fetch_lead=run_ahead if streams else 0,
        meta={"use_streams": streams, "stashed": stashed, "run_ahead": run_ahead if streams else 0},
        pack_on_compute=not streams,
    )
