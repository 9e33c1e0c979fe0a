"""The report's verdict in plain words: which policies fit, how close to ideal, why."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..units import fmt_bytes, fmt_seconds
from .analysis import breakdown


def _runs(r: Any) -> bool:
    return r.fits and r.error is None and math.isfinite(r.time_s)


def verdict(trace: Any, hardware: Any, results: Sequence[Any],
            measured: dict[str, Any] | None = None) -> tuple[str, list[str]]:
    """A one-line headline and supporting sentences (plain text, no markup).

    The headline names the best policy that fits, at its budget, with its predicted
    share of the ideal step, then the others that fit and those that do not, e.g.
    ``"Fits at 40.00 GiB with deepum, predicted 0.91 of ideal; also fits with lru
    (0.56); does not fit with vdnn."`` The ``ideal`` policy is the reference, not a
    candidate: it says whether the step fits without offloading at all.

    Args:
        trace: the trace simulated.
        hardware: the machine.
        results: one simulated result per policy.
        measured: per policy, a :class:`~tierflow.report.measured.Measured` to set
            against the prediction.

    Returns:
        ``(headline, details)``.

    Example:
        >>> from tierflow import load_hardware
        >>> from tierflow.policies import make_plan
        >>> from tierflow.simulate import simulate
        >>> from tierflow.synthetic import gpt_trace
        >>> hw = load_hardware("rtx4090-24g")
        >>> tr = gpt_trace(hw, layers=2, d_model=256, batch=2, seq=128)
        >>> head, _ = verdict(tr, hw, [simulate(tr, hw, make_plan("lru", tr, hw))])
        >>> head.startswith("Fits at 24.00 GiB with lru, predicted 1.00 of ideal")
        True
    """
    measured = measured or {}
    dev = hardware.device
    ideal = next((r for r in results if r.policy == "ideal"), None)
    candidates = [r for r in results if r.policy != "ideal"]
    fitting = sorted((r for r in candidates if _runs(r)), key=lambda r: -r.ratio)
    failing = [r for r in candidates if not _runs(r)]

    parts = []
    if fitting:
        best = fitting[0]
        parts.append(f"Fits at {fmt_bytes(best.budget_bytes)} with {best.policy}, "
                     f"predicted {best.ratio:.2f} of ideal")
        if len(fitting) > 1:
            parts.append("also fits with " + ", ".join(f"{r.policy} ({r.ratio:.2f})" for r in fitting[1:]))
    elif candidates:
        parts.append(f"Does not fit in {fmt_bytes(hardware.device_capacity)} with any policy tried")
    elif ideal is not None:
        parts.append(("Fits" if ideal.fits else "Does not fit") + f" in {fmt_bytes(hardware.device_capacity)} "
                     "without offloading")
    if failing and fitting:
        parts.append("does not fit with " + ", ".join(r.policy for r in failing))
    headline = "; ".join(parts) + "." if parts else "No results."

    details = []
    peak_op = trace.ops[trace.peak_op]
    need = ideal.peak_bytes.get(dev, 0) if ideal is not None and _finite(ideal) else trace.peak_live_bytes
    room = hardware.device_capacity
    details.append(
        f"Unconstrained, one step of {trace.name} holds up to {fmt_bytes(need)} on {dev} "
        f"(live tensors peak at op {trace.peak_op}, {peak_op.name}, in {peak_op.phase}); the device has "
        f"{fmt_bytes(room)}, so it " + ("fits without offloading." if need <= room else
                                       f"needs {fmt_bytes(need - room)} moved off the device at the peak.")
    )
    for r in fitting:
        b = breakdown(r)
        moved = sum(r.traffic_bytes.values())
        text = (f"{r.policy}: {fmt_seconds(r.time_s)} a step ({r.ratio:.2f} of the ideal "
                f"{fmt_seconds(r.ideal_s)}); stalls {fmt_seconds(r.stall_s)}")
        if b is not None and b.stalled_ops:
            text += f" over {b.stalled_ops} ops"
        text += f"; moves {moved / 1e9:.1f} GB"
        if b is not None and moved:
            text += f", {b.hidden_share:.0%} of its transfer time hidden behind compute"
        if r.faults:
            text += f"; {r.faults} on-demand faults"
        text += f"; peak on {dev} {fmt_bytes(r.peak_bytes.get(dev, 0))}."
        details.append(text)
    for r in failing:
        if r.error:
            details.append(f"{r.policy} does not fit: {r.error}.")
        else:
            details.append(f"{r.policy} does not fit: it holds {fmt_bytes(r.peak_bytes.get(dev, 0))} on {dev}, "
                           f"more than its {fmt_bytes(hardware.device_capacity)}.")
    for r in results:
        m = measured.get(r.policy)
        if m is None:
            continue
        if _finite(r):
            diff = (m.time_s - r.time_s) / r.time_s
            details.append(f"{r.policy} measured {fmt_seconds(m.time_s)} a step against "
                           f"{fmt_seconds(r.time_s)} predicted ({diff:+.1%}).")
        else:
            details.append(f"{r.policy} measured {fmt_seconds(m.time_s)} a step; the simulator predicted it "
                           "could not run.")
    return headline, details


def _finite(r: Any) -> bool:
    return math.isfinite(r.time_s)
