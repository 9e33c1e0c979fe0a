"""The back-end a front-end reaches to move bytes: the host tier, the copies, counters.

The compiled front-end (:mod:`tierflow.compiled`) decides *when* a saved activation
leaves the device and comes back (custom ops inside the compiled graphs); this module
does the moving. Its interface is a few calls and a record:

* :meth:`Backend.reserve` sizes the host tier for a slot before the step that uses it,
  so the step itself allocates nothing for it;
* :meth:`Backend.put` copies a tensor out into a free buffer of its slot and returns a
  ticket; :meth:`Backend.start` issues the copy of the ticket's bytes back into a new
  device tensor, :meth:`Backend.finish` makes the compute stream wait for that copy and
  gives the tensor back with the original strides (:meth:`Backend.take` is both at once);
* :attr:`Backend.stats` (:class:`BackendStats`) counts what moved.

The host memory and the copies are the eager runtime's own components: a
:class:`~tierflow.runtime.tier_set.Tiers` (its host pool, an arena of chunks pinned on
CUDA, and its :class:`~tierflow.runtime.streams.Copier`, the side streams) reached
through ``Tiers.host_slot`` / ``host_view`` / ``free_host_slot`` and ``Tiers.copier``.
Each piece of state has one owner that writes it: the ``Tiers`` owns the pool's chunks
and arena and the streams; :class:`HostSlots` owns which of its arena slots belong to
which compiled slot and which are in use (it takes and gives back arena slots through
the ``Tiers``, never writing the arena itself); :class:`Backend` owns the tickets and
:class:`BackendStats`.

On CUDA the copy out runs on the copier's outward stream (the compute stream goes on
while it drains; the device memory is kept from reuse until the copy ends by
``record_stream``), the copy back on its inward stream after the copy out, issued by
``start`` ahead of the first use (a prefetch) and waited for by ``finish`` at it; a
host buffer given back while a copy back still reads it is reused only after that copy
(its event goes with it). On the CPU the host tier is plain host memory taken before the
step and every copy is done at once: what the allocator sees during a step is the
device side only, as on a GPU.

The eager runtime (:class:`tierflow.runtime.executor.Run`) opens a ``Tiers`` per
``offload`` block (sized from its arguments, with an SSD file where asked); a
:class:`Backend` holds one for its device for the process's life (:func:`backend_for`)
or the one it is given (see docs/runtime.md, "Front-ends and back-ends").
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from .tier_set import Tiers
from .tiers import HostPool, host_memory_bound


@dataclass
class BackendStats:
    """What the back-end moved.

    Attributes:
        offloads, reloads: tensors copied out and back.
        offloaded_bytes: bytes copied out (the same come back).
        host_bytes: host memory the slots hold (pinned on CUDA).
        in_flight_peak: most tickets out at once (a compiled block called several times
            in one step holds one per call).
        prefetch_starts: copies back issued (:meth:`Backend.start`); ``reloads`` counts
            those waited for.
    """

    offloads: int = 0
    reloads: int = 0
    offloaded_bytes: int = 0
    host_bytes: int = 0
    in_flight_peak: int = 0
    prefetch_starts: int = 0


@dataclass
class _Ticket:
    slot: int
    buffer: _Buffer
    shape: tuple[int, ...]
    order: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    event: Any = None


@dataclass
class _Arriving:
    tensor: torch.Tensor  # the device tensor the copy back writes (dense, in ``order``)
    order: tuple[int, ...]
    event: Any = None  # CUDA: the copy's event on the side stream


@dataclass
class _Buffer:
    off: int  # in the host pool's arena
    nbytes: int
    ready: Any = None  # CUDA: the event of the last copy that read it (None: free now)


@dataclass
class HostSlots:
    """Host buffers per slot (a saved activation of a graph's plan), reused across steps:
    arena slots of the ``Tiers``' host pool, taken through :meth:`Tiers.host_slot`.

    A slot keeps a free list: a graph called twice in a step takes two buffers.
    """

    tiers: Tiers
    free: dict[int, list[_Buffer]] = field(default_factory=dict)
    held_bytes: int = 0

    def acquire(self, slot: int, nbytes: int) -> _Buffer:
        bufs = self.free.setdefault(slot, [])
        for i, b in enumerate(bufs):
            if b.nbytes >= nbytes:
                return bufs.pop(i)
        return self._new(nbytes)

    def release(self, slot: int, buf: _Buffer) -> None:
        self.free.setdefault(slot, []).append(buf)

    def reserve(self, slot: int, nbytes: int) -> None:
        bufs = self.free.setdefault(slot, [])
        if not any(b.nbytes >= nbytes for b in bufs):
            bufs.append(self._new(nbytes))

    def view(self, buf: _Buffer, nbytes: int) -> torch.Tensor:
        return self.tiers.host_view(buf.off, nbytes)

    def _new(self, nbytes: int) -> _Buffer:
        n = max(int(nbytes), 1)
        buf = _Buffer(self.tiers.host_slot(n), n)
        align = self.tiers.host.arena.align  # what the arena really sets aside
        self.held_bytes += -(-n // align) * align
        return buf


def _inverse(order: tuple[int, ...]) -> list[int]:
    inv = [0] * len(order)
    for i, d in enumerate(order):
        inv[d] = i
    return inv


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
        tiers: the host pool and copier to move them with; by default a ``Tiers`` of
            its own, whose pool grows by chunks up to the host's available memory (less
            a margin), with no SSD tier.

    Example:
        >>> be = Backend(torch.device("cpu"))
        >>> t = be.put(0, torch.ones(4))
        >>> be.take(t).sum().item()
        4.0
    """

    def __init__(self, device: torch.device, tiers: Tiers | None = None) -> None:
        self.device = torch.device(device)
        if tiers is None:
            tiers = Tiers(self.device, HostPool(host_memory_bound(), pin=self.device.type == "cuda"), None)
        self.tiers = tiers
        self.slots = HostSlots(tiers)
        self.stats = BackendStats()
        self._tickets: dict[int, _Ticket] = {}
        self._arriving: dict[int, _Arriving] = {}  # copies back started, not yet waited for
        self._next = itertools.count(1)
        # Custom ops may run from autograd's worker thread (CUDA backward).
        self._lock = threading.Lock()

    def reserve(self, slot: int, nbytes: int) -> None:
        """Make a host buffer of ``nbytes`` ready for ``slot`` (outside a step).

        Raises:
            OffloadError: the host pool cannot grow by ``nbytes``.
        """
        with self._lock:
            self.slots.reserve(slot, int(nbytes))
            self.stats.host_bytes = self.slots.held_bytes

    def put(self, slot: int, x: torch.Tensor) -> int:
        """Copy ``x`` to the host tier; the ticket that gives it back to :meth:`take`.

        Raises:
            ValueError: ``x`` is not a permutation of a dense tensor.
            OffloadError: ``slot`` has no free buffer and the host pool cannot grow.
        """
        order = dense_order(x)
        if order is None:
            raise ValueError(f"tierflow offload: tensor of strides {x.stride()} is not dense")
        src = x.permute(order)
        nbytes = x.numel() * x.element_size()
        with self._lock:
            buf = self.slots.acquire(slot, nbytes)
            ticket = next(self._next)
        host = self.slots.view(buf, nbytes).view(x.dtype).view(src.shape)
        # after: the copy back that last read this buffer (CUDA: another stream)
        event = self.tiers.copier.copy(host, src, x, after=buf.ready)
        with self._lock:
            self._tickets[ticket] = _Ticket(slot, buf, tuple(src.shape), order, x.dtype, x.device, event)
            self.stats.offloads += 1
            self.stats.offloaded_bytes += nbytes
            self.stats.host_bytes = self.slots.held_bytes
            self.stats.in_flight_peak = max(self.stats.in_flight_peak, len(self._tickets))
        return ticket

    def take(self, ticket: int) -> torch.Tensor:
        """The tensor :meth:`put` copied out, on its device, with its strides (the copy
        back issued and waited for at once: :meth:`start` then :meth:`finish`).

        Raises:
            KeyError: an unknown ticket (already taken, or never put).
        """
        return self.finish(self.start(ticket))

    def start(self, ticket: int) -> int:
        """Issue the copy back of ``ticket`` into a new device tensor, without waiting
        for it; the ticket to :meth:`finish` it with (the same number).

        The device tensor is allocated now, so its bytes count from here (a front-end
        starts a copy early only where the budget holds them). On CUDA the copy runs on
        the inward side stream after the copy out and after what the compute stream
        issued so far; on the CPU it is done before this returns.

        Raises:
            KeyError: an unknown ticket (already started or taken, or never put).
        """
        with self._lock:
            tk = self._tickets.pop(ticket)
        out = torch.empty(tk.shape, dtype=tk.dtype, device=tk.device)
        nbytes = out.numel() * out.element_size()
        host = self.slots.view(tk.buffer, nbytes).view(tk.dtype).view(tk.shape)
        done = self.tiers.copier.copy(out, host, out, after=tk.event)
        with self._lock:
            tk.buffer.ready = done  # the next copy into it waits for this read
            self.slots.release(tk.slot, tk.buffer)
            self._arriving[ticket] = _Arriving(out, tk.order, done)
            self.stats.prefetch_starts += 1
        return ticket

    def arriving(self, ticket: int) -> torch.Tensor:
        """The device tensor :meth:`start` is copying ``ticket`` into, with its original
        strides; on CUDA not to be read before :meth:`finish`.

        Raises:
            KeyError: a ticket not started (or already finished).
        """
        arr = self._arriving[ticket]
        return arr.tensor.permute(_inverse(arr.order))

    def finish(self, ticket: int) -> torch.Tensor:
        """The tensor whose copy back :meth:`start` issued, once the compute stream
        waits for that copy; with its original strides.

        Raises:
            KeyError: a ticket not started (or already finished).
        """
        with self._lock:
            arr = self._arriving.pop(ticket)
            self.stats.reloads += 1
        self.tiers.copier.wait(arr.event)
        return arr.tensor.permute(_inverse(arr.order))

    def outstanding(self) -> int:
        """Tickets put or started and not yet finished (a forward whose backward never ran)."""
        return len(self._tickets) + len(self._arriving)

    def snapshot(self) -> BackendStats:
        """A copy of the counters (a front-end reports the difference from its start)."""
        return dataclasses.replace(self.stats)

    def drop_outstanding(self) -> None:
        """Free the buffers of tickets whose backward will never run."""
        with self._lock:
            for tk in self._tickets.values():
                tk.buffer.ready = tk.event  # (its copy out may still be writing it)
                self.slots.release(tk.slot, tk.buffer)
            self._tickets.clear()
            self._arriving.clear()


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
