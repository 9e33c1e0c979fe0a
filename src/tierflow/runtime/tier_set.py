"""The tiers a storage moves to and the copies that move it.

One object, :class:`Tiers`, owns them while a front-end is attached to the device's
back-end: the host pool (:class:`~tierflow.runtime.tiers.HostPool`), the SSD store
where there is one (:class:`~tierflow.runtime.tiers.SSDStore`), the copier
(:class:`~tierflow.runtime.streams.Copier`: side streams on CUDA, at once on CPU) and the
slots waiting for the copy that reads them before they are released. It is the only
writer of that state; the front-end (the dispatch mode's moves, :mod:`.moves`) asks it
for slots and copies and never reassigns its parts.

The device's :class:`~tierflow.runtime.backend.Backend` holds the one ``Tiers`` both
front-ends use while either is attached (an ``offload`` block opens it with
:meth:`Tiers.open` when it is the first): the compiled front-end's buffers are arena
slots of the same host pool (:meth:`Tiers.host_slot`, :meth:`Tiers.host_view`; they
are given back when the pool closes) and its copies go through the same :attr:`Tiers.copier`.
See docs/runtime.md, "Back-end".
"""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from ..units import fmt_bytes, parse_bytes
from . import tiers
from .errors import OffloadError
from .streams import Copier
from .tiers import HostPool, SSDStore


@dataclass(frozen=True)
class TierSizes:
    """What the tiers hold now (both may grow); the figures :class:`RunStats` reports.

    Attributes:
        host_pool_bytes: the host pool's chunks.
        ssd_file_bytes: the SSD file (0 without one).
        pinned_bytes: page-locked host memory (the pool on CUDA, and the SSD bounce buffer).
        ssd_bounce_bytes: the SSD bounce buffer (0 without an SSD tier).
    """

    host_pool_bytes: int
    ssd_file_bytes: int
    pinned_bytes: int
    ssd_bounce_bytes: int


