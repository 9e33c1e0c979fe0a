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
through ``Tiers.host_slot`` / ``host_view`` and ``Tiers.copier``.
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

One ``Backend`` per device and process (:func:`backend_for`) serves both front-ends:
an ``offload`` block (:class:`tierflow.runtime.executor.Run`) and a compiled run
(:class:`tierflow.compiled.frontend.CompiledOffload`) :meth:`Backend.attach` to it and
:meth:`Backend.detach` from it; the first one attached opens the ``Tiers`` (an
``offload`` block with its own sizes: a fixed host pool, an SSD tier), the last one out
closes it, so the host pool's (pinned) memory goes back when nothing uses it. See
docs/runtime.md, "Back-end".
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import OffloadError
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


def inverse_order(order: tuple[int, ...] | list[int]) -> list[int]:
    """The permutation that undoes ``order`` (``t.permute(order).permute(inverse_order(order))`` is ``t``)."""
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
    """The device's back-end: moves saved activations to the host tier and back, through
    the one :class:`~tierflow.runtime.tier_set.Tiers` both front-ends share (see the
    module docstring).

    Front-ends use it between :meth:`attach` and :meth:`detach`; the ``Tiers`` (its host
    pool, pinned on CUDA) is opened by the first front-end attached and closed when the
    last one detaches, so its memory goes back to the host when nothing uses it.

    Args:
        device: where the tensors live (``cpu`` or a CUDA device).
        tiers: the host pool and copier to move them with (a test's); by default the
            first front-end attached opens them (:meth:`attach`), or, where an op runs
            with none attached, a ``Tiers`` whose pool grows by chunks up to the host's
            available memory (less a margin), with no SSD tier.

    Example:
        >>> be = Backend(torch.device("cpu"))
        >>> t = be.put(0, torch.ones(4))
        >>> be.take(t).sum().item()
        4.0
    """

    def __init__(self, device: torch.device, tiers: Tiers | None = None) -> None:
        self.device = torch.device(device)
        self._tiers: Tiers | None = tiers
        self._slots: HostSlots | None = HostSlots(tiers) if tiers is not None else None
        self._users: list[object] = []  # the front-ends attached (a list: by identity)
        self._sized_by: str | None = None  # what the first front-end sized the tiers by
        self.stats = BackendStats()
        self._tickets: dict[int, _Ticket] = {}
        self._arriving: dict[int, _Arriving] = {}  # copies back started, not yet waited for
        self._next = itertools.count(1)
        # Custom ops may run from autograd's worker thread (CUDA backward).
        self._lock = threading.Lock()

    # -- lifetime ---------------------------------------------------------------------
    def _open_default(self) -> Tiers:
        return Tiers(self.device, HostPool(host_memory_bound(), pin=self.device.type == "cuda"), None)

    @property
    def tiers(self) -> Tiers:
        """The open ``Tiers``; opened with the default sizes where none is (a compiled
        graph called with no front-end attached: closed at the next last :meth:`detach`)."""
        if self._tiers is None:
            self._tiers = self._open_default()
            self._slots = HostSlots(self._tiers)
        return self._tiers

    @property
    def slots(self) -> HostSlots:
        """The compiled slots' host buffers, in the open ``Tiers``' host pool."""
        self.tiers  # noqa: B018 - (opens them where none are)
        assert self._slots is not None
        return self._slots

    @property
    def is_open(self) -> bool:
        """Whether a ``Tiers`` is open (its host pool may hold memory)."""
        return self._tiers is not None

    @property
    def users(self) -> int:
        """Front-ends attached now."""
        return len(self._users)

    def attach(self, user: object, open_tiers: Callable[[], Tiers] | None = None, *,
               sized: str | None = None) -> Tiers:
        """Start using the back-end; the ``Tiers`` to move bytes with.

        Args:
            user: the front-end (an ``offload`` block's ``Run``, a ``CompiledOffload``);
                :meth:`detach` it when done.
            open_tiers: makes the ``Tiers`` where none is open (an ``offload`` block's,
                sized from its arguments); by default a growable host pool, no SSD.
            sized: what ``open_tiers`` sets that the default does not (``"host_bytes"``,
                ``"ssd_dir"``): such a front-end must be the first attached.

        Raises:
            OffloadError: ``sized`` is given while another front-end holds tiers it
                opened otherwise (one host pool per device: a fixed size or an SSD tier
                is chosen by the first front-end).
        """
        if self._tiers is not None and self._users and sized is not None and sized != self._sized_by:
            raise OffloadError(
                f"tierflow: the {self.device} back-end is already open (a compiled run or another offload "
                f"block holds its host pool): {sized} can be given only by the first front-end on a device; "
                f"open this block first, or leave {sized} out")
        if self._tiers is None or not self._users:
            # NOTE: tiers open with no front-end attached were opened by a compiled graph
            # called outside any block; the first front-end gets tiers of its own sizes
            # (fresh, whatever ran before it in the process), and the compiled run
            # remakes its buffers on __enter__
            if self._tiers is not None:
                self._close()
            self._tiers = open_tiers() if open_tiers is not None else self._open_default()
            self._slots = HostSlots(self._tiers)
            self._sized_by = sized
        self._users.append(user)
        return self._tiers

    def detach(self, user: object) -> int:
        """Stop using the back-end; the host pool's peak use so far (bytes). The last
        front-end to detach closes the ``Tiers``: the host pool (pinned on CUDA) and
        the SSD store are given back (a ticket still out, a forward whose backward
        never ran, is dropped), and the next :meth:`attach` opens new ones.

        Raises:
            ValueError: ``user`` is not attached.
        """
        for i, u in enumerate(self._users):
            if u is user:
                del self._users[i]
                break
        else:
            raise ValueError("tierflow back-end: detach of a front-end that is not attached")
        if self._tiers is None:
            return 0
        peak = self._tiers.host.arena.peak
        if not self._users:
            self._close()
        return peak

    def _close(self) -> None:
        tiers = self._tiers
        assert tiers is not None
        self.drop_outstanding()
        tiers.copier.drain()  # (no copy may still read or write a chunk given back)
        tiers.close()
        self._tiers = self._slots = self._sized_by = None
        self.stats.host_bytes = 0

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
        return arr.tensor.permute(inverse_order(arr.order))

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
        return arr.tensor.permute(inverse_order(arr.order))

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
                if self._slots is not None:
                    self._slots.release(tk.slot, tk.buffer)
            self._tickets.clear()
            self._arriving.clear()


def sized_by(host_bytes: Any, ssd_dir: Any) -> str | None:
    """What an ``offload`` block's arguments set that the back-end's default tiers do
    not (:meth:`Backend.attach`'s ``sized``): ``"host_bytes"``, ``"ssd_dir"``, or None."""
    asked = [name for name, v in (("host_bytes", host_bytes), ("ssd_dir", ssd_dir)) if v is not None]
    return " and ".join(asked) or None


_BACKENDS: dict[str, Backend] = {}
_BACKENDS_LOCK = threading.Lock()


def backend_for(device: torch.device | str) -> Backend:
    """The process's back-end for ``device``: one object per device, made on first use,
    which every front-end on that device attaches to (an ``offload`` block's ``Run``, a
    ``CompiledOffload``); its ``Tiers`` live while one is attached.

    Compiled graphs name no back-end: their code is cached across runs and processes
    (torch's FX graph cache), so the ops find it by the tensor's device.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # ("cuda" and "cuda:0" are one device)
        dev = torch.device("cuda", torch.cuda.current_device())
    key = str(dev)
    with _BACKENDS_LOCK:
        if key not in _BACKENDS:
            _BACKENDS[key] = Backend(dev)
        return _BACKENDS[key]
