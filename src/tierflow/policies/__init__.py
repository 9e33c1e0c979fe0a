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

import numpy as np

from ..budget import Budget
from ..errors import PlanError, PolicyError
from ..hardware import Hardware
from ..plan import Plan
from ..trace import Trace
from ..units import fmt_bytes

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
    # the peers users run today, in the same vocabulary (recompute and host steps)
    "checkpoint": ("tierflow.policies.checkpoint", "torch.utils.checkpoint around every block: recompute it in backward"),
    "selective": ("tierflow.policies.selective", "selective activation checkpointing: save matmul/attention outputs, recompute the rest"),
    "save_on_cpu": ("tierflow.policies.save_on_cpu", "torch.autograd.graph.save_on_cpu: saved activations to host, back at unpack"),
    "offload_activations": ("tierflow.policies.offload_activations", "torchtune OffloadActivations: activations to pinned host on a side stream"),
    "zero_offload": ("tierflow.policies.zero_offload", "DeepSpeed ZeRO-Offload: gradients and optimizer state on the host, update there"),
    "zero_offload+checkpoint": ("tierflow.policies.zero_offload", "ZeRO-Offload with activation checkpointing, as its users run it"),
    "zero_infinity": ("tierflow.policies.zero_infinity", "DeepSpeed ZeRO-Infinity: parameters and optimizer state offloaded, fetched ahead"),
    # torch.compile's own memory knobs (issue 30)
    "compile_memory_budget": ("tierflow.policies.compile_memory_budget", "torch.compile's activation_memory_budget: min-cut saved set, knapsack over banned ops"),
    "compile_offloading": ("tierflow.policies.compile_offloading", "torch.compile's enable_activation_offloading: marked saved tensors to host after last forward use"),
}
_REGISTRY: dict[str, PolicyFn] = {}
_OPTIONS: dict[str, tuple[PolicyOption, ...]] = {}
_HOST_OPTIMIZER: set[str] = set()


@dataclass(frozen=True)
class PolicyOption:
    """One knob a policy takes through ``--set NAME=VALUE`` or ``make_plan(..., NAME=VALUE)``.

    Attributes:
        name: the key.
        type: ``int``, ``float``, ``str`` or ``bool``.
        default: its value when not given.
        help: one line saying what it changes.
        choices: the allowed values, where only a few are.
    """

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class PolicyOptions:
    """What every policy receives.

    Attributes:
        budget_bytes: device bytes the plan may use.
        seed: for policies with randomness (plans are a pure function of the inputs).
        extra: policy-specific knobs (e.g. ``lookahead`` for deepum).
        progress: where a slow policy reports how far it is, as ``progress(done,
            what)`` with ``done`` in [0, 1]; None: nobody listens. Library code never
            prints; the CLI passes a progress bar here.
    """

    budget_bytes: float
    seed: int = 0
    extra: dict[str, Any] | None = None
    progress: Callable[[float, str], None] | None = None

    def get(self, key: str, default: Any) -> Any:
        return (self.extra or {}).get(key, default)

    def report(self, done: float, what: str = "") -> None:
        """Tell the listener (if any) that ``done`` (0-1) of the planning is over."""
        if self.progress is not None:
            self.progress(min(max(float(done), 0.0), 1.0), what)


def register(
    name: str, options: tuple[PolicyOption, ...] = (), host_optimizer: bool = False
) -> Callable[[PolicyFn], PolicyFn]:
    """Register ``fn`` as policy ``name`` taking ``options`` (every knob it reads from
    :class:`PolicyOptions.extra` must be declared here). ``host_optimizer``: the policy
    runs every optimizer update on the host (a :class:`~tierflow.plan.HostStep` per
    parameter, as ZeRO-Offload does), so the optimizer ops' working sets do not bound
    its budget (see :func:`resolve_budget`)."""

    def deco(fn: PolicyFn) -> PolicyFn:
        _REGISTRY[name] = fn
        _OPTIONS[name] = tuple(options)
        if host_optimizer:
            _HOST_OPTIMIZER.add(name)
        return fn

    return deco


def policy_options(name: str) -> tuple[PolicyOption, ...]:
    """The options policy ``name`` declares (imports its module)."""
    get_policy(name)
    return _OPTIONS.get(name, ())


