"""The back-end a front-end reaches to move bytes: the host tier, the copy stream, counters.

The compiled front-end (:mod:`tierflow.compiled`) decides *when* a saved activation
leaves the device and comes back (custom ops inside the compiled graphs); this module
does the moving. Its interface is three calls and a record:

* :meth:`Backend.reserve` sizes the host tier for a slot before the step that uses it,
  so the step itself allocates nothing for it;
* :meth:`Backend.put` copies a tensor out into a free buffer of its slot and returns a
  ticket; :meth:`Backend.take` copies the ticket's bytes back into a new device tensor
  with the original strides and frees the buffer for the next call;
* :attr:`Backend.stats` (:class:`BackendStats`) counts what moved.

Each piece of state has one owner that writes it: :class:`HostSlots` owns the host
buffers and which are in use, :class:`CopyStream` owns the side stream and its events,
:class:`BackendStats` is written only by :class:`Backend`.

On CUDA the buffers are pinned and the copy out runs on a side stream (the compute
stream goes on while it drains; the device memory is kept from reuse until the copy
ends by ``record_stream``); the copy back runs on the compute stream after the copy out
finished. On the CPU the host tier is plain host memory allocated before the step:
what the allocator sees during a step is the device side only, as on a GPU.

The eager runtime (:class:`tierflow.runtime.executor.Run`) moves whole storages into an
arena-managed host pool and an SSD file: its back-end is
:class:`tierflow.runtime.tier_set.Tiers` (see docs/runtime.md, "Module layout").
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class BackendStats:
    """What the back-end moved.

    Attributes:
        offloads, reloads: tensors copied out and back.
        offloaded_bytes: bytes copied out (the same come back).
        host_bytes: host memory the slots hold (pinned on CUDA).
        in_flight_peak: most tickets out at once (a compiled block called several times
            in one step holds one per call).
    """

    offloads: int = 0
    reloads: int = 0
    offloaded_bytes: int = 0
    host_bytes: int = 0
    in_flight_peak: int = 0


@dataclass
class _Ticket:
    slot: int
    buffer: torch.Tensor
    shape: tuple[int, ...]
    order: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    event: Any = None


@dataclass
class HostSlots:
    """Host buffers per slot (a saved activation of a graph's plan), reused across steps.

    A slot keeps a free list: a graph called twice in a step takes two buffers.
    """

    pin: bool
    free: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    held_bytes: int = 0

    def acquire(self, slot: int, nbytes: int) -> torch.Tensor:
        bufs = self.free.setdefault(slot, [])
        for i, b in enumerate(bufs):
            if b.numel() >= nbytes:
                return bufs.pop(i)
        return self._new(nbytes)

    def release(self, slot: int, buf: torch.Tensor) -> None:
        self.free.setdefault(slot, []).append(buf)

    def reserve(self, slot: int, nbytes: int) -> None:
        bufs = self.free.setdefault(slot, [])
        if not any(b.numel() >= nbytes for b in bufs):
            bufs.append(self._new(nbytes))

    def _new(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self.pin)
        self.held_bytes += buf.numel()
        return buf


class CopyStream:
    """CUDA: the side stream copies out run on; CPU: nothing (copies are synchronous)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        if self.stream is None:
            dst.copy_(src)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            src.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, event: Any) -> None:
        if event is not None:
            torch.cuda.current_stream(dst.device).wait_event(event)
        dst.copy_(src, non_blocking=dst.device.type == "cuda")


