"""``lru``: G10's *Base UVM* baseline. Nothing is planned: every tensor that is not on the
device when an op needs it faults in on demand, and room is made by evicting the least
recently used tensors. The simulator's reactive mode is exactly this pager.

Like UVM, and like G10's model of it, the pager does not know liveness: a dead tensor's
pages stay allocated until evicted (and are written back). At its next birth the op
overwrites it; by default the dead contents are then dropped rather than fetched back
(``refetch_dead=True`` fetches them, as G10's transformer runs do; see BENCHMARKS.md).
``liveness=True`` gives a liveness-aware pager instead.

Options:
    liveness (bool): free tensors after their last use (default False, as G10).
    refetch_dead (bool): fetch a dead tensor's old contents at its next birth (default False).
    headroom (float): share of the budget the pager keeps free (default 0.05).
"""

from __future__ import annotations

from ..hardware import Hardware
from ..plan import Plan
from ..trace import Trace
from . import PolicyOption, PolicyOptions, register

OPTIONS = (
    PolicyOption("liveness", bool, False, "free tensors after their last use (G10's Base UVM does not)"),
    PolicyOption("refetch_dead", bool, False, "fetch a dead tensor's old contents at its next birth"),
    PolicyOption("headroom", float, 0.05, "share of the budget the pager keeps free"),
)


@register("lru", OPTIONS)
def lru(trace: Trace, hardware: Hardware, options: PolicyOptions) -> Plan:
    return Plan(
        policy="lru",
        moves=(),
        budget_bytes=options.budget_bytes,
        reactive=True,
        frees_dead=bool(options.get("liveness", False)),
        refetch_dead=bool(options.get("refetch_dead", False)),
        headroom=float(options.get("headroom", 0.05)),
    )