def check_options(name: str, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` checked against the options policy ``name`` declares, each coerced to
    its declared type (text, as ``--set`` gives it, is parsed).

    Raises:
        PolicyError: an unknown policy, a key it does not declare (the message lists
            its options), or a value of the wrong type or outside the choices.

    Example:
        >>> check_options("deepum", {"lookahead": "4"})
        {'lookahead': 4}
    """
    from ._options import check

    return check(name, policy_options(name), values)


def options_from_settings(names: list[str], settings: list[str]) -> dict[str, dict[str, Any]]:
    """The options each policy of ``names`` gets from ``--set`` items, checked.

    ``KEY=VALUE`` goes to every policy in ``names`` that declares ``KEY`` (at least one
    must); ``POLICY.KEY=VALUE`` to that policy only (which must be in ``names`` and
    declare ``KEY``).

    Raises:
        PolicyError: a malformed item, a key no named policy declares, or a bad value;
            the message names the policies' options.

    Example:
        >>> options_from_settings(["lru", "deepum"], ["lookahead=4", "lru.headroom=0.1"])
        {'lru': {'headroom': 0.1}, 'deepum': {'lookahead': 4}}
    """
    from ._options import describe_options, split_settings

    out: dict[str, dict[str, Any]] = {n: {} for n in names}
    for policy, key, text in split_settings(settings):
        if policy is not None:
            if policy not in names:
                raise PolicyError(f"--set {policy}.{key}: {policy!r} is not among the policies run here "
                                  f"({', '.join(names)})")
            targets = [policy]
        else:
            targets = [n for n in names if any(o.name == key for o in policy_options(n))]
            if not targets:
                if len(names) == 1:
                    targets = names  # check_options says what the policy takes
                else:
                    said = "; ".join(describe_options(n, policy_options(n)) for n in names)
                    raise PolicyError(f"no policy here has option {key!r}: {said}")
        for n in targets:
            out[n].update(check_options(n, {key: text}))
    return out


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


def min_working_set(trace: Trace, host_optimizer: bool = False) -> tuple[int, int]:
    """(bytes, op): the largest set of tensors a single op needs on the device; with
    ``host_optimizer``, of the ops outside the optimizer phase (which then runs on the
    host)."""
    ws = trace.working_set_bytes
    if host_optimizer:
        ws = np.where([o.phase == "optimizer" for o in trace.ops], 0, ws) if len(ws) else ws
    op = int(ws.argmax()) if len(ws) else 0
    return (int(ws[op]) if len(ws) else 0), op


def resolve_budget(
    trace: Trace, hardware: Hardware, budget: str | int | float | None, host_optimizer: bool = False
) -> float:
    """The device budget in bytes: ``None`` = the device's capacity; a size (``"20GiB"``)
    or a share of the trace's unconstrained peak (``"30%"``). ``host_optimizer``: the
    policy runs the optimizer step on the host, so the minimum working set is that of
    the other ops.

    Raises:
        PolicyError: the budget is not a size, or exceeds the device.
        PlanError: no plan can fit (the budget is below the minimum working set).
    """
    cap = hardware.device_capacity
    if budget is None:
        value = cap
    else:
        parsed = Budget.parse(budget)
        value = parsed.share * trace.peak_live_bytes if parsed.share is not None else float(parsed.bytes)
    if value > cap:
        raise PolicyError(
            f"budget {fmt_bytes(value)} exceeds {hardware.name}'s device memory ({fmt_bytes(cap)})"
        )
    need, op = min_working_set(trace, host_optimizer)
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
    progress: Callable[[float, str], None] | None = None,
    **extra: Any,
) -> Plan:
    """Run policy ``name``.

    Args:
        name: a policy (see :func:`policy_names`).
        trace, hardware: what to plan for.
        budget: see :func:`resolve_budget`.
        seed: for policies with randomness.
        progress: called as ``progress(done, what)`` (``done`` in [0, 1]) by policies
            that take seconds (``tierflow``, ``deeptm``); others never call it.
        extra: the policy's options (:func:`policy_options`), checked by
            :func:`check_options` before any planning.

    Raises:
        PolicyError: an unknown policy, or an option it does not declare or a bad value.
        PlanError: no plan fits the budget.
    """
    fn = get_policy(name)
    extra = check_options(name, extra)
    if name == "ideal":
        value = hardware.device_capacity
    else:
        value = resolve_budget(trace, hardware, budget, host_optimizer=name in _HOST_OPTIMIZER)
    return fn(trace, hardware, PolicyOptions(value, seed, extra, progress))


def trace_identity(trace: Trace) -> dict[str, Any]:
    """What a saved plan records of the trace it was made for (``meta["trace"]``):
    enough to refuse a plan made for another trace, whose ids would mean other tensors."""
    return {"name": trace.name, "ops": trace.n_ops, "tensors": trace.n_tensors}


def replan(
    name: str,
    trace: Trace,
    hardware: Hardware,
    incumbent: Plan,
    budget: str | int | float | None = None,
    seed: int = 0,
    progress: Callable[[float, str], None] | None = None,
    **extra: Any,
) -> Plan:
    """Plan with policy ``name``, but keep ``incumbent`` where it is at least as fast here.

    A planner chooses from the machine's figures, so after a change of hardware (faster
    links, more host memory) its new plan can be slower than the one already in use:
    in 0.3-0.8% of random small cases for ``g10``, ``deeptm`` and ``tierflow``
    (BENCHMARKS.md, "Robustness, measured"). This plans anew, simulates both plans on
    ``hardware`` and returns the faster one, the incumbent on a tie (no churn for
    nothing). A planned incumbent made for a weaker machine was never slower on the
    better one in 2,000 random cases per policy (``benchmarks/robustness.py
    --same-plan``), so with it re-planning for an upgrade did not lose there; a reactive
    one (hints to the demand pager) can be, as the pager's choices depend on timing.

    Args:
        name, trace, hardware, budget, seed, progress, extra: as for :func:`make_plan`.
        incumbent: the plan in use, made for this same trace (its tensor and op ids must
            mean the same tensors and ops; a plan that records its trace in
            ``meta["trace"]``, as ``tierflow plan`` writes, is checked against it). It is
            compared only if it is for this trace, validates against ``trace`` and
            ``hardware`` and its budget is within this one; otherwise the new plan is
            returned and ``meta["incumbent"]["rejected"]`` says why.

    Returns:
        The faster plan, its ``meta["incumbent"]`` = ``{"kept", "new_step_s",
        "incumbent_step_s", "rejected"}`` (the incumbent's step is ``None`` if it was
        rejected).

    Raises:
        PlanError, PolicyError: as :func:`make_plan` (the incumbent never raises).

    Example:
        >>> from tierflow import load_hardware
        >>> from tierflow.synthetic import gpt_trace
        >>> hw = load_hardware("rtx4090-24g")
        >>> tr = gpt_trace(hw, layers=2, d_model=256, batch=2, seq=128)
        >>> budget = (min_working_set(tr)[0] + tr.peak_live_bytes) // 2
        >>> old = make_plan("deepum", tr, hw, budget=budget)
        >>> new = replan("g10", tr, hw, old, budget=budget)
        >>> sorted(new.meta["incumbent"])
        ['incumbent_step_s', 'kept', 'new_step_s', 'rejected']
    """
    import dataclasses

    from ..plan import validate
    from ..simulate import simulate

    def step(plan: Plan) -> float:
        return simulate(trace, hardware, plan).time_s  # inf where the plan cannot run

    new = make_plan(name, trace, hardware, budget, seed, progress, **extra)
    new_s = step(new)
    rejected = None
    made_for = incumbent.meta.get("trace")
    if made_for is not None and made_for != trace_identity(trace):
        rejected = f"it was made for another trace ({made_for}, this one is {trace_identity(trace)})"
    elif incumbent.budget_bytes > new.budget_bytes:
        rejected = (f"its budget ({fmt_bytes(incumbent.budget_bytes)}) is above this one "
                    f"({fmt_bytes(new.budget_bytes)})")
    else:
        try:
            validate(incumbent, trace, hardware)
        except PlanError as e:
            rejected = str(e)
    old_s = None if rejected else step(incumbent)
    keep = old_s is not None and old_s <= new_s
    info = {"kept": keep, "new_step_s": new_s, "incumbent_step_s": old_s, "rejected": rejected}
    chosen = incumbent if keep else new
    return dataclasses.replace(chosen, meta={**chosen.meta, "incumbent": info})


__all__ = [
    "PolicyOption",
    "PolicyOptions",
    "check_options",
    "describe",
    "get_policy",
    "make_plan",
    "min_working_set",
    "options_from_settings",
    "policy_names",
    "policy_options",
    "register",
    "replan",
    "resolve_budget",
    "trace_identity",
]
