"""``compile_memory_budget``: ``torch.compile``'s ``activation_memory_budget`` on a trace.

What its users run: ``torch._functorch.config.activation_memory_budget = B`` (``B`` in
[0, 1], default 1.0) before compiling; AOT autograd's min-cut partitioner then picks the
fastest saved set whose activation memory is at most ``B`` of the way from "recompute
everything" (``B = 0``: only the graph's inputs are saved) to its own runtime-optimised
choice (``B = 1``). How torch 2.13 does it (pytorch/pytorch
``torch/_functorch/partitioners.py``: ``choose_saved_values_set``, ``solve_min_cut``,
``estimate_runtime``; ``torch/_functorch/_activation_checkpointing/knapsack.py``:
``dp_knapsack``, ``greedy_knapsack``):

* the saved set is a minimum cut of the forward graph: each tensor costs its bytes
  (times ``1.1 ** dist_from_bw``, its distance in ops to the backward, and twice that
  when no user can fuse it), a *banned* op's output can only be saved, never re-made,
  and whatever the backward reads must be saved or re-made from what is saved;
* the activation size of a saved set counts its bytes; its *memory ratio* is
  ``(size - size(inputs)) / (size(B = 1 set) - size(inputs))``;
* with ``B < 1`` it first tries min cuts with the bans relaxed (``more aggressive``:
  only non-allowlisted ops stay banned; ``aggressive``: only compute-intensive, random
  and reduction ops, whose output is 4x smaller than their inputs, stay banned), and
  takes the first whose ratio is below ``B``;
* otherwise a 0-1 knapsack over the banned ops' outputs that lead to the backward,
  sizes normalised by ``size(B = 1) - size(inputs)``, values their estimated runtimes
  (``flops`` by default), capacity ``B``: the items it keeps stay banned, the others
  may be re-made, and one more min cut (aggressive, with those un-banned) is the saved
  set. ``dp_knapsack`` (the default solver) quantises sizes by 10,000 and backtracks
  from the full capacity; ``greedy`` keeps items by runtime per byte.

Here, on a tierflow trace:

* ``B = 1`` is the trace's own saved set (the forward-made tensors a backward op
  reads). For a trace made from a compiled graph (:mod:`tierflow.compiled.graph_trace`)
  that is torch's own min cut; for an eager trace, what eager autograd saves (torch's
  ``B = 1`` cut of the same model saves somewhat less);
* the graph is the trace's forward ops; banned, allowlisted and fusible ops are torch's
  own lists (``get_default_op_list()``), matched by aten base name (``aten::mm``,
  ``aten.mm.default`` -> ``mm``); an op the trace marks impure is banned and never
  un-banned (torch's graphs are functional: it has none). Inputs (parameters, the
  batch: tensors no op makes) cost nothing to save (torch: parameters free,
  ``treat_parameters_as_free_to_save``; the batch is there for the whole step in a
  tierflow trace), so ``size(inputs)`` is 0 here;
* runtimes are the trace's op durations (measured by a capture, or graph_trace's
  roofline), standing for torch's FLOP count; the ``long fusible chains`` and ``used
  far apart`` bans of torch's default cut are not modelled (only the ``B = 1`` set
  uses them, and that is the trace's);
* the plan: every forward-made tensor the backward reads that is not in the chosen
  saved set is dropped after its last forward use and re-made before its first
  backward use (:func:`tierflow.policies._rematerialize.recompute_chains`); a saved
  tensor the forward no longer needs is held until the chain that reads it.

``memory_budget`` picks ``B``; left at -1 the policy runs a user's sweep (1.0, 0.9, ...,
0.1, 0.0) and takes the largest ``B`` whose plan fits the device budget. When the
chosen (or the smallest) ``B`` does not fit, :class:`~tierflow.errors.PlanError` gives
the bytes.

Options:
    memory_budget (float): ``activation_memory_budget`` (default -1: the largest of the
        sweep that fits).
    solver (str): ``dp`` (torch's default) or ``greedy``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import numpy as np

from ..errors import PolicyError
from ..hardware import Hardware
from ..plan import Plan
from ..trace import Trace
from . import PolicyOption, PolicyOptions, register
from ._common import no_fit
from ._recompute import planned_device_bytes, recompute_seconds
from ._rematerialize import recompute_chains

SOLVERS = ("dp", "greedy")
SWEEP = tuple(round(1.0 - 0.1 * k, 1) for k in range(11))
QUANT = 10_000  # dp_knapsack's quantisation of the normalised sizes

OPTIONS = (
    PolicyOption("memory_budget", float, -1.0, "activation_memory_budget in [0, 1] (-1: the largest of 1.0, 0.9, ..., 0.0 that fits)"),
    PolicyOption("solver", str, "dp", "knapsack solver: dp (torch's default) or greedy", SOLVERS),
)


@cache
def _torch_op_lists() -> dict[str, frozenset[str]]:
    """torch's op categories by aten base name (``mm``, ``native_dropout``)."""
    from torch._functorch.partitioners import get_default_op_list

    ops = get_default_op_list()
    out = {}
    for key in ("compute_intensive_ops", "random_ops", "view_ops", "recomputable_ops", "fusible_ops"):
        out[key] = frozenset(str(p).split(".", 1)[-1] for p in getattr(ops, key) if str(p).startswith(("aten.", "prims.")))
    return out


