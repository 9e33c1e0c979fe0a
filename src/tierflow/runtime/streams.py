"""Copies between the device and host memory, on side streams ordered by events.

One class, two back ends, one calling convention, so the executor has a single code
path: :class:`Copier` on CUDA issues every copy on a side stream and returns the CUDA
event recorded after it; on CPU the copy runs at once and the "event" is ``None``
(already complete). Nothing here blocks the host on the hot path: the compute stream
*waits on* an event (a GPU-side dependency); the host only synchronises on an event
when it must reuse the memory the copy reads (a full pool) or at the end of the run.

Why one side stream per direction: PCIe is full duplex and the GPU has a copy engine
for each way, so evictions (device to host) and prefetches (host to device) run at the
same time, as the simulator's hardware model has them (one link, one bus per
direction). On one stream a prefetch queued behind an eviction waited for it, so a
step moving as much in as out could take up to twice its transfer time. (The H200 runs
in BENCHMARKS.md changed this with other things at once: it was not measured alone.)
The price is ordering: a copy back of a tensor must wait for its copy out, which the
caller says with ``after``.
"""

from __future__ import annotations

from typing import Any

import torch


class Copier:
    """Device <-> host copies.

    Args:
        device: the compute device; ``cpu`` makes every method synchronous and every
            event ``None``.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        # times the host blocked on a transfer, by reason (see count_wait): the runtime's
        # steady state should leave this empty
        self.waits: dict[str, int] = {}
        if self.cuda:
            self.outward = torch.cuda.Stream(device)  # device -> host
            self.inward = torch.cuda.Stream(device)  # host -> device

    @property
    def compute(self) -> Any:
        """The stream the caller computes on, asked at each call: a copier lives longer
        than one stream context (the compiled back-end's for the process; an ``offload``
        block's across a loop that may enter ``torch.cuda.stream``), and autograd runs a
        backward on the stream its forward ran on. A stream fixed when the copier was made
        would order the copies after the wrong producer and let the consumer skip the
        wait."""
        return torch.cuda.current_stream(self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, dev_tensor: torch.Tensor, after: Any = None) -> Any:
        """Copy ``src`` into ``dst`` (one is on the device: ``dev_tensor``); return an
        event that completes when the copy has.

        On CUDA the copy runs on the side stream of its direction, which first waits for
        the work queued so far on the compute stream (the producer of ``src``, or the
        allocation of ``dst``) and for ``after`` (an earlier copy's event: the copy out
        whose bytes this copy brings back). The device tensor is marked as used by that
        stream (``record_stream``): if the executor frees it right after, the caching
        allocator will not hand its block to another tensor before the copy has read it.
        """
        if not self.cuda:
            dst.copy_(src)
            return None
        side = self.inward if dst is dev_tensor else self.outward
        ready = torch.cuda.Event()
        ready.record(self.compute)  # (before entering the side stream's context)
        with torch.cuda.stream(side):
            side.wait_event(ready)
            if after is not None:
                side.wait_event(after)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        dev_tensor.record_stream(side)
        return done

    def wait(self, event: Any) -> None:
        """Make the compute stream wait for ``event`` (no host synchronisation)."""
        if event is not None:
            self.compute.wait_event(event)

    @staticmethod
    def done(event: Any) -> bool:
        return event is None or event.query()

    @staticmethod
    def synchronize(event: Any) -> None:
        if event is not None:
            event.synchronize()

    def count_wait(self, reason: str) -> None:
        """Note that the host is about to block on a transfer in flight (a copy or an
        SSD transfer that a full buffer, a read or a retired write must wait for). On CPU
        copies are synchronous, but these paths are the same as on CUDA, so the count
        says where a GPU run would stall the host."""
        self.waits[reason] = self.waits.get(reason, 0) + 1

    def drain(self) -> None:
        if self.cuda:
            self.outward.synchronize()
            self.inward.synchronize()


__all__ = ["Copier"]
