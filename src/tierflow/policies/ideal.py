"""``ideal``: unlimited device memory, no transfers. Its step time is the sum of op
times, the reference every other policy's ratio is measured against."""

from __future__ import annotations

import math

from ..hardware import Hardware
from ..plan import Plan
from ..trace import Trace
from . import PolicyOptions, register


@register("ideal")
def ideal(trace: Trace, hardware: Hardware, options: PolicyOptions) -> Plan:
    return Plan(policy="ideal", moves=(), budget_bytes=math.inf)
