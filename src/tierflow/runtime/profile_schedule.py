"""When the eager runtime profiles an iteration, and why: one component owns the answer.

:class:`ProfileSchedule` holds whether the next iteration is to be profiled (and
re-planned), the reason the next plan will be counted under
(``RunStats.plans_by_reason``), and whether the next planned iteration must first put
the tensors where its plan starts them (after a profile, a restored cached plan, or an
iteration run on the pager). The executor's plan choice (``Run._choose_plan``,
``end_iteration``) and the profiler (``Profiling._check_held``) tell it what happened
through its methods; nothing else writes it.
"""

from __future__ import annotations


class ProfileSchedule:
    """Whether the next iteration is profiled, why, and whether the next planned one
    restores its plan's start state.

    Example:
        >>> s = ProfileSchedule()
        >>> s.need_profile, s.why
        (True, 'first')
        >>> s.plan_made()
        'first'
        >>> s.need_profile, s.why, s.take_start_state()
        (False, 'departure', True)
        >>> s.profile("held"); s.need_profile, s.why
        (True, 'held')
    """

    def __init__(self) -> None:
        self.need_profile = True  # the next iteration is profiled and planned
        self.why = "first"  # the reason the next plan is counted under (stats.plans_by_reason)
        self._start_state = False  # the next planned iteration puts tensors where its plan starts them

    def profile(self, why: str | None = None) -> None:
        """Profile the next iteration (``why``: the reason its plan will count under;
        None: the one set already, "departure" after a plan was made)."""
        self.need_profile = True
        if why is not None:
            self.why = why

    def plan_made(self) -> str:
        """A plan was made from the profiled iteration: its reason (the next plan's is
        "departure" unless said otherwise); the next planned iteration starts from the
        plan's start state."""
        why, self.why = self.why, "departure"
        self.need_profile = False
        self._start_state = True
        return why

    def not_planned(self) -> None:
        """The profiled iteration could not be planned from (or the ranks did not all
        profile it): the next iteration is profiled again."""
        self.need_profile = True

    def follow_cached(self) -> None:
        """A cached plan is restored for the next iteration: no profile; it starts from
        the plan's start state."""
        self.need_profile = False
        self._start_state = True

    def after_pager(self) -> None:
        """The next iteration runs on the pager: the planned one after it restores its
        plan's start state."""
        self._start_state = True

    def take_start_state(self) -> bool:
        """Whether a planned iteration beginning now restores its plan's start state
        (asked once: then False until a plan is made or restored again)."""
        due, self._start_state = self._start_state, False
        return due


__all__ = ["ProfileSchedule"]
