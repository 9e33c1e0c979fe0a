"""The device bytes the eager runtime accounts against the budget, and their peak.

:class:`DeviceLedger` is the one writer of these figures: the storages the runtime tracks
add their bytes when they appear or come back to the device and remove them when they
die or leave (:mod:`.storages`, :mod:`.moves`, :mod:`.recompute`, :mod:`.host_step`);
everyone else reads them. In CPU mode the ledger is all there is (the "device" is RAM);
on CUDA ``torch.cuda.max_memory_allocated`` is reported beside it.

NOTE: on CUDA an evicted storage's bytes stay taken until the copy out has read them (the
caching allocator keeps the block from reuse until the copy's stream has passed,
``record_stream``): they count against the budget until that copy completes, as the
simulator holds an eviction's bytes until it lands (:meth:`DeviceLedger.leave`).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any


class DeviceLedger:
    """Accounted device bytes: resident storages and those still leaving; the peak.

    Attributes:
        used: bytes accounted on the device now (resident, and leaving on CUDA).
        leaving: ``(event, bytes)`` of copies out still reading their storage (CUDA; in
            the order they were issued, which is the order they complete: one stream).
        leaving_bytes: the sum of ``leaving``'s bytes.
        peak: the most ``used`` since the peak was last started (an iteration's, or the
            ops' between two iterations).

    Example:
        >>> led = DeviceLedger()
        >>> led.add(100); led.note_peak(); led.remove(40)
        >>> led.used, led.peak
        (60, 100)
    """

    __slots__ = ("used", "leaving", "leaving_bytes", "peak")

    def __init__(self) -> None:
        self.used = 0
        self.leaving: deque[tuple[Any, int]] = deque()
        self.leaving_bytes = 0
        self.peak = 0

    def add(self, n: int) -> None:
        """``n`` more bytes on the device (negative: fewer; a storage resized)."""
        self.used += n

    def remove(self, n: int) -> None:
        """``n`` bytes gone from the device (a storage died, was freed or left at once)."""
        self.used -= n

    def leave(self, event: Any, n: int) -> None:
        """A storage of ``n`` bytes was shrunk while the copy ``event`` still reads them
        (None: the copy is done, the bytes are gone now)."""
        if event is None:
            self.used -= n
        else:
            self.leaving.append((event, n))
            self.leaving_bytes += n

    def retire_leaving(self, need: int | None = None, budget: float = 0.0, *, every: bool = False,
                       on_wait: Callable[[], None] | None = None) -> None:
        """Stop counting the bytes of copies out that have completed. With ``need``:
        block on the oldest still running until ``need`` more bytes fit ``budget``
        (``on_wait`` is called before each such wait); ``every``: on all of them (not
        counted: the caller waits by design)."""
        lv = self.leaving
        while lv:
            ev, n = lv[0]
            if not ev.query():
                if not (every or (need is not None and self.used + need > budget)):
                    break
                if not every and on_wait is not None:
                    on_wait()
                ev.synchronize()
            lv.popleft()
            self.used -= n
            self.leaving_bytes -= n

    def note_peak(self, extra: int = 0) -> None:
        """The peak is at least what is used now, plus ``extra`` bytes in use beside it
        (a replay's temporaries)."""
        if self.used + extra > self.peak:
            self.peak = self.used + extra

    def start_peak(self) -> None:
        """An iteration begins: its peak starts at what is used now."""
        self.peak = self.used

    def clear_peak(self) -> None:
        """An iteration ended: the ops until the next one count from zero."""
        self.peak = 0

    @contextlib.contextmanager
    def peak_kept(self) -> Iterator[None]:
        """For a probe that runs scratch ops through the runtime: the peak as it was
        afterwards (the probe's bytes are not the run's)."""
        peak = self.peak
        try:
            yield
        finally:
            self.peak = peak


__all__ = ["DeviceLedger"]
