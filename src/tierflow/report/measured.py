"""What a real training run measured, to set against the simulator's prediction.

``tierflow train ... --report out.html`` builds one :class:`Measured` for the policy it
ran and passes it to :func:`tierflow.report.build_report` as
``measured={"tierflow": Measured(...)}``. The
report then adds a measured column to the comparison table, a measured marker to the
step-time breakdown, the measured device memory over the predicted stack, and a
measured-against-predicted sentence to the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Measured:
    """One measured training iteration.

    Attributes:
        time_s: the measured step time (median over the measured steps, say).
        memory: per tier, a step curve ``(times_s, bytes)`` from the iteration start, as
            in :class:`~tierflow.simulate.result.SimResult`; tiers not measured are left out.
        peak_bytes: per tier, the measured peak (e.g. ``torch.cuda.max_memory_allocated``).
        source: a label for the legend ("measured", "A100 run 3").
        levers: measured per step, beside the prediction's recompute and host-step rows:
            ``recompute_ops``, ``recompute_s``, ``host_steps``, ``host_step_s`` (each
            optional).

    Example:
        >>> m = Measured(time_s=8.3, peak_bytes={"gpu": 39 * 2**30})
        >>> m.source
        'measured'
    """

    time_s: float
    memory: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    peak_bytes: dict[str, int] = field(default_factory=dict)
    source: str = "measured"
    levers: dict[str, float] = field(default_factory=dict)
