"""CPU mode: the plan's step time predicted again from its first followed iterations'
op times and the model's own cost per op outside the runtime (a mixin of
:class:`~tierflow.runtime.executor.Run`).

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
from dataclasses import replace

from ..errors import TierflowError
from ..trace import Trace

#: followed iterations timed after each plan; the prediction uses their medians
RETIMED = 3


class Retiming:
    """Times the first followed iterations of a plan (see the module docstring)."""

    _retimes_left: int = 0  # followed iterations still to time for the current plan
    _timing: bool = False  # this iteration times its ops (the lean path reads it)

    def _retime_arm(self) -> None:
        """A plan was just made: time its first followed iterations, if this run's
        machine model is its own and on the CPU."""
        due = (not self._cuda and self._hardware_arg is None and not self.plan.reactive
               and self.stats.predicted_step_time_s is not None)
        self._retimes_left = RETIMED if due else 0
        # (self.trace and self.hardware stay the plan's until the samples replace them)
        self._op_samples: list[list[float]] = [[] for _ in range(self.trace.n_ops)]
        self._outside_samples: list[float] = []
        self._replay_samples: list[float] = []
        self.stats.predicted_step_time_s_at_plan = self.stats.predicted_step_time_s

    def _retime_begin(self) -> None:
        """A planned iteration begins: time it if its plan's prediction is due."""
        self._timing = self._retimes_left > 0 and self._planned
        if self._timing:
            self._op_s: list[float | None] = [None] * self._n_ops
            self._handler_s = 0.0
            self._replay_from = (self.stats.recompute_s, self.stats.recomputed_ops)
            self._record_s = 0.0

    def _timed_follow_op(self, func, args, kwargs):
        """``_follow_op`` with the time spent inside it counted (the handler's share)."""
        t0 = time.perf_counter()
        try:
            return self._follow_op(func, args, kwargs)
        finally:
            self._handler_s += time.perf_counter() - t0

    def _replay_cost(self) -> float | None:
        """Seconds per replayed op beyond the op itself in the iteration just timed: its
        chains' replays, less their ops' times as the forward ran them, and their
        recording and drops in forward (each recorded op is replayed once); None
        without a replay."""
        t0, n0 = self._replay_from
        n = self.stats.recomputed_ops - n0
        if n <= 0:
            return None
        durations = self.trace.ops
        own = sum(self._op_s[o] if self._op_s[o] is not None else durations[o].duration_s
                  for r in self.plan.recomputes for o in r.ops)
        return max(0.0, (self.stats.recompute_s - t0 - own + self._record_s) / n)

    def _timed_call(self, i: int, func, args, kwargs):
        """Run op ``i`` of a timed iteration, keeping its time."""
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        self._op_s[i] = time.perf_counter() - t0
        return out

    def _retime_end(self, wall_s: float) -> None:
        """The timed iteration ended after ``wall_s`` seconds (up to its last op): its
        times join the samples, and the prediction is made again from their medians,
        if it followed its plan to the end."""
        self._timing = False
        costs = getattr(self, "_host_costs", None)  # (measured at the plan: see _hardware_for)
        if self._stale or self._op != self.trace.n_ops or costs is None:
            return
        self._retimes_left -= 1
        for samples, d in zip(self._op_samples, self._op_s):
            if d is not None:
                samples.append(d)
        self._outside_samples.append(max(0.0, wall_s - self._handler_s))
        replay = self._replay_cost()
        if replay is not None:
            self._replay_samples.append(replay)
        if self._retimes_left:
            return  # NOTE: one simulation, after the last: it costs the step it ends (gpt-tiny: 20 ms)
        trace, hw = self.trace, self.hardware
        ops = tuple(replace(o, duration_s=statistics.median(d)) if d else o
                    for o, d in zip(trace.ops, self._op_samples))
        outside_s = statistics.median(self._outside_samples)
        retimed = Trace(ops, trace.tensors, name=trace.name,
                        meta=dict(trace.meta, timing=f"op times of the first {RETIMED} followed iterations (median)"))
        hw2 = replace(hw, op_issue_s=outside_s / max(1, trace.n_ops) + costs.lean_op_s)
        if self._replay_samples:
            hw2 = replace(hw2, recompute_issue_s=statistics.median(self._replay_samples))
        from ..simulate import simulate

        try:
            sim = simulate(retimed, hw2, self.plan, check_plan=False)
        except TierflowError:
            return
        if not math.isfinite(sim.time_s):
            return
        self.stats.predicted_step_time_s = sim.time_s
        self.stats.ideal_step_time_s = retimed.ideal_s
        self.stats.outside_handler_s = outside_s
        self.trace, self.hardware, self.prediction = retimed, hw2, sim
