"""How long each training step took, without making the host wait for the GPU.

:class:`StepClock` is the one writer of ``RunStats.step_times_s`` and
``RunStats.step_time_s`` in the eager runtime. On the CPU a step's time is its wall
time. On CUDA it is the time between two events recorded on the compute stream at the
step's start and end, read once the end event has completed (at a later step's end, or
at the block's exit): NOTE: reading it at once would synchronize the host with the
GPU every step and remove the overlap the runtime exists for.

``step_time_s`` is the mean of the planned steps once there is one (the figure a user
compares with the prediction), else the mean of every step so far.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from .stats import RunStats


class StepClock:
    """Times the steps of one run and writes them into its stats.

    Args:
        device: the run's device (CUDA steps are timed with events).
        stats: the run's stats, whose step-time fields this clock alone writes.
    """

    def __init__(self, device: torch.device, stats: RunStats) -> None:
        self.device = device
        self.stats = stats
        self._t0 = 0.0
        self._t0_event: Any = None
        self._pending: deque[tuple[Any, Any, str]] = deque()  # CUDA: (start, end, kind) not yet read
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def start(self) -> None:
        """A step begins."""
        self._t0 = time.perf_counter()
        if self.device.type == "cuda":
            self._t0_event = torch.cuda.Event(enable_timing=True)
            self._t0_event.record(torch.cuda.current_stream(self.device))

    def wall(self) -> float:
        """Host seconds since the step began (what the host spent, not the GPU)."""
        return time.perf_counter() - self._t0

    def stop(self, kind: str) -> None:
        """The step began by :meth:`start` ended; ``kind`` is ``"planned"`` or ``"other"``."""
        if self.device.type != "cuda":
            self._add(time.perf_counter() - self._t0, kind)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        self._pending.append((self._t0_event, end, kind))
        self.collect(wait=False)

    def collect(self, wait: bool) -> None:
        """Read the CUDA steps whose end event completed (all of them with ``wait``)."""
        while self._pending and (wait or self._pending[0][1].query()):
            start, end, kind = self._pending.popleft()
            end.synchronize()  # (complete already, unless waiting at exit)
            self._add(start.elapsed_time(end) / 1e3, kind)

    def _add(self, seconds: float, kind: str) -> None:
        st = self.stats
        st.step_times_s.append(seconds)
        self._sums[kind] = self._sums.get(kind, 0.0) + seconds
        self._counts[kind] = self._counts.get(kind, 0) + 1
        if self._counts.get("planned"):
            st.step_time_s = self._sums["planned"] / self._counts["planned"]
        else:
            st.step_time_s = sum(self._sums.values()) / sum(self._counts.values())


class StepNesting:
    """Whether ``optimizer.step()`` is running, counting its nesting: an optimizer class
    whose step calls ``super().step()`` runs the step hooks twice (each class's step is
    wrapped by ``Optimizer``), and one step is the outermost pair. The one writer of
    this state; the run's step hooks call :meth:`enter` and :meth:`leave`.

    Example:
        >>> s = StepNesting()
        >>> s.enter(), s.enter(), s.in_step
        (True, False, True)
        >>> s.leave(), s.leave()
        (False, True)
    """

    def __init__(self) -> None:
        self._depth = 0
        self.in_step = False  # (read by the pager: state the step creates is evictable too)

    def enter(self) -> bool:
        """A step hook's pre-call; True for the outermost (the step begins)."""
        self._depth += 1
        if self._depth > 1:
            return False
        self.in_step = True
        return True

    def leave(self) -> bool:
        """A step hook's post-call; True when the outermost returned (the step ended)."""
        self._depth = max(0, self._depth - 1)
        return self._depth == 0

    def reset(self) -> None:
        """An iteration begins: a step that raised left its count behind."""
        self._depth = 0

    def ended(self) -> None:
        """The iteration ended: no step runs."""
        self.in_step = False
