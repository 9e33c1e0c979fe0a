"""The off-device tiers: one pre-allocated host pool and one pre-allocated SSD file.

Neither tier grows. Both are a single allocation made when the run starts, carved up
by :class:`Arena`, a first-fit free list with coalescing: a tensor gets a slot when it
is evicted and gives it back when it is fetched (or dies while away). The pool planner
(:mod:`tierflow.pool`) is not importable as a package yet, so the layout is dynamic
first-fit rather than precomputed offsets; the capacity the planner is told about is
the capacity allocated here, so a planned schedule fits by construction and only
reactive evictions can find a tier full (they then spill to the next tier, or raise).

The SSD tier is one file, ``<ssd_dir>/tierflow-<pid>-<random>/swap``, in a directory of
mode 0700 with the file at 0600, pre-allocated with ``posix_fallocate`` (so "disk
full" is found at start, not mid-step), opened with ``O_DIRECT`` where the filesystem
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
        self.used = 0
        self.peak = 0

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
        # merge with the right neighbour, then the left one
        if i + 1 < len(self._starts) and self._starts[i] + self._sizes[i] == self._starts[i + 1]:
            self._sizes[i] += self._sizes.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == self._starts[i]:
            self._sizes[i - 1] += self._sizes.pop(i)
            self._starts.pop(i)

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        return max(self._sizes, default=0)


class HostPool:
    """The host tier: one buffer of ``capacity`` bytes, pinned when the device is CUDA
    (so copies are true DMA and can run on a side stream), plain memory on CPU.

    Args:
        capacity: bytes. Pinned memory is taken from the OS up front and never returned
            until the run ends: too large starves the host, too small makes evictions
            spill to SSD (or fail without one).
        pin: allocate page-locked memory (only meaningful with CUDA).
    """

    def __init__(self, capacity: int, pin: bool):
        self.arena = Arena(capacity, align=PAGE)
        raw = torch.empty(self.arena.capacity + PAGE, dtype=torch.uint8, pin_memory=pin)
        skew = (-raw.data_ptr()) % PAGE  # page-align the base, so slots can feed O_DIRECT
        self.buffer = raw[skew : skew + self.arena.capacity]
        self._raw = raw

    @property
    def capacity(self) -> int:
        return self.arena.capacity

    def view(self, off: int, nbytes: int) -> torch.Tensor:
        return self.buffer[off : off + nbytes]

    def close(self) -> None:
        self.buffer = self._raw = torch.empty(0, dtype=torch.uint8)


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


class SSDStore:
    """The SSD tier: one pre-allocated file, a bounce arena, and an I/O thread pool.

    Args:
        ssd_dir: where the run's private directory is made (must exist).
        capacity: file size in bytes, allocated at once (``ENOSPC`` here is an
            :class:`SSDError` before training starts).
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
                 pin: bool = False):
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

    def alloc_file(self, nbytes: int, what: str, at: int | None = None) -> int:
        """A slot of the file: at ``at`` (a planned layout's offset) when that is free,
        else the first that fits."""
        off = self.arena.alloc_at(at, nbytes) if at is not None else None
        if off is None:
            off = self.arena.alloc(nbytes)
        if off is None:
            raise SSDError(
                f"SSD tier full: {what} needs {fmt_bytes(nbytes)}, {fmt_bytes(self.arena.free)} free of "
                f"{fmt_bytes(self.capacity)} in {self.path} (pass a larger ssd_bytes)"
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


__all__ = ["Arena", "HostPool", "OffloadError", "SSDError", "SSDStore", "clean_stale"]
