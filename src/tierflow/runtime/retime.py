"""CPU mode: the plan's step time predicted again from its first followed iterations'
op times and the model's own cost per op outside the runtime (:class:`Retimer`, one per
plan, held by :class:`~tierflow.runtime.executor.Run` as ``_retimer``).

Why. The profiled iteration is a poor clock for a CPU-mode step, in two ways that pull
against each other, and neither depends on the plan:

* **Its op times run high** (8-67% on the tiny zoo models, BENCHMARKS.md "CPU-mode
  prediction"): between its ops the profiling bookkeeping runs (entries, signatures,
  scopes, meta kernels), which leaves each op's data and the interpreter's caches
  colder than in a followed iteration, where a few microseconds of lean path separate
  two ops.
* **What an op costs outside the runtime's handler is not in it at all.** Every op
  reaches ``__torch_dispatch__`` through torch's Python dispatch-mode machinery (the
  arguments boxed into Python objects, the mode popped and pushed back, the op called
  again from Python), and the model's own Python, autograd's engine and the
  optimizer's loop run between the ops. On gpt-tiny a bare pass-through mode adds
  8.2 us an op to plain PyTorch's step, and the followed iteration spends 5-7 ms
  outside the handler per 4.4 ms plain step; the ``add`` probe of :mod:`.host_costs`
  sees half of that.

So the first iterations that follow a plan (``RETIMED``, CPU mode, the runtime's own
machine model) time each op as the lean path runs it, and the time outside the
handler. The trace's op durations become each op's median over them;
``Hardware.op_issue_s`` becomes the median time outside per op plus the lean path's own
bookkeeping per op (:attr:`.host_costs.HostCosts.lean_op_s`, measured by the probe
without the mode's entry); ``Hardware.recompute_issue_s`` becomes the median time a
replay spends per replayed op beyond the ops themselves, with the recording and drops
of the chains in forward (the probe's scratch chains record nothing and restore
nothing); the simulator scores the same plan again after the last,
and ``stats.predicted_step_time_s`` is its answer from then on
(``stats.predicted_step_time_s_at_plan`` keeps the first). A median of a few: one
iteration that a shared machine's other work slowed would set the prediction for the
rest of the run. What the plan itself costs, the moves, the pager's work, how many ops
it replays, stays the simulator's. The plan is not changed.

A plan that steps the optimizer on the host is re-timed too: its gradient hooks' work
(sending a gradient, starting its update) is the runtime's, counted with the handler's
time and left to the simulator (``Hardware.host_step_issue_s``, measured at the plan:
the optimizer stepping one scratch parameter, :mod:`.host_costs`); what the updates'
worker thread takes from the main one (CPython's lock: both run Python) is in the
medians. Not done: on CUDA (op times are the kernels', :mod:`.kernel_times`, and the
host's cost per op is measured by the probe: untested on a GPU yet); with a
``hardware=`` the user gave (their machine model, not ours). An iteration that departs
from its trace is not used.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

from ..errors import TierflowError
from ..hardware import Hardware
from ..trace import Trace

#: followed iterations timed after each plan; the prediction uses their medians
RETIMED = 3


@dataclass(frozen=True)
class Retimed:
    """The plan's prediction made again from its timed iterations.

    Attributes:
        trace: the plan's trace with each op's median time over the timed iterations.
        hardware: the machine model with ``op_issue_s`` (and ``recompute_issue_s``) as measured.
        prediction: the simulator's result for the plan on them (a ``SimResult``).
        outside_s: the median time per iteration outside the runtime's handler.
    """

    trace: Trace
    hardware: Hardware
    prediction: Any
    outside_s: float


class Retimer:
    """Times the first followed iterations of one plan (see the module docstring) and
    owns their samples; the run makes a new one with each plan, and a cached plan keeps
    its own (runtime/signatures.py).

    Args:
        trace, hardware, plan: the plan as made, and what it was made from.
        due: whether to time it at all (CPU mode, the runtime's own machine model, a
            planned plan with a prediction, followed op by op).

    Example:
        >>> Retimer.idle().begin(planned=True, n_ops=10, replay_from=(0.0, 0))
        False
    """

    def __init__(self, trace: Trace | None, hardware: Hardware | None, plan: Any, due: bool) -> None:
        self.left = RETIMED if due else 0  # followed iterations still to time
        self.trace, self.hardware, self.plan = trace, hardware, plan
        n = trace.n_ops if trace is not None and due else 0
        self.op_samples: list[list[float]] = [[] for _ in range(n)]
        self.outside_samples: list[float] = []
        self.replay_samples: list[float] = []
        # the iteration being timed
        self._op_s: list[float | None] = []
        self._handler_s = 0.0
        self._record_s = 0.0
        self._replay_from: tuple[float, int] = (0.0, 0)

    @classmethod
    def idle(cls) -> Retimer:
        """One that times nothing (no plan yet)."""
        return cls(None, None, None, due=False)

    def begin(self, planned: bool, n_ops: int, replay_from: tuple[float, int]) -> bool:
        """A followed iteration of ``n_ops`` ops (the follower's tables') begins: whether
        it is timed. ``replay_from``: the run's ``(recompute_s, recomputed_ops)`` so far."""
        if not (self.left > 0 and planned):
            return False
        self._op_s = [None] * n_ops
        self._handler_s = 0.0
        self._record_s = 0.0
        self._replay_from = replay_from
        return True

    def call(self, i: int, func, args, kwargs):
        """Run op ``i`` of a timed iteration, keeping its time."""
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        self._op_s[i] = time.perf_counter() - t0
        return out

    def add_handler_s(self, dt: float) -> None:
        """``dt`` seconds of the runtime's own work (its handler, its hooks)."""
        self._handler_s += dt

    def add_record_s(self, dt: float) -> None:
        """``dt`` seconds recording and dropping recompute chains in forward."""
        self._record_s += dt

    def _replay_cost(self, replay_now: tuple[float, int]) -> float | None:
        """Seconds per replayed op beyond the op itself in the iteration just timed: its
        chains' replays, less their ops' times as the forward ran them, and their
        recording and drops in forward (each recorded op is replayed once); None
        without a replay."""
        t0, n0 = self._replay_from
        n = replay_now[1] - n0
        if n <= 0:
            return None
        durations = self.trace.ops
        own = sum(self._op_s[o] if self._op_s[o] is not None else durations[o].duration_s
                  for r in self.plan.recomputes for o in r.ops)
        return max(0.0, (replay_now[0] - t0 - own + self._record_s) / n)

    def end(self, wall_s: float, followed: bool, costs: Any, replay_now: tuple[float, int]) -> Retimed | None:
        """The timed iteration ended after ``wall_s`` seconds (up to its last op): if it
        ``followed`` its plan to the end, its times join the samples; after the last,
        the prediction made again from their medians (None before, or where the
        simulator cannot score it). ``costs``: the run's ``HostCosts`` measured at the
        plan (None: nothing to add to)."""
        if not followed or costs is None:
            return None
        self.left -= 1
        for samples, d in zip(self.op_samples, self._op_s):
            if d is not None:
                samples.append(d)
        self.outside_samples.append(max(0.0, wall_s - self._handler_s))
        replay = self._replay_cost(replay_now)
        if replay is not None:
            self.replay_samples.append(replay)
        if self.left:
            return None  # NOTE: one simulation, after the last: it costs the step it ends (gpt-tiny: 20 ms)
        trace, hw = self.trace, self.hardware
        ops = tuple(replace(o, duration_s=statistics.median(d)) if d else o
                    for o, d in zip(trace.ops, self.op_samples))
        outside_s = statistics.median(self.outside_samples)
        retimed = Trace(ops, trace.tensors, name=trace.name,
                        meta=dict(trace.meta, timing=f"op times of the first {RETIMED} followed iterations (median)"))
        hw2 = replace(hw, op_issue_s=outside_s / max(1, trace.n_ops) + costs.lean_op_s)
        if self.replay_samples:
            hw2 = replace(hw2, recompute_issue_s=statistics.median(self.replay_samples))
        from ..simulate import simulate

        try:
            sim = simulate(retimed, hw2, self.plan, check_plan=False)
        except TierflowError:
            return None
        if not math.isfinite(sim.time_s):
            return None
        return Retimed(retimed, hw2, sim, outside_s)


__all__ = ["RETIMED", "Retimed", "Retimer"]