def base_name(op_name: str) -> str:
    """``aten::mm``, ``aten.mm.default`` -> ``mm``."""
    name = op_name.split("::", 1)[-1]
    if name.startswith(("aten.", "prims.")):
        name = name.split(".", 1)[1]
    return name.split(".", 1)[0]


@dataclass(frozen=True)
class ForwardGraph:
    """The trace's forward ops as the partitioner's graph.

    Attributes:
        maker: per tensor, the forward op that makes it (-1: an input, or not forward-made).
        wanted: tensors made in forward that a backward op reads.
        dist: per tensor, ops from it to the backward (``dist_from_bw``; 1 when a
            backward op reads it, ``inf`` when nothing leads there).
        banned: per op, why its outputs may not be re-made under each option set:
            ``"allowlist"`` (not in torch's recomputable list) or ``"always"``
            (compute-intensive, random, a reduction, impure).
        materialized: per tensor, some user cannot fuse it (torch doubles the others' cost).
    """

    maker: np.ndarray
    wanted: frozenset[int]
    dist: np.ndarray
    banned: dict[int, str]
    materialized: np.ndarray


def forward_graph(trace: Trace) -> ForwardGraph:
    """The partitioner's view of ``trace`` (see :class:`ForwardGraph`)."""
    lists = _torch_op_lists()
    n_t = trace.n_tensors
    first = trace.first_use
    persistent, external = trace.persistent, trace.external
    sizes = trace.sizes
    maker = np.full(n_t, -1, dtype=np.int64)
    fwd_ops = [i for i, o in enumerate(trace.ops) if o.phase == "forward"]
    for i in fwd_ops:
        for t in trace.ops[i].outputs:
            if int(first[t]) == i and not persistent[t] and not external[t]:
                maker[t] = i
    wanted = set()
    for o in trace.ops:
        if o.phase == "backward":
            wanted.update(t for t in o.tensors if maker[t] >= 0)
    # dist_from_bw: through the forward's users, from the ops that lead to the backward
    dist = np.full(n_t, math.inf)
    for t in wanted:
        dist[t] = 1.0
    for i in reversed(fwd_ops):
        outs = [t for t in trace.ops[i].outputs if maker[t] == i]
        best = min((dist[t] for t in outs), default=math.inf)
        if best < math.inf:
            for a in trace.ops[i].inputs:
                if maker[a] >= 0 and a not in outs:
                    dist[a] = min(dist[a], best + 1)
    banned: dict[int, str] = {}
    materialized = np.zeros(n_t, dtype=bool)
    for i in fwd_ops:
        o = trace.ops[i]
        name = base_name(o.name)
        in_b = sum(int(sizes[a]) for a in o.inputs)
        out_b = sum(int(sizes[t]) for t in o.outputs if maker[t] == i)
        if (not o.pure or o.rng or name in lists["compute_intensive_ops"] or name in lists["random_ops"]
                or out_b * 4 < in_b):
            banned[i] = "always"
        elif name not in lists["recomputable_ops"]:
            banned[i] = "allowlist"
    # torch: materialized unless the tensor's op and every user's op are fusible ops
    # (its check is by op type, whatever the graph half the user is in)
    fusible = [base_name(o.name) in lists["fusible_ops"] for o in trace.ops]
    for i, o in enumerate(trace.ops):
        for a in o.inputs:
            if not fusible[i] or (maker[a] >= 0 and not fusible[int(maker[a])]):
                materialized[a] = True
    return ForwardGraph(maker, frozenset(wanted), dist, banned, materialized)


