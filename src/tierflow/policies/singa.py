"""``singa``: the swapping planner of Zhang et al., "Efficient Memory Management for
GPU-based Deep Learning Systems" (2019, Apache SINGA).

Training repeats itself, so every variable's read/write order and idle periods are
known after one iteration. SINGA swaps variables GPU -> CPU during their idle periods:

* **which** (selection): blocks of at least 1 MB whose idle period spans the memory
  peak are candidates; each is ranked by three scores, higher is better: its idle time,
  its idle time x size ("degree of availability"), and the load above the limit it
  would remove over its idle period ("area over the limit"); the three ranks are summed
  and the best-ranked block is swapped. The load curve is updated and the round
  repeats at the new peak until the peak is under the limit.
* **when** (two scheduling modes):
  - ``stick-to-limit`` (default): swap out right after the access that opens the idle
    period; swap in as early as the limit allows, so the load sticks to the limit;
  - ``no-overhead``: swap in just early enough for the transfer to finish before the
    next access, by SINGA's linear cost model (latency + bytes / bandwidth of the
    link); blocks whose idle period cannot hide both transfers are not swapped.

Here the limit is the device budget, blocks are tensors (persistent ones with their
gaps that wrap across iterations included) and the swap goes to host memory, which
SINGA assumes is large enough: the selection does not look at host capacity. When no
candidate is left and the peak is still over the limit, or the chosen swaps overflow
host memory, the policy raises :class:`PlanError` with the bytes.

Options:
    mode (str): ``stick-to-limit`` (default) or ``no-overhead``.
    min_bytes (int): smallest block considered (default 1 MiB, as the paper's 1 MB).
    tier (str): destination tier (default: host; the fastest offload tier without one).
"""

from __future__ import annotations

import numpy as np

from ..errors import PolicyError
from ..hardware import Hardware
from ..plan import Plan
from ..trace import Trace
from . import PolicyOption, PolicyOptions, register
from ._common import Planner, gap_end, pick_tier

MODES = ("stick-to-limit", "no-overhead")

OPTIONS = (
    PolicyOption("mode", str, "stick-to-limit", "when swaps are scheduled", MODES),
    PolicyOption("min_bytes", int, 2**20, "smallest block considered for a swap"),
    PolicyOption("tier", str, None, "destination tier (default: host)"),
)


def _ranks(score: np.ndarray) -> np.ndarray:
    """Rank 0 for the highest score; ties share the order of appearance."""
    order = np.argsort(-score, kind="stable")
    r = np.empty(len(score), dtype=np.int64)
    r[order] = np.arange(len(score))
    return r


@register("singa", OPTIONS)
def singa(trace: Trace, hardware: Hardware, options: PolicyOptions) -> Plan:
    """SINGA's swap plan (see the module docstring).

    Args:
        trace: the iteration.
        hardware: the machine; the link to host memory sets the no-overhead cost model.
        options: ``mode`` trades memory for overhead: ``stick-to-limit`` keeps the load
            at the limit and may stall on a late swap-in; ``no-overhead`` only swaps
            blocks whose transfers hide in their idle time, so it may need more memory
            (and raise where stick-to-limit fits). ``min_bytes`` skips small blocks,
            whose swaps cost latency and save little.

    Raises:
        PolicyError: an unknown ``mode``.
        PlanError: the peak cannot be brought under the budget.

    Example:
        >>> make_plan("singa", trace, hw, budget="30GiB", mode="no-overhead")  # doctest: +SKIP
    """
    mode = str(options.get("mode", "stick-to-limit"))
    if mode not in MODES:
        raise PolicyError(f"singa: mode {mode!r} is not one of {', '.join(MODES)}")
    min_bytes = int(options.get("min_bytes", 2**20))
    tier = str(options.get("tier", "")) or pick_tier(hardware, ("host",))
    hardware.tier(tier)
    n = trace.n_ops
    limit = float(options.budget_bytes)
    p = Planner(trace, hardware, limit, assume_room=True)
    sizes = trace.sizes

    gaps = [g for g in trace.gaps if sizes[g.tensor] >= min_bytes and gap_end(g, n) - g.after_op >= 2]
    a = np.array([g.after_op for g in gaps], dtype=np.int64)
    end = np.array([gap_end(g, n) for g in gaps], dtype=np.int64)
    size = np.array([sizes[g.tensor] for g in gaps], dtype=np.float64)
    idle = np.array([g.length_s for g in gaps], dtype=np.float64)
    q = end - 1  # swap-in issue point (unwrapped)
    if mode == "no-overhead":
        start2 = np.concatenate([trace.op_start_s[:-1], trace.op_start_s[:-1] + trace.ideal_s, [2 * trace.ideal_s]])
        t_out = np.array([hardware.transfer_time(s, hardware.device, tier) for s in size])
        t_in = np.array([hardware.transfer_time(s, tier, hardware.device) for s in size])
        # latest issue op whose remaining compute before the next access hides the swap-in
        for k in range(len(gaps)):
            deadline = start2[end[k]] - t_in[k]
            q[k] = min(int(np.searchsorted(start2, deadline, side="right")) - 2, int(end[k]) - 1)
        ok = (q > a) & (start2[np.maximum(q, a) + 1] - start2[a + 1] >= t_out)
    else:
        ok = np.ones(len(gaps), dtype=bool)
    taken = np.zeros(len(gaps), dtype=bool)
    durations2 = np.concatenate([trace.durations, trace.durations])
    rounds = 0
    while p.excess() > 0:
        peak = int(np.argmax(p.device.v))
        covers = ((a + 1 <= peak) & (peak <= q)) | ((a + 1 <= peak + n) & (peak + n <= q))
        cand = np.flatnonzero(covers & ok & ~taken)
        if not cand.size:
            raise p.no_fit("singa", f"{mode}: no block of >= {min_bytes} bytes idle across the peak is left ({len(p.offloads)} swapped)")
        over = np.maximum(np.concatenate([p.device.v, p.device.v]) - limit, 0.0) * durations2
        pre = np.concatenate([[0.0], np.cumsum(over)])
        aoa = pre[q[cand] + 1] - pre[a[cand] + 1]
        score = _ranks(idle[cand]) + _ranks(idle[cand] * size[cand]) + _ranks(aoa)
        best = int(cand[np.lexsort((cand, score))[0]])
        taken[best] = True
        rounds += 1
        g = gaps[best]
        p.take(g, tier, prefetch_after=int(q[best]))
    if mode == "stick-to-limit":
        p.place_prefetches()
    if not p.fits():
        raise p.no_fit("singa", f"{mode}: the {len(p.offloads)} swapped blocks overflow {tier} memory")
    return p.plan("singa", {"mode": mode, "tier": tier, "candidates": len(gaps), "rounds": rounds})
