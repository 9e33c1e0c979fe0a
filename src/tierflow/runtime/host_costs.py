"""What the runtime itself costs the thread that dispatches the ops, measured on the
machine at hand for the hardware model (``Hardware.op_issue_s``,
``Hardware.recompute_issue_s``, ``Hardware.host_step_issue_s``): a few tens of
milliseconds, once per run. In CPU mode :mod:`.retime` measures the first two again on
the model's own ops, once a plan has run a few steps.

Why this is needed. The trace's op durations are what each op took, timed around the
op alone (CPU: the host's clock around the kernel call; CUDA: events on the stream).
A followed iteration also pays, per op, the dispatch mode's entry and the lean path's
bookkeeping (:meth:`~tierflow.runtime.executor.Run._follow_op`), and, per replayed
recompute op, the replay's bookkeeping (:meth:`~tierflow.runtime.recompute.Recomputer.remake`).
On tiny ops that is most of the step: gpt-tiny's 498 ops take about 5.5 ms by the
trace and 11 ms in a followed iteration with nothing planned.

How. A short sequence of small ``add`` ops runs (a) the way the profiled iteration
times them, each timed alone, and (b) through the real code path: the run's own
dispatch mode and lean path, on a scratch per-op table; a scratch recompute chain
through the real replay. The cost per op is the wall time of (b) less the ops' own
times in (a), the median of a few rounds: the trace's op times were taken once, in the
conditions of the moment (a shared machine's other load slows them too), and the
fastest round would leave that load out of the runtime's share alone. On CUDA the trace's durations are the GPU's, so
the host's whole time per op is the cost: nothing is subtracted.

The run is left as it was: the scratch tensors' entries are retired, the tables,
counters and stats put back.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from .moves import left_as_it_was
from .recompute import _Chain, _Made, _step

_ADD = torch.ops.aten.add.Tensor


@dataclasses.dataclass(frozen=True)
class HostCosts:
    """Seconds of the dispatching thread per op (per replayed op, per host step), beyond
    the op's traced duration."""

    op_issue_s: float
    recompute_issue_s: float
    #: the lean path's bookkeeping alone per op, without the dispatch mode's entry (the
    #: probe calls the handler directly): what :mod:`.retime` adds to the time a
    #: followed iteration spends outside the handler, measured on the model's own ops
    lean_op_s: float = 0.0
    #: one host optimizer step's fixed cost (``Hardware.host_step_issue_s``): the user's
    #: optimizer stepping one tiny parameter the way a host step runs it (a proxy of
    #: the optimizer, its class's own ``step``); 0 without an optimizer
    host_step_issue_s: float = 0.0


def _own_times(a: torch.Tensor, b: torch.Tensor, n: int) -> float:
    """Seconds ``n`` adds take, each timed alone as the profiled iteration times an op
    (below the dispatch mode)."""
    total = 0.0
    x = a
    with torch._C._DisableTorchDispatch():
        for _ in range(n):
            t0 = time.perf_counter()
            x = _ADD(x, b)
            total += time.perf_counter() - t0
    return total