def min_cut(trace: Trace, g: ForwardGraph, allowlist: bool, dont_ban: frozenset[int] = frozenset()) -> frozenset[int]:
    """The saved set torch's ``solve_min_cut`` picks (tensor ids made in forward).

    Args:
        trace: the iteration.
        g: its :class:`ForwardGraph`.
        allowlist: ops outside torch's recomputable list stay banned.
        dont_ban: ops the knapsack lets be re-made.
    """
    import networkx as nx

    nx_graph = nx.DiGraph()
    sizes = trace.sizes
    for t in np.flatnonzero(g.maker >= 0).tolist():
        i = int(g.maker[t])
        why = g.banned.get(i)
        if why is not None and i not in dont_ban and (why == "always" or allowlist):
            nx_graph.add_edge("source", ("in", t), capacity=math.inf)
        if t in g.wanted:
            nx_graph.add_edge(("out", t), "sink", capacity=math.inf)
        d = g.dist[t]
        weight = int(sizes[t]) * 1.1 ** max(min(d, 100), 1) if d < math.inf else int(sizes[t]) * 1.1 ** 100
        if not g.materialized[t]:
            weight *= 2
        nx_graph.add_edge(("in", t), ("out", t), capacity=float(weight))
        for a in trace.ops[i].inputs:
            if g.maker[a] >= 0 and a != t:
                nx_graph.add_edge(("out", a), ("in", t), capacity=math.inf)
    if "sink" not in nx_graph or "source" not in nx_graph:
        # nothing banned: everything re-made from the inputs; nothing wanted: nothing saved
        return frozenset()
    _, (reachable, _) = nx.minimum_cut(nx_graph, "source", "sink")
    return frozenset(t for t in np.flatnonzero(g.maker >= 0).tolist()
                     if ("in", t) in reachable and ("out", t) not in reachable)


def dp_knapsack(memory: list[float], runtime: list[float], capacity: float) -> list[int]:
    """torch's quantised 0-1 knapsack: the items kept (most runtime within capacity).

    Sizes and capacity are rounded to 1/10,000; the backtrack starts at the full
    capacity and keeps item ``i`` where the best value changes with it."""
    q = [int(round(m * QUANT)) for m in memory]
    cap = int(round(max(capacity, 0.0) * QUANT))
    n = len(q)
    dp = np.zeros((n + 1, cap + 1), dtype=np.float32)  # float32 as torch's table
    for i in range(1, n + 1):
        w, v = q[i - 1], np.float32(runtime[i - 1])
        dp[i] = dp[i - 1]
        if w == 0:
            dp[i] = dp[i - 1] + v
        elif w <= cap:
            dp[i, w:] = np.maximum(dp[i - 1, w:], dp[i - 1, : cap + 1 - w] + v)
    kept = []
    j = cap
    for i in range(n, 0, -1):
        if dp[i, j] != dp[i - 1, j]:
            kept.append(i - 1)
            j -= q[i - 1]
    return sorted(kept)


def greedy_knapsack(memory: list[float], runtime: list[float], capacity: float) -> list[int]:
    """torch's greedy knapsack: by runtime per size, keep what still fits."""
    order = sorted(range(len(memory)), key=lambda i: runtime[i] / memory[i] if memory[i] else math.inf, reverse=True)
    used, kept = 0.0, []
    for i in order:
        if used + memory[i] <= capacity:
            used += memory[i]
            kept.append(i)
    return sorted(kept)


@dataclass(frozen=True)
class SavedChoice:
    """What ``activation_memory_budget`` picked on a trace.

    Attributes:
        saved: forward-made tensors saved for the backward.
        how: ``"trace"`` (B = 1), ``"inputs"`` (B = 0), ``"more aggressive"``,
            ``"aggressive"`` or ``"knapsack"``.
        ratio: its memory ratio (saved bytes over the B = 1 set's).
        knapsack_kept: with the knapsack, the banned ops it kept banned.
    """

    saved: frozenset[int]
    how: str
    ratio: float
    knapsack_kept: tuple[int, ...] = ()


def saved_bytes(trace: Trace, saved: frozenset[int]) -> int:
    return int(sum(int(trace.sizes[t]) for t in saved))


