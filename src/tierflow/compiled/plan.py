"""What a compiled graph does with each saved activation: keep it, or offload it to the
host tier and bring it back before its first backward use.

:func:`plan_graph` is greedy on the graph's trace (:mod:`tierflow.compiled.graph_trace`):
while the live bytes at the peak op exceed the target, it offloads the largest saved
tensor whose gap (last forward use, first backward use) spans that op. An offloaded
tensor is off the device strictly inside its gap. The plan is a pure function of the
facts and the target, so the same graph and target give the same plan (and the same
cache key: :meth:`GraphPlan.key`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from .graph_trace import GraphFacts, SavedTensor


@dataclass(frozen=True, slots=True)
class GraphPlan:
    """One graph's plan.

    Attributes:
        offload: names of saved tensors to copy to the host tier and back.
        target_bytes: the live bytes the plan aims at (``None``: keep everything).
        predicted_peak_bytes: the trace's peak with the plan (above the step's start).
        unreachable: the target could not be met by offloading (what is left on the
            device at the peak is not saved for backward, or not movable).
    """

    offload: frozenset[str] = frozenset()
    target_bytes: int | None = None
    predicted_peak_bytes: int = 0
    unreachable: bool = False
    slots: dict[str, int] = field(default_factory=dict, compare=False)

    def key(self) -> str:
        """A digest that changes exactly when the plan does (for torch's caches)."""
        text = ",".join(sorted(self.offload))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def curve_with(facts: GraphFacts, offload: list[SavedTensor]) -> np.ndarray:
    """The facts' live-bytes curve with ``offload`` off the device inside their gaps."""
    curve = facts.curve.copy()
    for s in offload:
        if s.first_bwd_use - s.last_fwd_use > 1:
            curve[s.last_fwd_use + 1 : s.first_bwd_use] -= s.bytes
    return curve


def plan_graph(facts: GraphFacts, target_bytes: int | None, min_bytes: int = 1 << 16) -> GraphPlan:
    """Offload saved tensors until the trace's peak is at most ``target_bytes``.

    Args:
        facts: the graph as the planner sees it.
        target_bytes: the live bytes to reach; ``None`` keeps everything.
        min_bytes: smaller tensors are not worth a copy's fixed cost.
    """
    if target_bytes is None:
        return GraphPlan(predicted_peak_bytes=facts.peak_bytes)
    chosen: list[SavedTensor] = []
    candidates = [s for s in facts.saved if s.offloadable and s.bytes >= min_bytes
                  and s.first_bwd_use - s.last_fwd_use > 1]
    curve = facts.curve.copy()
    unreachable = False
    while len(curve) and curve.max() > target_bytes:
        peak_op = int(curve.argmax())
        spanning = [s for s in candidates if s.last_fwd_use < peak_op < s.first_bwd_use]
        if not spanning:
            unreachable = True
            break
        best = max(spanning, key=lambda s: (s.bytes, s.name))
        candidates.remove(best)
        chosen.append(best)
        curve[best.last_fwd_use + 1 : best.first_bwd_use] -= best.bytes
    names = frozenset(s.name for s in chosen)
    return GraphPlan(offload=names, target_bytes=int(target_bytes),
                     predicted_peak_bytes=int(curve.max()) if len(curve) else 0,
                     unreachable=unreachable)