class Tiers:
    """The host pool, the SSD store and the copier of one device, while a front-end uses it.

    Args:
        device: the compute device (``cpu`` or a CUDA device).
        host: the host pool.
        ssd: the SSD store, or None for no SSD tier.

    Example:
        >>> t = Tiers(torch.device("cpu"), HostPool(1 << 20, pin=False), None)
        >>> t.grow_host(4096), t.sizes().host_pool_bytes > 0
        (True, True)
        >>> t.close()  # (the host pool's peak use: nothing moved here)
        0
    """

    def __init__(self, device: torch.device, host: HostPool, ssd: SSDStore | None) -> None:
        self.device = device
        self.host = host
        self.ssd = ssd
        self.copier = Copier(device)
        # NOTE: in CPU mode a move between the device's storage and the host pool is one
        # memmove between their addresses: both are plain RAM, and a byte view of each
        # plus a copy_ cost several times the copy itself for the tens of kilobytes most
        # moves carry. On CUDA every copy goes through the side stream.
        self.memmove = device.type == "cpu"
        # (event, arena, offset, bytes): slots a copy still reads, released once it is done
        self.frees: deque[tuple[Any, Any, int, int]] = deque()

    @classmethod
    def open(
        cls,
        device: torch.device,
        *,
        budget: float,
        model_bytes: int,
        host_bytes: int | str | None,
        ssd_dir: str | os.PathLike | None,
        ssd_bytes: int | str | None,
        io_workers: int,
    ) -> Tiers:
        """The tiers an ``offload`` block starts with (see :func:`tierflow.offload` for
        the sizes' defaults).

        Raises:
            OffloadError: a fixed ``host_bytes`` cannot be allocated.
            SSDError: the SSD file cannot be created.
        """
        pin = device.type == "cuda"
        # The host pool: host_bytes, a fixed size allocated now; by default it grows by
        # chunks as evictions need room, and after planning to the plan's host peak, up
        # to the host's available memory less a margin (the planner is told that bound).
        if host_bytes is not None:
            host = HostPool(parse_bytes(host_bytes), pin=pin, fixed=True)
        else:
            # NOTE: ranks on one host (torchrun sets LOCAL_WORLD_SIZE) share its memory
            bound = tiers.host_memory_bound() // max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
            if not pin and math.isfinite(budget):
                # NOTE: in CPU mode the "device" is host RAM too: what the iteration keeps
                # there (up to the budget) beyond the model state, already allocated, is
                # not the pool's to take
                bound -= max(int(budget) - model_bytes, 0)
            host = HostPool(max(bound, 0), pin=pin)
        ssd = None
        if ssd_dir is not None:
            # the SSD file's default: weights, gradients and two Adam moments, plus the
            # budget's worth of activations
            default = 4 * model_bytes + int(min(budget, 4 * model_bytes)) + (16 << 20)
            cap = parse_bytes(ssd_bytes) if ssd_bytes is not None else default
            # (ssd_bytes: a fixed size; by default the file starts there and grows, up to
            # the disk's free space less a margin)
            limit = None if ssd_bytes is not None else tiers.disk_bound(ssd_dir)
            ssd = SSDStore(ssd_dir, cap, bounce_bytes=min(max(cap // 4, 16 << 20), 256 << 20),
                           workers=io_workers, pin=pin, limit=limit)
        return cls(device, host, ssd)

    def grow_host(self, nbytes: int) -> bool:
        """Add a chunk to the host pool for a slot of ``nbytes`` (False where the pool is
        fixed or at its limit)."""
        return self.host.grow(nbytes)

    def host_slot(self, nbytes: int) -> int:
        """An arena slot of ``nbytes`` in the host pool, the pool grown by a chunk where
        none is free: its offset (see :meth:`host_view`). The compiled back-end's
        buffers are taken here (:class:`~tierflow.runtime.backend.HostSlots`).

        Raises:
            OffloadError: the pool is full and may not grow (fixed, or at its limit).
        """
        off = self.host.arena.alloc(nbytes)
        if off is None and self.grow_host(nbytes):
            off = self.host.arena.alloc(nbytes)
        if off is None:
            raise OffloadError(
                f"host pool full: no room for {fmt_bytes(nbytes)} ({fmt_bytes(self.host.capacity)} held, "
                f"limit {fmt_bytes(self.host.limit)})")
        return off

    def host_view(self, off: int, nbytes: int) -> torch.Tensor:
        """The host pool's bytes ``[off, off + nbytes)`` as a ``uint8`` tensor."""
        return self.host.view(off, nbytes)

    def agree_limits(self, smallest: Any) -> tuple[int, int]:
        """The most the host pool and the SSD file may hold, made the smallest any rank
        has where ``smallest`` (a ``RankSync.min``) is given: the ranks plan for one
        machine, and each measured its free memory at its own moment."""
        pool, ssd = self.host, self.ssd
        if smallest is not None:
            pool.limit = int(smallest(pool.limit))
            if ssd is not None:
                ssd.limit = max(ssd.capacity, int(smallest(ssd.limit)))
        return pool.limit, (ssd.limit if ssd is not None else 0)

    def sizes(self) -> TierSizes:
        """The tiers' sizes as they are now."""
        ssd = self.ssd
        return TierSizes(
            host_pool_bytes=self.host.capacity,
            ssd_file_bytes=ssd.capacity if ssd is not None else 0,
            pinned_bytes=self.host.pinned_bytes + (ssd.bounce.capacity if ssd is not None and ssd.pinned else 0),
            ssd_bounce_bytes=ssd.bounce.capacity if ssd is not None else 0,
        )

    def release_after(self, event: Any, arena: Any, off: int, nbytes: int) -> None:
        """Release ``arena``'s slot at ``off`` once the copy ``event`` has read it."""
        self.frees.append((event, arena, off, nbytes))

    def reap_frees(self, wait: bool = False) -> None:
        """Release the slots whose copies have completed (they complete in order: one
        stream); ``wait``: all of them, blocking on those still running."""
        frees = self.frees
        while frees and (wait or Copier.done(frees[0][0])):
            ev, arena, off, n = frees.popleft()
            Copier.synchronize(ev)
            arena.release(off, n)

    def stop_counting_waits(self) -> None:
        """From here on the host's waits on transfers are not counted (bringing
        everything home at the block's end waits by design); the counts so far stay
        where they were handed out (``RunStats.blocking_waits``)."""
        self.copier.waits = {}

    def usage(self) -> dict[str, int]:
        """Bytes in use now: ``host`` (pool slots), ``ssd`` (file slots), ``bounce``."""
        out = {"host": self.host.arena.used}
        if self.ssd is not None:
            out["ssd"], out["bounce"] = self.ssd.arena.used, self.ssd.bounce.used
        return out

    def close(self) -> int:
        """Free the host pool and close the SSD store; the pool's peak use (bytes)."""
        peak = self.host.arena.peak
        self.host.close()
        if self.ssd is not None:
            self.ssd.close()
        return peak


__all__ = ["TierSizes", "Tiers"]
