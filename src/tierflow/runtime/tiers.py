"""The off-device tiers: the host pool (chunks of host memory) and one SSD file.

Both are carved up by :class:`Arena`, a first-fit free list with coalescing: a tensor
gets a slot when it is evicted and gives it back when it is fetched (or dies while
away). A plan's stays are laid out ahead of time by the pool planner
(:mod:`tierflow.pool`, see ``runtime/follow.py``): a move takes its planned offset when
that is free, else the first slot that fits.

The host pool is a list of *chunks*, separate allocations of a power-of-two size
(pinned on CUDA), laid end to end in one offset space; a slot never straddles two
chunks. By default it starts empty and grows by a chunk when an eviction finds no room,
up to :func:`host_memory_bound`, and after planning to the plan's host peak
(``runtime/follow.py``); ``offload(host_bytes=...)`` makes it one fixed size instead,
allocated at once. NOTE: chunks rather than one buffer because PyTorch's pinned-host
caching allocator rounds every request up to a power of two (a 64 GiB request pins
128 GiB): a power-of-two chunk pins exactly its size, and growing by chunks keeps what
is already in the pool where it is.

The SSD tier is one file, ``<ssd_dir>/tierflow-<pid>-<random>/swap``, in a directory of
mode 0700 with the file at 0600, allocated with ``posix_fallocate`` (so "disk full"
is found when space is taken, not mid-write): at its size at start, and by default
extended the same way as evictions or the plan need more, up to :func:`disk_bound`
(``offload(ssd_bytes=...)`` fixes its size). It is opened with ``O_DIRECT`` where the filesystem
accepts it (page cache bypassed: the host's memory is the host tier's, not the page
cache's), read and written by a small thread pool. ``O_DIRECT`` needs block-aligned
buffers, offsets and lengths, so every transfer goes through a page-aligned *bounce*
arena and every slot is rounded to 4 KiB. The directory is removed when the run ends
and, for runs whose process died, by the next run that uses the same ``ssd_dir``.
"""

from __future__ import annotations

import bisect
import errno
import mmap
import os
import shutil
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ..units import fmt_bytes
from .errors import OffloadError, SSDError

