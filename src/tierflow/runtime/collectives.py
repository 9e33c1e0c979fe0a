"""Collectives in flight: what each one pins on the device until its ``Work`` is over.

A collective (an all-reduce, FSDP2's all-gather) returns before its bytes are used up: a
gloo thread or an NCCL kernel still reads and writes them. :class:`InFlight` keeps, per
collective, its ``Work`` handles, the storages it pinned (``_Entry.pins``) and those it
writes, and unpins them once it is over; it is the only writer of that list and of the
pin counts (the moves ask :meth:`InFlight.unpin` before they evict a pinned storage).
"""

from __future__ import annotations

from typing import Any

from .storages import _Entry


class InFlight:
    """The collectives still running and what they pinned.

    Attributes:
        records: ``(works, pinned, written)`` per collective, oldest first. The list is
            changed in place, never replaced: the executor reads it on every op to see
            whether there is anything to reap.

    Example:
        >>> flight = InFlight()
        >>> flight.reap(), bool(flight.records)
        (None, False)
    """

    def __init__(self) -> None:
        self.records: list[tuple[list[Any], list[_Entry], list[_Entry]]] = []

    def pin(self, works: list[Any], entries: list[_Entry], written: list[_Entry]) -> None:
        """A collective on ``entries`` (``written``: those it writes) just returned: pin
        them until ``works`` complete (no ``Work``: for the storages' life)."""
        for e in entries:
            e.pins += 1
            e.touched = False
        if works:
            self.records.append((works, entries, written))

    def unpin(self, e: _Entry) -> bool:
        """Try to free ``e`` of the collectives that pinned it: those that completed
        have; if the program used ``e`` since (a program waits on a collective before
        it uses the result), wait on them too: that returns at once. Whether ``e`` is
        free now."""
        self.records[:] = [r for r in self.records
                           if not self._release(r, force=e.touched and any(x is e for x in r[1]))]
        return e.pins == 0

    def reap(self) -> None:
        """Unpin what the collectives that are over pinned."""
        if self.records:
            self.records[:] = [r for r in self.records if not self._release(r)]

    def clear(self) -> None:
        """Forget them all (the block is closing)."""
        self.records.clear()

    @staticmethod
    def _release(rec: tuple[list[Any], list[_Entry], list[_Entry]], force: bool = False) -> bool:
        """Unpin what an in-flight collective pinned, if it is over: its ``Work`` says
        it completed, or the program used a storage the collective writes (a program
        waits on a collective before it uses the result; gloo's reduce-scatter never
        says it completed), or ``force``: then wait on it (at once when it is done).
        Whether it was released."""
        works, ents, wrote = rec
        if not all(w.is_completed() for w in works):
            if not (force or any(x.touched for x in wrote)):
                return False
            for w in works:
                w.wait()
        for x in ents:
            x.pins -= 1
        return True


__all__ = ["InFlight"]
