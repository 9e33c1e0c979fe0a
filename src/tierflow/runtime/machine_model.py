"""The machine the eager runtime's planner plans for, from what is measured here.

:class:`MachineModel` builds the :class:`~tierflow.hardware.Hardware` a policy plans
for and the simulator predicts with: on CUDA a preset (``h100-80g-pcie5-nvme`` unless
the user named one) with the real device's capacity, the host<->device copy rates
measured here and the runtime's own costs per op; on the CPU, RAM as device and host
with the measured copy bandwidth, the host's optimizer rate and the runtime's measured
costs per op, per move and per host step. It owns those measurements (each made once
per run, the slowest rank's under several ranks) and is the one writer of
``RunStats.link_bytes_per_s``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from ..hardware import Compute, Hardware, HostCompute, Link, Tier, load_hardware
from .stats import RunStats

if TYPE_CHECKING:
    from .host_costs import HostCosts


def _measure_copy_bw(device: torch.device) -> float:
    """Bytes/s of one 16 MiB device-to-host copy (the CPU-mode "link")."""
    n = 16 << 20
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty(n, dtype=torch.uint8)
    b.copy_(a)
    t0 = time.perf_counter()
    for _ in range(3):
        b.copy_(a)
    return 3 * n / max(time.perf_counter() - t0, 1e-9)


def _measure_cuda_links(device: torch.device, nbytes: int = 32 << 20, rounds: int = 3) -> tuple[float, float]:
    """Bytes/s of pinned device-to-host and host-to-device copies of ``nbytes``, timed
    with events on side streams (what the runtime's copies are): each direction alone,
    then both at once on two streams (as a plan's evictions and prefetches overlap).
    Where both directions are slower at once (a bus or a host memory that the two
    share), the concurrent figures are returned: the planner then does not count on a
    rate that a plan moving both ways never gets. (CUDA only; not run on CPU-only CI.)"""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device=device)
    sides = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    for s in sides:
        s.wait_stream(torch.cuda.current_stream(device))

    def timed(copies: list[tuple[torch.cuda.Stream, torch.Tensor, torch.Tensor]]) -> list[float]:
        marks = []
        for side, dst, src in copies:
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)  # (warm)
        for side, _dst, _src in copies:
            side.synchronize()
        for side, dst, src in copies:  # (issued together: they overlap when two streams)
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(side):
                t0.record(side)
                for _ in range(rounds):
                    dst.copy_(src, non_blocking=True)
                t1.record(side)
            marks.append((t0, t1))
        for _t0, t1 in marks:
            t1.synchronize()
        return [rounds * nbytes / max(t0.elapsed_time(t1) / 1e3, 1e-9) for t0, t1 in marks]

    (d2h,) = timed([(sides[0], host, dev)])
    (h2d,) = timed([(sides[0], dev, host)])
    both_d2h, both_h2d = timed([(sides[0], host, dev), (sides[1], dev2, host2)])
    if both_d2h < d2h and both_h2d < h2d:
        return both_d2h, both_h2d
    return d2h, h2d



_HOST_RATE: list[HostCompute] = []  # measured once per process


def _host_optimizer_rate() -> HostCompute:
    """The host's AdamW rate, for plans that step the optimizer on the host. Measured
    once per process at small sizes (a few tens of milliseconds): in CPU mode the
    "device" and the host are the same CPU, so the figure only orders the choices."""
    if not _HOST_RATE:
        from ..capture.host import measure_host_optimizer

        with torch.random.fork_rng(devices=[]):  # (the user's random stream is not ours to draw from)
            _HOST_RATE.append(measure_host_optimizer(sizes=(1 << 14, 1 << 18), repeats=2, params_per_size=2))
    return _HOST_RATE[0]



class MachineModel:
    """The hardware a run's plans are made for (see the module docstring).

    Args:
        device: the run's device.
        stats: the run's stats (this model writes ``link_bytes_per_s``).
        preset: the user's ``hardware=`` (a preset name or a :class:`Hardware`), or None
            to build the machine from measurements.
        sync: a :class:`~tierflow.runtime.distributed.RankSync` under several ranks (each
            figure is then the slowest rank's), else None.
        tier_limits: the most the host pool and the SSD file may hold, as the planner
            is to be told (``Run._tier_limits``).
        has_ssd: the run has an SSD tier.
        probe_move_s: measures one move's cost (CPU mode; ``Moves._probe_move_s``).
        measure_costs: measures the runtime's costs per op, per replayed op and per host
            step (:func:`~tierflow.runtime.host_costs.measure_host_costs` on the run).

    Example:
        >>> m = MachineModel(torch.device("cpu"), RunStats(), preset="h100-80g-pcie5-nvme", sync=None,
        ...                  tier_limits=lambda: (1 << 30, 0), has_ssd=False, probe_move_s=lambda: 1e-5,
        ...                  measure_costs=lambda: None)
        >>> m.hardware(budget=1e9).name
        'h100-80g-pcie5-nvme'
    """

    def __init__(self, device: torch.device, stats: RunStats, *, preset: str | Hardware | None, sync: Any,
                 tier_limits: Callable[[], tuple[int, int]], has_ssd: bool, probe_move_s: Callable[[], float],
                 measure_costs: Callable[[], HostCosts]) -> None:
        self._device = device
        self._stats = stats
        self._preset = preset
        self._sync = sync
        self._tier_limits = tier_limits
        self._has_ssd = has_ssd
        self._probe_move_s = probe_move_s
        self._measure_costs = measure_costs
        self._copy_bw: float | None = None  # CPU: agreed by the ranks before planning
        self._move_s: float | None = None  # CPU mode: one move's cost, measured once
        self._costs: HostCosts | None = None  # the runtime's costs here, measured at the first plan

    @property
    def costs(self) -> HostCosts | None:
        """The runtime's costs measured at the first plan (None before)."""
        return self._costs

    def agree_copy_bw(self) -> None:
        """Under several ranks, before planning: the CPU copy bandwidth every rank plans
        with, the slowest rank's (a collective: every rank calls it)."""
        if self._device.type == "cpu" and self._preset is None:
            self._copy_bw = self._sync.min(_measure_copy_bw(self._device))

    def hardware(self, budget: float) -> Hardware:
        """The machine to plan for under a device ``budget`` (bytes; inf: none)."""
        if self._device.type == "cuda":
            return self._cuda_hardware()
        if self._preset is not None:
            return load_hardware(self._preset)
        sync = self._sync
        bw = self._copy_bw if self._copy_bw is not None else _measure_copy_bw(self._device)
        total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        if sync is not None:
            total = sync.min(total)
        host_cap, ssd_cap = self._tier_limits()
        tiers = [Tier("device", "device", max(total, budget if math.isfinite(budget) else 0)),
                 Tier("host", "host", float(host_cap))]
        links = [Link("device->host", "device", "host", bw), Link("host->device", "host", "device", bw)]
        if self._has_ssd:
            # NVMe-class rates; the runtime's own transfers are what stats report
            tiers.append(Tier("ssd", "ssd", float(ssd_cap), read_bw=2e9, write_bw=1e9, latency_s=1e-4))
            links += [Link("device->ssd", "device", "ssd", bw), Link("ssd->device", "ssd", "device", bw)]
        host = _host_optimizer_rate()
        if self._move_s is None:
            # NOTE: in CPU mode a move's bookkeeping runs on the thread that runs the ops
            # (tens of microseconds of Python): a plan of 200 small moves can lose to one
            # of 40 larger ones that the simulator, without this figure, ranks the same
            self._move_s = self._probe_move_s()
        move_s = self._move_s
        if sync is not None:
            host = replace(host, optimizer_bytes_per_s=sync.min(host.optimizer_bytes_per_s))
            move_s = sync.min(move_s)
        # NOTE: the trace's op times are the ops alone; the lean path's own cost per op
        # (a few to tens of microseconds of Python) is most of a tiny model's step
        costs = self.measured_costs()
        return Hardware("cpu-runtime", "device", tuple(tiers), tuple(links), Compute(1e11, 1e11, 2e10),
                        description="CPU mode: device and host are both RAM, the budget accounted",
                        host_compute=host, move_issue_s=move_s, op_issue_s=costs.op_issue_s,
                        recompute_issue_s=costs.recompute_issue_s, host_step_issue_s=costs.host_step_issue_s,
                        host_copies=True)

    def _cuda_hardware(self) -> Hardware:
        base = load_hardware(self._preset or "h100-80g-pcie5-nvme")
        cap = float(torch.cuda.get_device_properties(self._device).total_memory)
        hw = base.with_tier(base.device, capacity=cap)
        if self._preset is None:
            hw = self._measured_links(hw)
        host_cap, ssd_cap = self._tier_limits()
        host = next((t.name for t in hw.tiers if t.kind == "host"), None)
        if host is not None:
            hw = hw.with_tier(host, capacity=float(host_cap))
        for t in hw.tiers:
            if t.kind == "ssd":
                hw = hw.with_tier(t.name, capacity=float(ssd_cap))
        if self._preset is None:  # (a GPU: the host only queues the kernels)
            costs = self.measured_costs()
            hw = replace(hw, async_launch=True, op_issue_s=costs.op_issue_s,
                         recompute_issue_s=costs.recompute_issue_s)
        return hw

    def measured_costs(self) -> HostCosts:
        """The runtime's costs per op, per replayed op and per host step on this machine,
        measured at the first plan (:mod:`.host_costs`), the slowest rank's (the ranks
        plan alike)."""
        from .host_costs import HostCosts

        if self._costs is None:
            costs = self._measure_costs()
            if self._sync is not None:  # (the largest: a min of the negated figures)
                costs = HostCosts(*(-self._sync.min(-c) for c in (costs.op_issue_s, costs.recompute_issue_s,
                                                                   costs.lean_op_s, costs.host_step_issue_s)))
            self._costs = costs
        return self._costs

    def _measured_links(self, hw: Hardware) -> Hardware:
        """The preset's device<->host links (and the buses they cross) at the copy rates
        measured here: the preset's PCIe figures are a vendor's, this machine's are not."""
        if not self._stats.link_bytes_per_s:
            d2h, h2d = _measure_cuda_links(self._device)
            if self._sync is not None:
                d2h, h2d = self._sync.min(d2h), self._sync.min(h2d)
            self._stats.link_bytes_per_s = {"device->host": d2h, "host->device": h2d}
        rate = self._stats.link_bytes_per_s
        host = {t.name for t in hw.tiers if t.kind == "host"}
        links, buses = [], dict(hw.buses)
        for link in hw.links:
            bw = (rate["device->host"] if link.src == hw.device and link.dst in host
                  else rate["host->device"] if link.dst == hw.device and link.src in host else None)
            if bw is not None:
                links.append(replace(link, bandwidth=bw))
                for b in link.buses:
                    buses[b] = bw
            else:
                links.append(link)
        return replace(hw, links=tuple(links), buses=buses)


__all__ = ["MachineModel"]
