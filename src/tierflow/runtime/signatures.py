"""A plan per iteration signature: loops whose batches change shape keep their plans.

An iteration's *signature* is what the loop feeds the model at the iteration's first
forward: the shape, dtype and device of every tensor among the forward's arguments
(and the non-tensor ones, which can change the ops: a flag, a length), plus whether the
model is in training mode. Batches of one signature run the same ops on tensors of the
same sizes, so one plan serves them all; a bucketing data loader gives a few
signatures, each seen again and again.

:class:`PlanCache` keeps the plans made so far, keyed by signature, least recently used
out past ``max_plans`` (``offload(..., max_plans=8)``, like ``torch.compile``'s
recompile limit). An iteration whose signature has a cached plan follows it from its
first op (the plan's start state is restored first: what it wants on the device,
what it wants away); one whose signature is new is profiled and planned once.

Shapes that never repeat. Planning costs a profiled iteration (every op recorded and
measured) and the policy's time, paid back only by the iterations that follow the
plan. When the cache is *churning* (the last :data:`CHURN_WINDOW` plans it made, or
``max_plans`` if fewer, were never followed: each signature was seen once), a new
signature is not
profiled at its first sighting: it runs on the runtime's pager, which keeps the budget
by itself (it makes room before each op for the bytes the op's meta kernel says it will
make, least recently used out), and is remembered; if it comes back, it is profiled and
planned then. Unless a cached plan *dominates* it (:func:`dominates`: the same
arguments, every tensor at least as large): then the iteration follows that plan from
its first op, each tensor no larger than the plan's, so the budget holds (a shorter
sequence under a longer one's plan). So unbucketed lengths cost the pager's step, never a plan that is thrown
away, and lengths that do repeat are still planned. The budget holds either way.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

#: The figures the run reports about the plan it follows, kept with each cached plan.
PLAN_STATS = ("predicted_step_time_s", "predicted_step_time_s_at_plan", "ideal_step_time_s", "policy",
              "plan_digest", "follow", "held_device_bytes", "plan_error")

DEFAULT_MAX_PLANS = 8
#: How many plans in a row made and never followed mean the shapes do not repeat.
CHURN_WINDOW = 4


def signature_of(args: tuple, kwargs: dict, training: bool) -> Hashable:
    """The signature of a forward's arguments: each tensor's shape, dtype and device,
    other leaves as they are where hashable (else their type).

    Example:
        >>> signature_of((torch.zeros(2, 3),), {}, True) == signature_of((torch.ones(2, 3),), {}, True)
        True
        >>> signature_of((torch.zeros(2, 3),), {}, True) == signature_of((torch.zeros(2, 4),), {}, True)
        False
    """
    leaves, spec = pytree.tree_flatten((args, kwargs))
    parts: list[Any] = [training, str(spec)]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            parts.append(("T", tuple(x.shape), x.dtype, x.device.type, x.requires_grad))
        else:
            try:
                hash(x)
                parts.append(x)
            except TypeError:
                parts.append(type(x).__name__)
    return tuple(parts)


def dominates(big: Hashable, small: Hashable) -> bool:
    """Whether signature ``big`` has the same arguments as ``small`` (structure,
    dtypes, devices, other values, mode) with every tensor at least as large in every
    dimension: the same ops, each tensor no larger, so ``big``'s plan keeps the budget
    for ``small`` (a departure, if the ops differ after all, is caught as usual).

    Example:
        >>> a = signature_of((torch.zeros(4, 40),), {}, True)
        >>> dominates(a, signature_of((torch.zeros(4, 24),), {}, True))
        True
        >>> dominates(signature_of((torch.zeros(4, 24),), {}, True), a)
        False
    """
    if not (isinstance(big, tuple) and isinstance(small, tuple)) or len(big) != len(small):
        return False
    for b, s in zip(big, small):
        if isinstance(b, tuple) and isinstance(s, tuple) and b[:1] == s[:1] == ("T",):
            if b[2:] != s[2:] or len(b[1]) != len(s[1]) or any(x < y for x, y in zip(b[1], s[1])):
                return False
        elif b != s:
            return False
    return big != small


def _elements(sig: Hashable) -> int:
    """Elements of a signature's tensors (the smallest dominating plan is chosen)."""
    n = 0
    for p in sig if isinstance(sig, tuple) else ():
        if isinstance(p, tuple) and p[:1] == ("T",):
            k = 1
            for d in p[1]:
                k *= d
            n += k
    return n


