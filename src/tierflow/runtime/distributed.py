"""tierflow's runtime under ``torch.distributed``: ranks that agree on one plan, and a
local launcher.

Each rank runs its own :func:`~tierflow.runtime.offload`: it profiles, plans and moves
its own tensors (under DDP the whole replicated model, under FSDP2 its shard of the
parameters, gradients and optimizer state) and its own activations. What the ranks
share is the *plan*: ranks that step in lockstep through collectives go as fast as the
slowest, so they should plan from the same trace. :class:`RankSync` makes that so:

* at the end of every iteration the ranks agree (one all-reduce of one integer) on
  whether all of them have a profiled iteration to plan from; one that departed from
  the plan (a stale trace) makes every rank profile again, so planning, which calls
  collectives, never runs on one rank alone;
* before planning, the ranks check that they profiled the same iteration (a digest of
  the trace's ops, tensors, sizes and kinds), take for each op the slowest rank's
  measured time and the slowest measured copy bandwidth, so every rank hands the policy
  the same trace and hardware;
* after planning, they compare a digest of the plan and raise :class:`RankMismatchError`
  naming the ranks if any differ (a policy that is not a pure function of its inputs,
  for example one cut by a wall-clock limit).

These collectives run on a process group of their own (gloo, CPU tensors), created when
the ``with`` block opens, so they never interleave with the model's own collectives and
work beside NCCL too.

:func:`launch` runs ``tierflow train`` on N local processes (what ``--nproc N`` does):
it is ``torchrun --nproc-per-node N -m tierflow.cli train ...`` without torchrun.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import torch

from .errors import OffloadError


class RankMismatchError(OffloadError):
    """Ranks profiled different iterations or made different plans."""


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _digest(obj: Any) -> str:
    return hashlib.blake2b(json.dumps(obj, sort_keys=True, default=str).encode(), digest_size=8).hexdigest()


def trace_digest(trace: Any) -> str:
    """A digest of what the planner sees of a trace except what timing decides (measured
    times, when a storage was really freed): every op's name, phase, inputs and
    outputs, every tensor's size, kind, persistence, key and whether it is external."""
    ops = [(o.name, o.phase, list(o.inputs), list(o.outputs)) for o in trace.ops]
    tensors = [(t.bytes, t.kind, t.persistent, t.key, t.external) for t in trace.tensors]
    return _digest([ops, tensors])


def plan_digest(plan: Any) -> str:
    """A digest of a plan's schedule (its moves, kind, budget), not of its ``meta``."""
    d = plan.to_dict()
    d.pop("meta", None)
    return _digest(d)


class RankSync:
    """Agreement between the ranks of the default process group (see the module
    docstring). Every method is a collective: all ranks call it at the same point."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo")

    def close(self) -> None:
        try:
            self.dist.destroy_process_group(self.group)
        except Exception:  # the default group may already be gone; nothing to free then
            pass

    def _reduce(self, values: list[float], op: Any, dtype=torch.float64) -> list[float]:
        t = torch.tensor(values, dtype=dtype)
        self.dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    def agree(self, want: bool) -> tuple[bool, bool]:
        """``(all ranks want, some rank wants)``: whether to plan now."""
        n = int(self._reduce([1 if want else 0], self.dist.ReduceOp.SUM, torch.int64)[0])
        return n == self.world_size, n > 0

    def gather_strings(self, s: str) -> list[str]:
        out: list[Any] = [None] * self.world_size
        self.dist.all_gather_object(out, s, group=self.group)
        return [str(x) for x in out]

    def check_same(self, what: str, value: str, detail: str = "") -> None:
        """Raise :class:`RankMismatchError` on every rank if the ranks' ``value`` differ."""
        got = self.gather_strings(value)
        if len(set(got)) > 1:
            groups: dict[str, list[int]] = {}
            for r, v in enumerate(got):
                groups.setdefault(v, []).append(r)
            parts = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {v}" for v, rs in groups.items())
            raise RankMismatchError(f"offload: the ranks {what} ({parts}){detail}")

    def slowest(self, durations: list[float]) -> list[float]:
        """Each op's measured time, the slowest rank's."""
        if not durations:
            return []
        return self._reduce(durations, self.dist.ReduceOp.MAX)

    def min(self, x: float) -> float:
        return float(self._reduce([x], self.dist.ReduceOp.MIN)[0])


# == the launcher ==========================================================================
def free_port() -> int:
    """A TCP port free on the loopback interface now (for ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In a launched rank (Linux): be killed if the launcher dies (PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))
    except (OSError, AttributeError):
        pass


def launch(nproc: int, command: list[str], timeout_s: float | None = None) -> tuple[list[int], list[str], list[str]]:
    """Run ``command`` (for ``tierflow train --nproc``: ``python -m tierflow.cli train
    ...``) as ``nproc`` local processes, as torchrun would (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` on
    127.0.0.1 and a free port; ``OMP_NUM_THREADS`` the cores over N unless set). Returns each rank's exit code, stdout and stderr. A rank
    that fails ends the others (they would wait for it in their next collective: their
    code is then negative, the signal); so does ``timeout_s`` (every rank still running
    gets code 124).
    """
    import threading

    if nproc < 1:
        raise OffloadError(f"--nproc must be >= 1, got {nproc}")
    port = free_port()
    procs = []
    # as torchrun: ranks share the cores (N ranks with a thread per core each crawl)
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))
    for r in range(nproc):
        env = dict(os.environ, OMP_NUM_THREADS=threads, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      preexec_fn=_die_with_parent if sys.platform == "linux" else None))
    outs: list[str] = [""] * nproc
    errs: list[str] = [""] * nproc

    def read(i: int) -> None:
        outs[i], errs[i] = procs[i].communicate()

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(nproc)]
    for t in readers:
        t.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    late = False
    try:
        while any(p.poll() is None for p in procs):
            late = deadline is not None and time.monotonic() > deadline
            if late or any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
    finally:  # a failed rank, the deadline, or Ctrl-C here: end the ranks still running
        for p in procs:
            if p.poll() is None:
                p.kill()
    for t in readers:
        t.join()
    codes = []
    for p in procs:
        rc = p.wait()
        codes.append(124 if late and rc < 0 else rc)
    return codes, outs, errs


__all__ = ["RankMismatchError", "RankSync", "free_port", "launch", "plan_digest", "trace_digest", "world"]