PAGE = 4096
_PREFIX = "tierflow-"


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class Arena:
    """First-fit allocator over ``[0, capacity)`` with coalescing of neighbours.

    Args:
        capacity: bytes managed.
        align: every offset and size is rounded up to a multiple of it (64 for cache
            lines in the host pool, 4096 for ``O_DIRECT`` on the SSD).

    Example:
        >>> a = Arena(1024, align=64)
        >>> a.alloc(100), a.alloc(10), a.used
        (0, 128, 192)
    """

    def __init__(self, capacity: int, align: int = 64):
        self.capacity = int(capacity) // align * align
        self.align = align
        self._starts: list[int] = [0] if self.capacity else []
        self._sizes: list[int] = [self.capacity] if self.capacity else []
        self._cuts: set[int] = set()  # chunk starts (add_chunk): free blocks never merge across
        self.used = 0
        self.peak = 0

    def add_chunk(self, nbytes: int) -> int:
        """Append ``nbytes`` (a multiple of ``align``) of room at the end, as a chunk of
        its own: no slot will straddle its start. Returns its first offset."""
        n = int(nbytes)
        if n <= 0 or n % self.align:
            raise ValueError(f"Arena.add_chunk: {n} bytes is not a positive multiple of {self.align}")
        base = self.capacity
        if base:
            self._cuts.add(base)
        self._starts.append(base)
        self._sizes.append(n)
        self.capacity += n
        return base

    def extend(self, nbytes: int) -> None:
        """Append ``nbytes`` (a multiple of ``align``) of room at the end, contiguous with
        what is there (a file that grew: a slot may span the old end)."""
        n = int(nbytes)
        if n <= 0 or n % self.align:
            raise ValueError(f"Arena.extend: {n} bytes is not a positive multiple of {self.align}")
        if self._starts and self._starts[-1] + self._sizes[-1] == self.capacity:
            self._sizes[-1] += n
        else:
            self._starts.append(self.capacity)
            self._sizes.append(n)
        self.capacity += n

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free slot of ``nbytes`` (rounded up), or None if none is big enough."""
        n = _round_up(max(int(nbytes), 1), self.align)
        for i, size in enumerate(self._sizes):
            if size >= n:
                off = self._starts[i]
                if size == n:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += n
                    self._sizes[i] -= n
                self.used += n
                self.peak = max(self.peak, self.used)
                return off
        return None

    def alloc_at(self, off: int, nbytes: int) -> int | None:
        """Take ``[off, off + nbytes)`` (rounded up) if it is free: the slot a planned
        layout chose. None (and nothing taken) when any of it is in use or unaligned."""
        n = _round_up(max(int(nbytes), 1), self.align)
        if off % self.align or off < 0:
            return None
        i = bisect.bisect_right(self._starts, off) - 1
        if i < 0 or off + n > self._starts[i] + self._sizes[i]:
            return None
        start, size = self._starts[i], self._sizes[i]
        del self._starts[i], self._sizes[i]
        # what is left of the free block on either side stays free
        for lo, hi in ((off + n, start + size), (start, off)):
            if hi > lo:
                self._starts.insert(i, lo)
                self._sizes.insert(i, hi - lo)
        self.used += n
        self.peak = max(self.peak, self.used)
        return off

    def release(self, off: int, nbytes: int) -> None:
        n = _round_up(max(int(nbytes), 1), self.align)
        i = bisect.bisect_left(self._starts, off)
        self._starts.insert(i, off)
        self._sizes.insert(i, n)
        self.used -= n
        # merge with the right neighbour, then the left one (never across a chunk's start)
        cuts = self._cuts
        if (i + 1 < len(self._starts) and self._starts[i] + self._sizes[i] == self._starts[i + 1]
                and self._starts[i + 1] not in cuts):
            self._sizes[i] += self._sizes.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == self._starts[i] and self._starts[i] not in cuts:
            self._sizes[i - 1] += self._sizes.pop(i)
            self._starts.pop(i)

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        return max(self._sizes, default=0)


# The host pool's chunk: the unit it grows by once it holds this much (smaller chunks,
# doubling, before: a small model's pool stays small).
CHUNK_BYTES = 64 << 20
_FIRST_CHUNK = 1 << 20

# NOTE: the host pool may take all but this share of the memory the host has available
# when the run starts: the rest is left to what the run allocates beside the pool
# (the data loader's batches, Python objects, the SSD tier's bounce buffer, CUDA's own
# pinned staging) and to the other processes, since pinned pages cannot be swapped out
# and a host that runs out of them kills the process (the OOM killer) instead of failing
# an allocation.
HOST_MARGIN = 0.10


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def host_available_bytes() -> int:
    """Host memory available to a new allocation without swapping: Linux's
    ``MemAvailable`` (``/proc/meminfo``), else the physical memory (``os.sysconf``)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (OSError, ValueError):
        return 0


def host_memory_bound() -> int:
    """The most bytes a default host pool may grow to: the available host memory less
    :data:`HOST_MARGIN` of it. (One function, so that tests can make the host small.)"""
    return int(host_available_bytes() * (1 - HOST_MARGIN)) // PAGE * PAGE


