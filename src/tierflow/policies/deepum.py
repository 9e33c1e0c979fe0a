"""``deepum``: G10's *DeepUM+* baseline. UVM paging as in ``lru``, plus a prefetcher that,
as op ``i`` starts, asks for the tensors of op ``i + lookahead`` (8 in G10's runs); a
prefetch that finds no room evicts least recently used tensors, as a UVM prefetch does,
but never those of the next op or of the op it prefetches for.

DeepUM+ is DeepUM given the tensors' liveness: unlike ``lru``, dead tensors are freed
rather than written back, which is what brings its traffic down to G10's figures.

Options:
    lookahead (int): how many ops ahead to prefetch (default 8).
    liveness (bool): free tensors after their last use (default True).
    headroom (float): share of the budget the pager keeps free (default 0.05).
"""

from __future__ import annotations

from ..hardware import Hardware
from ..plan import Move, Plan
from ..trace import Trace
from . import PolicyOption, PolicyOptions, register

OPTIONS = (
    PolicyOption("lookahead", int, 8, "how many ops ahead the prefetcher asks for tensors"),
    PolicyOption("liveness", bool, True, "free tensors after their last use"),
    PolicyOption("headroom", float, 0.05, "share of the budget the pager keeps free"),
)


@register("deepum", OPTIONS)
def deepum(trace: Trace, hardware: Hardware, options: PolicyOptions) -> Plan:
    k = int(options.get("lookahead", 8))
    n = trace.n_ops
    persistent = trace.persistent
    first = trace.first_use
    moves = []
    for i in range(n):
        target = (i + k) % n
        wraps = i + k >= n
        issue_after = (i - 1) % n  # "as op i starts" = when op i-1 ends
        for t in trace.op_tensors[target]:
            # Only tensors that exist before the target op can be prefetched: persistent
            # ones, or (within the iteration) those born earlier.
            if persistent[t] or (not wraps and first[t] < target and first[t] <= i - 1):
                moves.append(Move("prefetch", t, issue_after, None, target))
    return Plan(
        policy="deepum",
        moves=tuple(moves),
        budget_bytes=options.budget_bytes,
        reactive=True,
        frees_dead=bool(options.get("liveness", True)),
        headroom=float(options.get("headroom", 0.05)),
        meta={"lookahead": k},
    )
