"""Policies: functions ``(trace, hardware, options) -> Plan``, registered by name.

Each policy lives in its own module, imported only when asked for, so a policy that
needs a solver does not slow down ``import tierflow``. Every policy honours a device
budget (default: the device's capacity) and refuses, with the numbers, a budget below
the minimum working set (the largest set of tensors one op needs at once).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import PlanError, PolicyError
from ..hardware import Hardware
from ..plan import Plan
from ..trace import Trace
from ..units import fmt_bytes, parse_bytes

PolicyFn = Callable[[Trace, Hardware, "PolicyOptions"], Plan]

# name -> (module, one-line description). Modules register themselves on import.
_MODULES: dict[str, tuple[str, str]] = {
    "ideal": ("tierflow.policies.ideal", "unlimited device memory: the reference step time"),
    "lru": ("tierflow.policies.lru", "G10's Base UVM: on-demand faults, LRU eviction"),
    "deepum": ("tierflow.policies.deepum", "G10's DeepUM+: UVM plus prefetch of the op 8 ahead"),
    "g10": ("tierflow.policies.g10", "G10's smart tensor migration across host and SSD"),
    "flashneuron": ("tierflow.policies.flashneuron", "FlashNeuron: forward activations to SSD, back in backward"),
    "vdnn": ("tierflow.policies.vdnn", "vDNN: activations to host after forward use, prefetched a layer ahead"),
    "singa": ("tierflow.policies.singa", "SINGA: swap blocks idle across the peak to host (ranked selection)"),
    "myelin": ("tierflow.policies.myelin", "Myelin: model states parked in host memory between uses"),
    "deeptm": ("tierflow.policies.deeptm", "DeepTM: page-aggregated, heat-ranked ILP placement, RL-tuned weights"),
    "tierflow": ("tierflow.policies.tierflow", "ours: all tiers and kinds, bandwidth-aware, refined with the simulator"),
}
_REGISTRY: dict[str, PolicyFn] = {}


@dataclass(frozen=True)
class PolicyOptions:
    """What every policy receives.

    Attributes:
        budget_bytes: device bytes the plan may use.
        seed: for policies with randomness (plans are a pure function of the inputs).
        extra: policy-specific knobs (e.g. ``lookahead`` for deepum).
    """

    budget_bytes: float
    seed: int = 0
    extra: dict[str, Any] | None = None

    def get(self, key: str, default: Any) -> Any:
        return (self.extra or {}).get(key, default)


def register(name: str) -> Callable[[PolicyFn], PolicyFn]:
    def deco(fn: PolicyFn) -> PolicyFn:
        _REGISTRY[name] = fn
        return fn

    return deco


def policy_names() -> list[str]:
    """The policies this build has (a registered name whose module is not present yet is
    left out)."""
    return [n for n, (mod, _) in _MODULES.items() if importlib.util.find_spec(mod) is not None]


def describe(name: str) -> str:
    return _MODULES[name][1]


def get_policy(name: str) -> PolicyFn:
    if name not in policy_names():
        raise PolicyError(f"unknown policy {name!r} (policies: {', '.join(policy_names())})")
    if name not in _REGISTRY:
        importlib.import_module(_MODULES[name][0])
    return _REGISTRY[name]


def min_working_set(trace: Trace) -> tuple[int, int]:
    """(bytes, op): the largest set of tensors a single op needs on the device."""
    ws = trace.working_set_bytes
    op = int(ws.argmax()) if len(ws) else 0
    return (int(ws[op]) if len(ws) else 0), op


def resolve_budget(trace: Trace, hardware: Hardware, budget: str | int | float | None) -> float:
    """The device budget in bytes: ``None`` = the device's capacity; a size (``"20GiB"``)
    or a share of the trace's unconstrained peak (``"30%"``).

    Raises:
        PolicyError: the budget is not a size, or exceeds the device.
        PlanError: no plan can fit (the budget is below the minimum working set).
    """
    cap = hardware.device_capacity
    if budget is None:
        value = cap
    elif isinstance(budget, str) and budget.strip().endswith("%"):
        try:
            share = float(budget.strip()[:-1]) / 100
        except ValueError:
            raise PolicyError(f"budget {budget!r}: not a percentage") from None
        value = share * trace.peak_live_bytes
    else:
        try:
            value = float(parse_bytes(budget))
        except ValueError as e:
            raise PolicyError(f"budget: {e}") from None
    if value > cap:
        raise PolicyError(
            f"budget {fmt_bytes(value)} exceeds {hardware.name}'s device memory ({fmt_bytes(cap)})"
        )
    need, op = min_working_set(trace)
    if value < need:
        raise PlanError(
            f"no plan can fit in {fmt_bytes(value)} ({int(value)} bytes): op {op} "
            f"({trace.ops[op].name}) alone needs {fmt_bytes(need)} ({need} bytes), the minimum working set"
        )
    return value


def make_plan(
    name: str,
    trace: Trace,
    hardware: Hardware,
    budget: str | int | float | None = None,
    seed: int = 0,
    **extra: Any,
) -> Plan:
    """Run policy ``name``. See :func:`resolve_budget` for ``budget``."""
    fn = get_policy(name)
    value = resolve_budget(trace, hardware, budget) if name != "ideal" else hardware.device_capacity
    return fn(trace, hardware, PolicyOptions(value, seed, extra))


__all__ = [
    "PolicyOptions",
    "describe",
    "get_policy",
    "make_plan",
    "min_working_set",
    "policy_names",
    "register",
    "resolve_budget",
]