@dataclass
class CachedPlan:
    """One signature's plan: the plan as the executor follows it (a
    :class:`~.followed_plan.FollowedPlan`) and its figures (:data:`PLAN_STATS`)."""

    state: Any
    stats: dict[str, Any]
    followed: int = 0  # iterations that began with it after it was made


@dataclass
class PlanCache:
    """Plans by signature, least recently used out past ``max_plans``.

    Args:
        max_plans: how many plans to keep (at least 1).

    Raises:
        ValueError: ``max_plans`` below 1.

    Example:
        >>> c = PlanCache(2)
        >>> c.decide("a")
        'profile'
    """

    max_plans: int = DEFAULT_MAX_PLANS
    plans: OrderedDict[Hashable, CachedPlan] = field(default_factory=OrderedDict)
    seen_once: OrderedDict[Hashable, None] = field(default_factory=OrderedDict)  # pager-run, not planned
    made: deque = field(default_factory=deque)  # the last plans made (CachedPlan), newest last
    evicted: int = 0
    current: Hashable | None = None  # the signature whose plan the executor holds now

    def __post_init__(self) -> None:
        if not isinstance(self.max_plans, int) or self.max_plans < 1:
            raise ValueError(f"max_plans={self.max_plans!r}: expected an integer of at least 1")

    @property
    def churning(self) -> bool:
        """The last plans made (:data:`CHURN_WINDOW`, at most ``max_plans``) were never followed."""
        window = min(CHURN_WINDOW, self.max_plans)
        return len(self.made) >= window and all(p.followed == 0 for p in self.made)

    def decide(self, sig: Hashable) -> str | tuple[str, Hashable]:
        """What an iteration of signature ``sig`` does: ``"follow"`` a cached plan,
        ``"profile"`` (and plan), or, at a first sighting while churning,
        ``("dominated", big)`` (follow the cached plan of ``big``, which
        :func:`dominates` ``sig``) or ``"pager"``."""
        if sig in self.plans:
            self.plans.move_to_end(sig)
            return "follow"
        if self.churning and sig not in self.seen_once:
            self.seen_once[sig] = None
            while len(self.seen_once) > 4 * self.max_plans:
                self.seen_once.popitem(last=False)
            big = min((k for k in self.plans if dominates(k, sig)), key=_elements, default=None)
            if big is not None:
                self.plans.move_to_end(big)
                return ("dominated", big)
            return "pager"
        self.seen_once.pop(sig, None)
        return "profile"

    def switch(self, sig: Hashable) -> None:
        """The executor holds ``sig``'s plan now (or is about to profile ``sig``)."""
        self.current = sig

    def restart(self, sig: Hashable) -> None:
        """Forget every plan kept; ``sig`` is profiled next (ranks planning together)."""
        self.plans.clear()
        self.current = sig

    def discard_current(self) -> None:
        """The current signature's plan departed from its iteration: not to be followed again."""
        self.plans.pop(self.current, None)

    def refresh_current(self, now: CachedPlan) -> None:
        """The current signature's plan as the executor holds it now (its retimed trace
        and figures), kept with its count of iterations followed."""
        kept = self.plans.get(self.current)
        if kept is not None:
            kept.state, kept.stats = now.state, now.stats

    def followed(self, sig: Hashable) -> None:
        """An iteration of ``sig`` began with its cached plan."""
        p = self.plans.get(sig)
        if p is not None:
            p.followed += 1

    def store(self, sig: Hashable, plan: CachedPlan) -> None:
        """Keep ``plan`` for ``sig`` (a new plan of a known signature replaces its old one)."""
        self.plans.pop(sig, None)
        self.plans[sig] = plan
        self.made.append(plan)
        while len(self.made) > min(CHURN_WINDOW, self.max_plans):
            self.made.popleft()
        while len(self.plans) > self.max_plans:
            self.plans.popitem(last=False)
            self.evicted += 1


def snapshot(run: Any) -> CachedPlan:
    """The plan ``run`` follows now, and its figures."""
    return CachedPlan(run._followed, {k: getattr(run.stats, k) for k in PLAN_STATS})


def restore_stats(stats: Any, cached: CachedPlan) -> None:
    """Make ``cached``'s figures the ones ``stats`` reports (the plan itself is made the
    run's by ``Run._take_plan``)."""
    for k, v in cached.stats.items():
        setattr(stats, k, v)


__all__ = ["CHURN_WINDOW", "DEFAULT_MAX_PLANS", "PLAN_STATS", "CachedPlan", "PlanCache", "dominates",
           "restore_stats", "signature_of", "snapshot"]