def measure_host_costs(run: Any, *, ops: int = 48, rounds: int = 7, numel: int = 64) -> HostCosts:
    """Measure :class:`HostCosts` for ``run`` (a :class:`~tierflow.runtime.executor.Run`
    that is planning: its dispatch mode open, no iteration under way).

    Args:
        run: the run.
        ops: adds per round of the lean-path probe (replay chains are two adds each,
            ``ops // 2`` of them per round).
        rounds: rounds of each probe; the median counts.
        numel: elements of the probe's tensors (small: the op's own time is not the point).
    """
    names = ("_optab", "_n_ops", "_op", "_fast", "_quiet", "_hinted", "_stale", "budget", "_op_labels",
             "_recomputer")
    dev = run.device
    cuda = dev.type == "cuda"
    # (the tables of the plan being made, or none yet, are put back)
    with left_as_it_was(run, names), run._ledger.peak_kept():
        with torch._C._DisableTorchDispatch():
            a = torch.ones(numel, device=dev)
            b = torch.ones(numel, device=dev)
        try:
            # (no room is ever made for the probe: its few hundred bytes are not the budget's)
            run.budget = math.inf
            op_s, lean_s = _lean_op_s(run, a, b, ops, rounds, cuda)
            replay_s = _replay_op_s(run, a, b, max(1, ops // 2), rounds, cuda)
            step_s = _host_step_s(run.optimizer, rounds) if not cuda else 0.0
        finally:
            del a, b
            run._retire_dead()
    return HostCosts(op_s, replay_s, lean_s, step_s)


def _host_step_s(optimizer: Any, rounds: int) -> float:
    """Seconds of one host step beyond its bytes: ``optimizer``'s class stepping a
    scratch parameter of 64 elements through a proxy, as :mod:`.host_step` does (the
    update's Python: the optimizer's step for one parameter, 55-100 us for AdamW on the
    2-core CI VM, which a rate in bytes per second does not see). The median of ``rounds``
    steps after one that makes the state. 0 where it cannot be measured.

    NOTE: the proxy holds only the scratch parameter and a state dict of its own: the
    user's parameters and optimizer state are not read or written."""
    from .host_step import _proxy, _raw_step

    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return 0.0
    with torch._C._DisableTorchDispatch():  # (the scratch update is not the model's)
        master = torch.zeros(64)
        master.grad = torch.full((64,), 1e-3)
        state: dict = {}
        times = []
        try:
            with torch.random.fork_rng(devices=[]):
                for k in range(rounds + 1):
                    t0 = time.perf_counter()
                    _raw_step(optimizer)(_proxy(optimizer, groups[0], master, state))
                    if k:  # (the first makes the state)
                        times.append(time.perf_counter() - t0)
        except Exception:  # (an optimizer that cannot step a lone parameter: not measured)
            return 0.0
    return statistics.median(times)


def _lean_op_s(run: Any, a: torch.Tensor, b: torch.Tensor, n: int, rounds: int, cuda: bool) -> tuple[float, float]:
    """Per op: ``n`` adds through the run's dispatch mode and lean path, and ``n`` adds
    handed to the lean path directly (no mode entry), each less the adds' own time
    (CPU mode)."""
    if run._untracked or run._mode not in _get_current_dispatch_mode_stack():
        return 0.0, 0.0  # (not planning inside the block's tracked ops: nothing to measure through)
    out_bytes = a.untyped_storage().nbytes()
    # every row a plain op of the followed iteration: a new result, nothing planned at it
    # (row layout: see profiling.Profiling._make_plan, "the lean path's per-op row")
    row = (_ADD, False, 0, True, None, False, 0, False, [out_bytes], (), None, False)
    run._optab = [row[:2] + (k + 1,) + row[3:] for k in range(n)]
    run._n_ops = n
    run._op_labels = ["<host cost probe>"] * n
    run._hinted = run._stale = False
    follow = type(run)._follow_op
    through, direct = [], []
    for _ in range(rounds):
        for via_mode, costs in ((True, through), (False, direct)):
            own = 0.0 if cuda else _own_times(a, b, n)
            run._op, run._fast, run._quiet = 0, True, False
            x = a
            if cuda:
                torch.cuda.synchronize(a.device)
            if via_mode:
                t0 = time.perf_counter()
                for _k in range(n):
                    x = _ADD(x, b)  # (through the mode: run._follow_op)
                dt = time.perf_counter() - t0
            else:
                with torch._C._DisableTorchDispatch():  # (as inside __torch_dispatch__)
                    t0 = time.perf_counter()
                    for _k in range(n):
                        x = follow(run, _ADD, (x, b), {})
                    dt = time.perf_counter() - t0
            run._fast, run._quiet = False, True
            del x
            run._retire_dead()
            costs.append(dt - own)
    if cuda:
        torch.cuda.synchronize(a.device)
    return max(0.0, statistics.median(through)) / n, max(0.0, statistics.median(direct)) / n


def _replay_op_s(run: Any, a: torch.Tensor, b: torch.Tensor, chains: int, rounds: int, cuda: bool) -> float:
    """Per replayed op: ``chains`` scratch chains of two adds through the real replay
    (``Recomputer.remake``), less the adds' own time (CPU mode)."""
    out_bytes = a.untyped_storage().nbytes()
    made = {id(a): _Made(0, 0)}  # (the second add reads the first's result)
    recipe = [_step(_ADD, (a, b), {}, lambda t: t, None, out_bytes),
              _step(_ADD, (a, b), {}, lambda t: made.get(id(t), t), None, out_bytes)]
    n = 2 * chains
    costs = []
    for _ in range(rounds):
        own = 0.0 if cuda else _own_times(a, b, n)
        rc = run._recomputer.with_chains([_Chain((0, 1), (), 2, recipe=list(recipe)) for _c in range(chains)])
        if cuda:
            torch.cuda.synchronize(a.device)
        with torch._C._DisableTorchDispatch():  # (a replay runs below the mode)
            t0 = time.perf_counter()
            for c in range(chains):
                rc.remake(c)
            dt = time.perf_counter() - t0
        costs.append(dt - own)
    if cuda:
        torch.cuda.synchronize(a.device)
    return max(0.0, statistics.median(costs)) / n