def dense_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The dimension order that makes ``t`` contiguous (``t.permute(order)`` is
    contiguous), or ``None`` when ``t`` is not a permutation of a dense tensor (a slice
    with gaps, an expanded view): the compiled plan keeps such tensors on the device."""
    order = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.size(d))))
    return order if t.permute(order).is_contiguous() else None


class Backend:
    """Moves saved activations to the host tier and back (see the module docstring).

    Args:
        device: where the tensors live (``cpu`` or a CUDA device).

    Example:
        >>> be = Backend(torch.device("cpu"))
        >>> t = be.put(0, torch.ones(4))
        >>> be.take(t).sum().item()
        4.0
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.slots = HostSlots(pin=self.device.type == "cuda")
        self.copies = CopyStream(self.device)
        self.stats = BackendStats()
        self._tickets: dict[int, _Ticket] = {}
        self._next = itertools.count(1)
        # Custom ops may run from autograd's worker thread (CUDA backward).
        self._lock = threading.Lock()

    def reserve(self, slot: int, nbytes: int) -> None:
        """Make a host buffer of ``nbytes`` ready for ``slot`` (outside a step)."""
        with self._lock:
            self.slots.reserve(slot, int(nbytes))
            self.stats.host_bytes = self.slots.held_bytes

    def put(self, slot: int, x: torch.Tensor) -> int:
        """Copy ``x`` to the host tier; the ticket that gives it back to :meth:`take`.

        Raises:
            ValueError: ``x`` is not a permutation of a dense tensor.
        """
        order = dense_order(x)
        if order is None:
            raise ValueError(f"tierflow offload: tensor of strides {x.stride()} is not dense")
        src = x.permute(order)
        nbytes = x.numel() * x.element_size()
        with self._lock:
            buf = self.slots.acquire(slot, nbytes)
            ticket = next(self._next)
        host = buf[:nbytes].view(x.dtype).view(src.shape)
        event = self.copies.copy_out(host, src)
        with self._lock:
            self._tickets[ticket] = _Ticket(slot, buf, tuple(src.shape), order, x.dtype, x.device, event)
            self.stats.offloads += 1
            self.stats.offloaded_bytes += nbytes
            self.stats.host_bytes = self.slots.held_bytes
            self.stats.in_flight_peak = max(self.stats.in_flight_peak, len(self._tickets))
        return ticket

    def take(self, ticket: int) -> torch.Tensor:
        """The tensor :meth:`put` copied out, on its device, with its strides.

        Raises:
            KeyError: an unknown ticket (already taken, or never put).
        """
        with self._lock:
            tk = self._tickets.pop(ticket)
        nbytes = 1
        for s in tk.shape:
            nbytes *= s
        nbytes *= torch.empty((), dtype=tk.dtype).element_size()
        out = torch.empty(tk.shape, dtype=tk.dtype, device=tk.device)
        self.copies.copy_in(out, tk.buffer[:nbytes].view(tk.dtype).view(tk.shape), tk.event)
        with self._lock:
            self.slots.release(tk.slot, tk.buffer)
            self.stats.reloads += 1
        inverse = [0] * len(tk.order)
        for i, d in enumerate(tk.order):
            inverse[d] = i
        return out.permute(inverse)

    def outstanding(self) -> int:
        """Tickets put and not yet taken (a forward whose backward never ran)."""
        return len(self._tickets)

    def snapshot(self) -> BackendStats:
        """A copy of the counters (a front-end reports the difference from its start)."""
        return dataclasses.replace(self.stats)

    def drop_outstanding(self) -> None:
        """Free the buffers of tickets whose backward will never run."""
        with self._lock:
            for tk in self._tickets.values():
                self.slots.release(tk.slot, tk.buffer)
            self._tickets.clear()


_BACKENDS: dict[str, Backend] = {}
_BACKENDS_LOCK = threading.Lock()


def backend_for(device: torch.device | str) -> Backend:
    """The process's back-end for ``device`` (one per device, made on first use).

    Compiled graphs name no back-end: their code is cached across runs and processes
    (torch's FX graph cache), so the ops find it by the tensor's device.
    """
    key = str(torch.device(device))
    with _BACKENDS_LOCK:
        if key not in _BACKENDS:
            _BACKENDS[key] = Backend(torch.device(device))
        return _BACKENDS[key]
