"""Plans the runtime itself makes, for checking it rather than for speed.

:func:`roundtrip_plan` sends every tensor the runtime can move (parameters, gradients,
optimizer state, saved activations) off the device in *every* gap between two uses,
alternating the tiers it is given, and fetches it back just before the next use. It is
the worst schedule for speed and the best for testing: every kind of tensor makes the
round trip through every tier, every iteration, and a bitwise-equal loss proves the
bytes came back. It is a planned plan and passes :func:`tierflow.plan.validate`.
"""

from __future__ import annotations

from ..hardware import Hardware
from ..plan import Move, Plan
from ..trace import Trace

MOVABLE_KINDS = ("parameter", "gradient", "optimizer_state", "activation")


def roundtrip_plan(trace: Trace, hardware: Hardware, budget: float | None = None,
                   tiers: tuple[str, ...] | None = None) -> Plan:
    """Evict every movable keyed tensor in each of its gaps; tiers alternate per kind.

    Args:
        trace: the iteration. hardware: must have the tiers named.
        budget: recorded as the plan's budget (default: the device's capacity).
        tiers: off-device tiers to alternate between (default: all of the hardware's
            offload tiers, fastest first).

    Example:
        >>> from tierflow.synthetic import synthetic_gpt  # doctest: +SKIP
    """
    tiers = tuple(tiers or hardware.offload_tiers)
    moves: list[Move] = []
    turn: dict[str, int] = {}
    n = trace.n_ops
    for g in trace.gaps:
        info = trace.tensors[g.tensor]
        if info.kind not in MOVABLE_KINDS or not info.key:
            continue
        k = turn.get(info.kind, 0)
        turn[info.kind] = k + 1
        tier = tiers[k % len(tiers)]
        fetch_after = (g.before_op - 1) % n
        moves.append(Move("evict", g.tensor, g.after_op, tier))
        moves.append(Move("prefetch", g.tensor, fetch_after, tier, g.before_op))
    return Plan(policy="roundtrip", moves=tuple(moves),
                budget_bytes=hardware.device_capacity if budget is None else budget,
                meta={"tiers": list(tiers)})


__all__ = ["MOVABLE_KINDS", "roundtrip_plan"]