class HostPool:
    """The host tier: chunks of host memory, pinned when the device is CUDA (so copies
    are true DMA and can run on a side stream), plain memory on CPU, in one offset space
    managed by :attr:`arena` (a slot never straddles two chunks).

    Args:
        limit: the most bytes the pool may hold (the planner is told this capacity).
        pin: allocate page-locked memory (only meaningful with CUDA).
        fixed: allocate ``limit`` now and never grow (``offload(host_bytes=...)``);
            otherwise start empty and :meth:`grow` on demand up to ``limit``.

    NOTE: every chunk is a power of two in size, a multiple of :data:`PAGE` (a pinned
    request pins exactly that, see the module docstring). On CUDA a chunk is the
    pinned allocator's block as it comes (``cudaHostAlloc`` returns page-aligned
    memory); on CPU one page more is taken and the chunk page-aligned by hand.
    """

    def __init__(self, limit: int, pin: bool, *, fixed: bool = False):
        self.arena = Arena(0, align=PAGE)
        self.pin = bool(pin)
        self.fixed = bool(fixed)
        self.limit = max(int(limit), 0) // PAGE * PAGE
        self._bases: list[int] = []
        self._chunks: list[torch.Tensor] = []
        self._ptrs: list[int] = []
        self._raws: list[torch.Tensor] = []
        if fixed:
            # the fixed size as powers of two: whole chunks, then the rest's binary digits
            left = self.limit
            sizes = [CHUNK_BYTES] * (left // CHUNK_BYTES)
            sizes += [1 << bit for bit in reversed(range(CHUNK_BYTES.bit_length())) if left % CHUNK_BYTES & (1 << bit)]
            for size in sizes:
                if not self._add(size):
                    break
            if self.capacity < self.limit:
                raise OffloadError(
                    f"host pool: cannot allocate {fmt_bytes(self.limit)} ({self.limit} bytes, host_bytes) of "
                    f"{'pinned' if self.pin else 'host'} memory, {fmt_bytes(self.capacity)} taken: pass a smaller "
                    "host_bytes, or none (the pool then grows as needed)")

    @property
    def capacity(self) -> int:
        """Bytes allocated (the sum of the chunks)."""
        return self.arena.capacity

    @property
    def pinned_bytes(self) -> int:
        return self.capacity if self.pin else 0

    @property
    def chunk_sizes(self) -> list[int]:
        return [int(c.numel()) for c in self._chunks]

    def _add(self, size: int) -> bool:
        """Allocate a chunk of ``size`` bytes; False where the host refuses (nothing added)."""
        try:
            if self.pin:
                raw = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                chunk = raw
            else:
                raw = torch.empty(size + PAGE, dtype=torch.uint8)
                skew = (-raw.data_ptr()) % PAGE
                chunk = raw[skew : skew + size]
        except RuntimeError:  # (out of host memory, or of what may be page-locked)
            return False
        self._bases.append(self.arena.add_chunk(size))
        self._chunks.append(chunk)
        self._ptrs.append(chunk.data_ptr())
        self._raws.append(raw)
        return True

    def chunk_for(self, nbytes: int) -> int:
        """The size of the chunk :meth:`grow` would add for a slot of ``nbytes``: a power of
        two at least ``nbytes``, and at least the pool's size so far up to
        :data:`CHUNK_BYTES` (the pool doubles while small), from 1 MiB."""
        step = min(CHUNK_BYTES, max(_FIRST_CHUNK, 1 << max(self.capacity.bit_length() - 1, 0)))
        return max(_pow2_at_least(_round_up(max(int(nbytes), 1), PAGE)), step)

    def grow(self, nbytes: int) -> bool:
        """Add a chunk with room for a slot of ``nbytes``. False (nothing added) when the
        pool is fixed or the chunk would take it past :attr:`limit`; a smaller chunk,
        just big enough for the slot, is tried before giving up."""
        if self.fixed:
            return False
        for size in (self.chunk_for(nbytes), _pow2_at_least(_round_up(max(int(nbytes), 1), PAGE))):
            if self.capacity + size <= self.limit:
                if self._add(size):
                    return True
                # NOTE: the host refused memory the bound said it had (another process
                # took it since): the pool stops growing here, so evictions spill to the
                # SSD tier or fail with "host pool full" instead of retrying each time
                self.limit = self.capacity
                return False
        return False

    def reserve(self, nbytes: int, largest: int = 0) -> bool:
        """Grow until the pool holds ``nbytes`` and has a chunk for a slot of ``largest``
        bytes. False where :attr:`limit` stops it (what was added stays)."""
        if largest and not any(c >= _round_up(largest, PAGE) for c in self.chunk_sizes):
            if not self.grow(largest):
                return False
        while self.capacity < nbytes:
            if not self.grow(min(CHUNK_BYTES, nbytes - self.capacity)):
                return False
        return True

    def chunk_holding(self, nbytes: int) -> int | None:
        """The offset of a chunk of at least ``nbytes`` (the largest; grown if there is
        none), where a planned layout of that span fits without straddling two chunks;
        None where the pool cannot have one."""
        fits = [(size, base) for base, size in zip(self._bases, self.chunk_sizes) if size >= nbytes]
        if not fits and self.grow(nbytes):
            return self._bases[-1]
        return max(fits)[1] if fits else None

    def _chunk(self, off: int) -> int:
        return bisect.bisect_right(self._bases, off) - 1

    def address(self, off: int) -> int:
        """The host address of offset ``off`` (a slot's first byte)."""
        i = bisect.bisect_right(self._bases, off) - 1
        return self._ptrs[i] + off - self._bases[i]

    def view(self, off: int, nbytes: int) -> torch.Tensor:
        i = self._chunk(off)
        at = off - self._bases[i]
        return self._chunks[i][at : at + nbytes]

    def close(self) -> None:
        self._chunks, self._raws, self._ptrs = [], [], []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(ssd_dir: str | Path) -> list[Path]:
    """Remove run directories left in ``ssd_dir`` by runs whose process is gone (a crash,
    a kill -9). Returns what was removed."""
    removed = []
    root = Path(ssd_dir)
    if not root.is_dir():
        return removed
    for d in root.glob(f"{_PREFIX}*"):
        try:
            pid = int(d.name[len(_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if d.is_dir() and pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def disk_free_bytes(path: str | Path) -> int:
    """Bytes an unprivileged process may still write on ``path``'s filesystem."""
    st = os.statvfs(path)
    return int(st.f_bavail * st.f_frsize)


# NOTE: the SSD file may grow to all but this share of the disk's free space when the
# run starts: the rest is left to what else writes there (checkpoints, logs), since a
# full filesystem fails them, not just us.
DISK_MARGIN = 0.10


def disk_bound(path: str | Path) -> int:
    """The most bytes a default SSD file in ``path`` may grow to: the filesystem's free
    space less :data:`DISK_MARGIN` (0 where ``path`` cannot be looked at)."""
    try:
        return int(disk_free_bytes(path) * (1 - DISK_MARGIN)) // PAGE * PAGE
    except OSError:
        return 0


# The SSD file grows by at least this much (or by what it holds so far, whichever is
# less): fallocate is cheap, but each call is a system call on the thread that evicts.
_FILE_STEP = 256 << 20


class SSDStore:
    """The SSD tier: one pre-allocated file, a bounce arena, and an I/O thread pool.

    Args:
        ssd_dir: where the run's private directory is made (must exist).
        capacity: file size in bytes, allocated at once (``ENOSPC`` here is an
            :class:`SSDError` before training starts).
        limit: the most bytes the file may grow to (:meth:`grow`, with
            ``posix_fallocate``); None: it stays at ``capacity`` (``ssd_bytes=``).
        bounce_bytes: page-aligned host staging memory for transfers in flight. More
            lets more writes overlap compute; a write that finds it full first waits for
            the oldest write in flight.
        workers: I/O threads. NVMe needs a few requests in flight to reach its
            bandwidth; more threads than that only add contention.
        direct: try ``O_DIRECT`` (falls back to buffered I/O plus
            ``posix_fadvise(DONTNEED)`` where the filesystem refuses it, e.g. tmpfs).
        pin: page-lock the bounce memory (CUDA): the device-to-bounce and bounce-to-
            device copies are then DMA on the side stream, asynchronous to the host;
            from pageable memory CUDA would stage them through its own buffer and
            block the host.

    Raises:
        SSDError: the directory cannot be made or the file cannot be pre-allocated.
    """

    def __init__(self, ssd_dir: str | Path, capacity: int, bounce_bytes: int, workers: int = 2, direct: bool = True,
                 pin: bool = False, limit: int | None = None):
        root = Path(ssd_dir)
        if not root.is_dir():
            raise SSDError(f"ssd_dir {root}: not a directory")
        self.removed_stale = clean_stale(root)
        self.capacity = _round_up(max(int(capacity), PAGE), PAGE)
        try:
            self.dir = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=root))  # mode 0700
        except OSError as e:
            raise SSDError(f"ssd_dir {root}: cannot make the run directory ({e.strerror})") from None
        self.path = self.dir / "swap"
        self.fd = -1
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        self.direct = False
        try:
            if direct and hasattr(os, "O_DIRECT"):
                try:
                    self.fd = os.open(self.path, flags | os.O_DIRECT, 0o600)
                    self.direct = True
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
            if self.fd < 0:
                self.fd = os.open(self.path, flags, 0o600)
            os.posix_fallocate(self.fd, 0, self.capacity)
        except OSError as e:
            self._remove()
            raise SSDError(
                f"SSD tier: cannot pre-allocate {fmt_bytes(self.capacity)} ({self.capacity} bytes) in {root}: "
                f"{e.strerror or e}"
            ) from None
        self.arena = Arena(self.capacity, align=PAGE)
        self.fixed = limit is None
        self.limit = self.capacity if limit is None else max(self.capacity, int(limit) // PAGE * PAGE)
        self.bounce = Arena(_round_up(max(int(bounce_bytes), PAGE), PAGE), align=PAGE)
        self.pinned = bool(pin)
        if pin:  # page-locked by CUDA's allocator, page-aligned by hand (O_DIRECT needs it)
            raw = torch.empty(self.bounce.capacity + PAGE, dtype=torch.uint8, pin_memory=True)
            skew = (-raw.data_ptr()) % PAGE
            self._bounce_raw = raw
            self.bounce_buffer = raw[skew : skew + self.bounce.capacity]
            self._bounce_mem = memoryview(self.bounce_buffer.numpy())  # the file I/O's view of it
        else:
            self._bounce_raw = None
            self._bounce_mem = mmap.mmap(-1, self.bounce.capacity)  # anonymous: page-aligned
            self.bounce_buffer = torch.frombuffer(self._bounce_mem, dtype=torch.uint8)
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="tierflow-io")
        self.lock = threading.Lock()
        self.closed = False

    # -- raw I/O (tests inject faults by replacing these) --------------------------------
    def _pwrite(self, buf: memoryview, off: int) -> int:
        return os.pwrite(self.fd, buf, off)

    def _pread(self, buf: memoryview, off: int) -> int:
        return os.preadv(self.fd, [buf], off)

    def _io(self, write: bool, bounce_off: int, file_off: int, nbytes: int, before=None) -> None:
        if before is not None:  # a device-to-bounce copy this transfer must wait for
            before()
        length = _round_up(nbytes, PAGE) if self.direct else nbytes
        mv = memoryview(self._bounce_mem)[bounce_off : bounce_off + length]
        done = 0
        try:
            while done < length:
                n = (self._pwrite if write else self._pread)(mv[done:], file_off + done)
                if n <= 0:
                    raise OSError(errno.EIO, "short transfer")
                done += n
        finally:
            mv.release()
        if not self.direct and not write:
            os.posix_fadvise(self.fd, file_off, length, os.POSIX_FADV_DONTNEED)

    def submit(self, write: bool, bounce_off: int, file_off: int, nbytes: int, before=None) -> Future:
        """Start one read or write between a bounce slot and a file slot."""
        return self.pool.submit(self._io, write, bounce_off, file_off, nbytes, before)

    def bounce_view(self, off: int, nbytes: int) -> torch.Tensor:
        return self.bounce_buffer[off : off + nbytes]

    def grow(self, nbytes: int) -> bool:
        """Extend the file (``posix_fallocate``) by enough for a slot of ``nbytes``, up to
        :attr:`limit`. False where it is fixed, at its limit, or the disk refuses."""
        if self.fixed:
            return False
        n = _round_up(max(int(nbytes), 1), PAGE)
        for size in (max(n, min(self.capacity, _FILE_STEP)), n):
            if self.capacity + size > self.limit:
                continue
            try:
                os.posix_fallocate(self.fd, self.capacity, size)
            except OSError:
                return False
            self.arena.extend(size)
            self.capacity = self.arena.capacity
            return True
        return False

    def reserve(self, nbytes: int) -> bool:
        """Grow the file to at least ``nbytes``; False where :meth:`grow` cannot."""
        return self.capacity >= nbytes or self.grow(nbytes - self.capacity) and self.capacity >= nbytes

    def alloc_file(self, nbytes: int, what: str, at: int | None = None) -> int:
        """A slot of the file: at ``at`` (a planned layout's offset) when that is free,
        else the first that fits, else one the file grows for."""
        off = self.arena.alloc_at(at, nbytes) if at is not None else None
        if off is None:
            off = self.arena.alloc(nbytes)
        if off is None and self.grow(nbytes):
            off = self.arena.alloc(nbytes)
        if off is None:
            fix = "pass a larger ssd_bytes" if self.fixed else (
                f"the file may grow to {fmt_bytes(self.limit)}, the disk's free space less a margin")
            raise SSDError(
                f"SSD tier full: {what} needs {fmt_bytes(nbytes)}, {fmt_bytes(self.arena.free)} free of "
                f"{fmt_bytes(self.capacity)} in {self.path} ({fix})"
            )
        return off

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.pool.shutdown(wait=True)
        self.bounce_buffer = self._bounce_raw = torch.empty(0, dtype=torch.uint8)
        try:
            if isinstance(self._bounce_mem, mmap.mmap):
                self._bounce_mem.close()
            else:
                self._bounce_mem.release()
        except BufferError:  # a view is still alive somewhere; the GC frees it
            pass
        self._remove()

    def _remove(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        shutil.rmtree(self.dir, ignore_errors=True)


__all__ = ["Arena", "HostPool", "OffloadError", "SSDError", "SSDStore", "clean_stale", "disk_bound", "disk_free_bytes",
           "host_available_bytes", "host_memory_bound"]