def choose_saved(trace: Trace, budget: float, solver: str = "dp", g: ForwardGraph | None = None) -> SavedChoice:
    """The saved set of ``activation_memory_budget = budget`` (see the module docstring).

    Raises:
        PolicyError: ``budget`` outside [0, 1] or an unknown solver.
    """
    if not 0.0 <= budget <= 1.0:
        raise PolicyError(f"compile_memory_budget: memory_budget {budget} must be in [0, 1]")
    if solver not in SOLVERS:
        raise PolicyError(f"compile_memory_budget: solver {solver!r} is not one of {', '.join(SOLVERS)}")
    g = g if g is not None else forward_graph(trace)
    full = g.wanted
    max_b = saved_bytes(trace, full)
    if budget == 1.0 or max_b == 0:
        return SavedChoice(full, "trace", 1.0)

    def ratio(s: frozenset[int]) -> float:
        return saved_bytes(trace, s) / max_b

    if budget == 0.0:
        # torch saves only the inputs; an impure op (none in torch's functional graphs)
        # still may not run twice: the cheapest cut with only those banned
        pure_banned = frozenset(i for i in g.banned if trace.ops[i].pure)
        inputs_only = min_cut(trace, g, allowlist=False, dont_ban=pure_banned)
        return SavedChoice(inputs_only, "inputs", ratio(inputs_only))

    more = min_cut(trace, g, allowlist=True)
    if ratio(more) < budget:
        return SavedChoice(more, "more aggressive", ratio(more))
    aggressive = min_cut(trace, g, allowlist=False)
    if ratio(aggressive) < budget:
        return SavedChoice(aggressive, "aggressive", ratio(aggressive))
    # the knapsack's items: ops banned under the aggressive options whose outputs lead
    # to the backward, largest first (impure ops are never un-banned)
    items = sorted(
        (i for i, why in g.banned.items() if why == "always" and trace.ops[i].pure
         and any(g.dist[t] < math.inf for t in trace.ops[i].outputs if g.maker[t] == i)),
        key=lambda i: (-sum(int(trace.sizes[t]) for t in trace.ops[i].outputs if g.maker[t] == i), i),
    )
    if not items:
        return SavedChoice(aggressive, "aggressive", ratio(aggressive))
    memory = [sum(int(trace.sizes[t]) for t in trace.ops[i].outputs if g.maker[t] == i) / max_b for i in items]
    runtime = [float(trace.ops[i].duration_s) for i in items]
    solve = dp_knapsack if solver == "dp" else greedy_knapsack
    kept = solve(memory, runtime, budget)
    dont_ban = frozenset(items[k] for k in range(len(items)) if k not in set(kept))
    chosen = min_cut(trace, g, allowlist=False, dont_ban=dont_ban)
    return SavedChoice(chosen, "knapsack", ratio(chosen), tuple(items[k] for k in kept))


def budget_plan(trace: Trace, budget_bytes: float, memory_budget: float, solver: str = "dp",
                g: ForwardGraph | None = None) -> tuple[Plan, int]:
    """The plan of one ``activation_memory_budget`` and its planned peak (bytes)."""
    g = g if g is not None else forward_graph(trace)
    choice = choose_saved(trace, memory_budget, solver, g)
    dropped = g.wanted - choice.saved
    chains = recompute_chains(trace, dropped, choice.saved) if dropped else ()
    curve = planned_device_bytes(trace, chains)
    peak = int(curve.max()) if len(curve) else 0
    meta = {
        "memory_budget": memory_budget, "solver": solver, "chosen_by": choice.how,
        "memory_ratio": choice.ratio, "saved_bytes": saved_bytes(trace, choice.saved),
        "saved_bytes_at_1": saved_bytes(trace, g.wanted), "recomputed_bytes": saved_bytes(trace, frozenset(dropped)),
        "recomputes": len(chains), "recompute_s": recompute_seconds(trace, chains), "planned_peak_bytes": peak,
        "knapsack_kept": len(choice.knapsack_kept),
    }
    return Plan(policy="compile_memory_budget", budget_bytes=budget_bytes, meta=meta, recomputes=chains), peak


@register("compile_memory_budget", options=OPTIONS)
def compile_memory_budget(trace: Trace, hardware: Hardware, options: PolicyOptions) -> Plan:
    """``torch.compile`` with ``activation_memory_budget``: torch's min cut and knapsack
    choose what the backward re-makes.

    Args:
        trace: the iteration (aten op names tell banned ops apart).
        hardware: the machine (only its name is used: recomputing moves nothing).
        options: see the module docstring.

    Raises:
        PolicyError: ``memory_budget`` outside [0, 1] (and not -1), or an unknown solver.
        PlanError: the plan at the chosen (or smallest) budget exceeds the device budget.

    Example:
        >>> make_plan("compile_memory_budget", trace, hw, budget="60%", memory_budget=0.5)  # doctest: +SKIP
    """
    solver = str(options.get("solver", "dp"))
    b = float(options.get("memory_budget", -1.0))
    if b != -1.0 and not 0.0 <= b <= 1.0:
        raise PolicyError(f"compile_memory_budget: memory_budget {b} must be in [0, 1] (or -1: sweep)")
    g = forward_graph(trace)
    sweep = SWEEP if b == -1.0 else (b,)
    last: tuple[Plan, int] | None = None
    for value in sweep:
        plan, peak = budget_plan(trace, options.budget_bytes, value, solver, g)
        if peak <= options.budget_bytes:
            plan.meta["swept"] = b == -1.0
            return plan
        last = (plan, peak)
        options.report(1.0 - value, f"memory_budget {value}")
    assert last is not None
    plan, _ = last
    curve = planned_device_bytes(trace, plan.recomputes)
    raise no_fit("compile_memory_budget", trace, hardware, options.budget_bytes,
                 f"at activation_memory_budget {plan.meta['memory_budget']} ({plan.meta['chosen_by']}, "
                 f"{plan.meta['recomputed_bytes']} bytes re-made)", curve)


__all__ = ["ForwardGraph", "SavedChoice", "budget_plan", "choose_saved", "dp_knapsack", "forward_graph",
           "greedy_knapsack", "min_cut"]
