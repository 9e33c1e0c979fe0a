"""Hardware: the compute device, the memory tiers and the links between them.

A machine is a small graph: tiers (GPU memory, pinned host DRAM, persistent memory, SSD)
are nodes, links are directed edges with a bandwidth and a latency, and a link may also
cross named *buses* whose bandwidth it shares with other links (in G10's machine the
SSD's traffic to the GPU crosses the same PCIe lanes as host-to-GPU copies). The
simulator shares each bus, each link and each tier's read and write bandwidth max-min
fairly between the transfers that use them.

Presets ship as TOML files in ``tierflow/presets``; a user-defined machine is a TOML file
of the same form (``tierflow hardware show g10-a100`` prints one to start from)::

    name = "my-box"
    device = "gpu"                      # the tier ops compute on
    fault_latency_us = 45               # cost of an on-demand fetch, before its bytes
    move_issue_us = 0                   # compute-thread time per transfer issued (optional)
    op_issue_us = 0                     # host-thread time per op the runtime dispatches (optional)
    recompute_issue_us = 0              # ... per op a recompute chain replays (optional)
    host_step_issue_us = 0              # ... per host optimizer step issued (optional)
    async_launch = false                # true: the host only queues ops (a GPU), see below
    host_copies = false                 # true: that thread makes each copy itself (CPU mode)
    [compute]
    peak_tflops_fp32 = 19.5
    peak_tflops_bf16 = 312
    mem_bandwidth_gbps = 1555
    [tiers.gpu]
    capacity = "40GiB"
    [tiers.host]
    capacity = "128GiB"
    [[links]]
    src = "host"
    dst = "gpu"
    gbps = 15.754                       # decimal GB/s, as vendors quote it
    buses = ["pcie-h2d"]
    [buses]
    pcie-h2d = 15.754
    [interconnect]                      # optional: GPU-to-GPU, for data-parallel runs
    name = "nvlink3"
    gbps = 300                          # per direction, per GPU, effective (ring algbw)
    latency_us = 5                      # per ring hop
    [host_compute]                      # optional: optimizer steps run on the host
    optimizer_gbps = 22.6               # decimal GB/s of parameter+gradient+state bytes
    source = "DeepSpeed PR #735: ..."   # where the figure comes from

The ``*_issue_us`` figures are the training runtime's own cost on the thread that
dispatches the ops (Python bookkeeping around each op, each replayed recompute op,
each host optimizer step), beyond the ops' durations in the trace. With
``async_launch = false`` (the default, and CPU mode, where that thread runs the ops
itself) every one of them is step time. With ``async_launch = true`` (a GPU: the host
only queues kernels) they advance a host timeline instead, and an op waits for it only
where the host has fallen behind the device (a launch-bound step). With
``host_copies = true`` (CPU mode's ``memmove``) each transfer also costs that thread its
bytes at the route's rate, on top of ``move_issue_us``.

``[host_compute]`` is what a ``HostStep`` costs: ``optimizer_gbps`` is how many bytes of
parameter, gradient and optimizer state a host optimizer update gets through per
second, each tensor's bytes counted once (fp32 Adam: 4 + 4 + 8 = 16 bytes a parameter;
the DRAM traffic is larger, 16 bytes read and 12 written). Its keys are checked: a
misspelt one is an error, not a silently missing figure. The presets' figures and
their sources are in the preset files;
:func:`tierflow.capture.host.measure_host_optimizer` measures this machine's CPU.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

import tomllib

from .errors import HardwareError
from .units import parse_bytes

# "peer" is the other GPUs of a data-parallel run, an endpoint for collectives only
# (tierflow.simulate.parallel adds it); it holds no tensors.
TIER_KINDS = ("device", "host", "pmem", "ssd", "peer")
INF = math.inf


@dataclass(frozen=True)
class Tier:
    """A memory tier. Bandwidths in bytes/s (``inf`` = not a bottleneck), latency in s."""

    name: str
    kind: str
    capacity: float
    read_bw: float = INF
    write_bw: float = INF
    latency_s: float = 0.0


@dataclass(frozen=True)
class Link:
    """A one-directional copy path from ``src`` to ``dst`` tier (one copy engine)."""

    name: str
    src: str
    dst: str
    bandwidth: float
    latency_s: float = 0.0
    buses: tuple[str, ...] = ()


@dataclass(frozen=True)
class Interconnect:
    """The GPU-to-GPU path a data-parallel run's collectives use (NVLink, PCIe peer to
    peer, a network): ``bandwidth`` in bytes/s per direction per GPU, as a ring
    all-reduce achieves it, and ``latency_s`` per ring hop. ``buses`` names buses of
    the machine its traffic also crosses (a PCIe peer-to-peer path shares the GPU's
    lanes with host copies; NVLink does not)."""

    name: str
    bandwidth: float
    latency_s: float = 0.0
    buses: tuple[str, ...] = ()


@dataclass(frozen=True)
class Compute:
    """Peak rates of the compute device, for the roofline cost model."""

    peak_flops_fp32: float
    peak_flops_bf16: float
    mem_bandwidth: float


@dataclass(frozen=True)
class HostCompute:
    """What the host computes, for optimizer updates run there (``HostStep``).

    Attributes:
        optimizer_bytes_per_s: bytes of parameter + gradient + optimizer state an
            optimizer update on the host processes per second (an Adam step on a
            parameter of n fp32 elements processes 16 n bytes: parameter, gradient and
            two moments).
        source: where the figure comes from (a measurement, a paper, a datasheet).
    """

    optimizer_bytes_per_s: float
    source: str = ""


@dataclass(frozen=True)
class Hardware:
    name: str
    device: str
    tiers: tuple[Tier, ...]
    links: tuple[Link, ...]
    compute: Compute
    buses: dict[str, float] = field(default_factory=dict)
    fault_latency_s: float = 0.0
    description: str = ""
    #: Seconds of the compute stream's own thread that issuing one transfer costs (the
    #: runtime's bookkeeping per move, on the thread that also launches the ops): 0 for
    #: the published machines, measured by ``tierflow.offload`` for its CPU mode, where
    #: it decides whether many small moves beat a few large ones.
    move_issue_s: float = 0.0
    #: Seconds of the thread that dispatches the ops that the runtime costs per op of a
    #: followed iteration, beyond the op's duration in the trace (its dispatch mode and
    #: bookkeeping): 0 for the published machines, measured by ``tierflow.offload``.
    op_issue_s: float = 0.0
    #: The same per op a recompute chain replays (beyond the op's duration).
    recompute_issue_s: float = 0.0
    #: The same per host optimizer step issued (beyond the update's own time on the
    #: host-compute stream, which ``host_compute`` models).
    host_step_issue_s: float = 0.0
    #: True where the dispatching thread only queues ops on the compute device (a GPU):
    #: the issue costs above then delay an op only when the host has fallen behind the
    #: device. False (CPU mode): that thread runs the ops, so they are step time.
    async_launch: bool = False
    #: True where a transfer is a copy the dispatching thread makes itself (CPU mode's
    #: ``memmove``): each also costs that thread its bytes at the route's rate.
    host_copies: bool = False
    interconnect: Interconnect | None = None
    host_compute: HostCompute | None = None

    def __post_init__(self) -> None:
        _check(self)

    # -- look-ups -----------------------------------------------------------------------
    @cached_property
    def _tiers(self) -> dict[str, Tier]:
        return {t.name: t for t in self.tiers}

    def tier(self, name: str) -> Tier:
        try:
            return self._tiers[name]
        except KeyError:
            raise HardwareError(
                f"hardware {self.name}: no tier {name!r} (tiers: {', '.join(self._tiers)})"
            ) from None

    def has_tier(self, name: str) -> bool:
        return name in self._tiers

    @property
    def device_tier(self) -> Tier:
        return self.tier(self.device)

    @property
    def device_capacity(self) -> float:
        return self.device_tier.capacity

    @property
    def offload_tiers(self) -> tuple[str, ...]:
        """Tiers other than the device that the device can reach and be reached from,
        fastest round trip first."""
        out = [
            t.name
            for t in self.tiers
            if t.name != self.device and self.route(self.device, t.name) and self.route(t.name, self.device)
        ]
        return tuple(sorted(out, key=lambda n: -self.route_bandwidth(n, self.device)))

    @cached_property
    def _routes(self) -> dict[tuple[str, str], tuple[Link, ...]]:
        """Fewest-hop paths between every pair of tiers; among equals the one with the
        widest bottleneck. A multi-hop route is modelled cut-through (chunks staged in
        the middle tier), so its rate is that of its slowest link."""
        out: dict[tuple[str, str], tuple[Link, ...]] = {}
        by_src: dict[str, list[Link]] = {}
        for link in self.links:
            by_src.setdefault(link.src, []).append(link)
        for src in self._tiers:
            best: dict[str, tuple[Link, ...]] = {src: ()}
            queue = deque([src])
            while queue:
                u = queue.popleft()
                for link in by_src.get(u, []):
                    path = best[u] + (link,)
                    old = best.get(link.dst)
                    if old is None:
                        best[link.dst] = path
                        queue.append(link.dst)
                    elif len(old) == len(path) and _bottleneck(path) > _bottleneck(old):
                        best[link.dst] = path
            for dst, path in best.items():
                if dst != src:
                    out[(src, dst)] = path
        return out

    def route(self, src: str, dst: str) -> tuple[Link, ...]:
        """Links a copy from ``src`` to ``dst`` crosses; empty if there is no path."""
        return self._routes.get((src, dst), ())

    def route_bandwidth(self, src: str, dst: str) -> float:
        """Best-case bytes/s from ``src`` to ``dst`` (0 if unreachable), counting links,
        buses and the tiers' read/write bandwidth."""
        path = self.route(src, dst)
        if not path:
            return 0.0
        bw = min(_bottleneck(path), self.tier(src).read_bw, self.tier(dst).write_bw)
        for link in path:
            for b in link.buses:
                bw = min(bw, self.buses[b])
        return bw

    def route_latency(self, src: str, dst: str) -> float:
        path = self.route(src, dst)
        return sum(link.latency_s for link in path) + self.tier(src).latency_s + self.tier(dst).latency_s

    def transfer_time(self, nbytes: float, src: str, dst: str) -> float:
        """Seconds to move ``nbytes`` alone on an idle machine."""
        bw = self.route_bandwidth(src, dst)
        if bw <= 0:
            return INF
        return self.route_latency(src, dst) + nbytes / bw

    # -- variants -----------------------------------------------------------------------
    def with_tier(self, name: str, **changes: Any) -> Hardware:
        """A copy with one tier's fields changed, e.g. ``hw.with_tier("host", capacity=0)``."""
        tiers = tuple(dataclasses.replace(t, **changes) if t.name == name else t for t in self.tiers)
        self.tier(name)
        return dataclasses.replace(self, tiers=tiers)

    def scaled_links(self, factor: float, which: str | None = None) -> Hardware:
        """A copy whose links (those touching tier ``which``, or all) and the buses they
        cross are ``factor`` times faster."""
        links, buses = [], dict(self.buses)
        for link in self.links:
            if which is None or which in (link.src, link.dst):
                links.append(dataclasses.replace(link, bandwidth=link.bandwidth * factor))
                for b in link.buses:
                    buses[b] = self.buses[b] * factor
            else:
                links.append(link)
        return dataclasses.replace(self, links=tuple(links), buses=buses)

    # -- presentation -------------------------------------------------------------------
    def to_toml(self) -> str:
        """The TOML form that :func:`load_hardware` reads back."""

        def num(x: float) -> str:
            return "inf" if x == INF else repr(float(x))

        lines = [f'name = "{self.name}"']
        if self.description:
            lines.append(f'description = "{self.description}"')
        lines += [f'device = "{self.device}"', f"fault_latency_us = {num(self.fault_latency_s * 1e6)}"]
        for key, v in _ISSUE_COSTS:
            if getattr(self, v):
                lines.append(f"{key} = {num(getattr(self, v) * 1e6)}")
        for key in _FLAGS:
            if getattr(self, key):
                lines.append(f"{key} = true")
        lines.append("")
        c = self.compute
        lines += [
            "[compute]",
            f"peak_tflops_fp32 = {num(c.peak_flops_fp32 / 1e12)}",
            f"peak_tflops_bf16 = {num(c.peak_flops_bf16 / 1e12)}",
            f"mem_bandwidth_gbps = {num(c.mem_bandwidth / 1e9)}",
            "",
        ]
        for t in self.tiers:
            lines += [f"[tiers.{t.name}]", f'kind = "{t.kind}"']
            lines.append("capacity = inf" if t.capacity == INF else f"capacity = {int(t.capacity)}")
            if t.read_bw != INF:
                lines.append(f"read_gbps = {num(t.read_bw / 1e9)}")
            if t.write_bw != INF:
                lines.append(f"write_gbps = {num(t.write_bw / 1e9)}")
            if t.latency_s:
                lines.append(f"latency_us = {num(t.latency_s * 1e6)}")
            lines.append("")
        for link in self.links:
            lines += [
                "[[links]]",
                f'name = "{link.name}"',
                f'src = "{link.src}"',
                f'dst = "{link.dst}"',
                f"gbps = {num(link.bandwidth / 1e9)}",
            ]
            if link.latency_s:
                lines.append(f"latency_us = {num(link.latency_s * 1e6)}")
            if link.buses:
                lines.append("buses = [" + ", ".join(f'"{b}"' for b in link.buses) + "]")
            lines.append("")
        if self.buses:
            lines.append("[buses]")
            lines += [f'"{k}" = {num(v / 1e9)}' for k, v in self.buses.items()]
        if self.interconnect is not None:
            ic = self.interconnect
            lines += ["", "[interconnect]", f'name = "{ic.name}"', f"gbps = {num(ic.bandwidth / 1e9)}"]
            if ic.latency_s:
                lines.append(f"latency_us = {num(ic.latency_s * 1e6)}")
            if ic.buses:
                lines.append("buses = [" + ", ".join(f'"{b}"' for b in ic.buses) + "]")
        if self.host_compute is not None:
            hc = self.host_compute
            lines += ["", "[host_compute]", f"optimizer_gbps = {num(hc.optimizer_bytes_per_s / 1e9)}"]
            if hc.source:
                lines.append(f"source = {json.dumps(hc.source)}")  # a JSON string is a TOML basic string
        return "\n".join(lines) + "\n"


# the per-thread costs: (TOML key in microseconds, Hardware attribute in seconds)
_ISSUE_COSTS = (("move_issue_us", "move_issue_s"), ("op_issue_us", "op_issue_s"),
                ("recompute_issue_us", "recompute_issue_s"), ("host_step_issue_us", "host_step_issue_s"))
_FLAGS = ("async_launch", "host_copies")  # (TOML key = attribute)


def _bottleneck(path: tuple[Link, ...]) -> float:
    return min(link.bandwidth for link in path) if path else INF


def _check(hw: Hardware) -> None:
    where = f"hardware {hw.name}"
    names = [t.name for t in hw.tiers]
    if len(set(names)) != len(names):
        raise HardwareError(f"{where}: tier names repeat: {names}")
    if hw.device not in names:
        raise HardwareError(f"{where}: field 'device' names {hw.device!r}, which is not a tier ({', '.join(names)})")
    for t in hw.tiers:
        if t.kind not in TIER_KINDS:
            raise HardwareError(f"{where}: tier {t.name}: field 'kind' is {t.kind!r}, expected one of {', '.join(TIER_KINDS)}")
        for fld in ("capacity", "read_bw", "write_bw"):
            v = getattr(t, fld)
            if not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
                raise HardwareError(f"{where}: tier {t.name}: field '{fld}' must be >= 0, got {v!r}")
        if t.read_bw == 0 or t.write_bw == 0:
            raise HardwareError(f"{where}: tier {t.name}: bandwidths must be > 0")
        if t.latency_s < 0:
            raise HardwareError(f"{where}: tier {t.name}: field 'latency' must be >= 0")
    link_names = [link.name for link in hw.links]
    if len(set(link_names)) != len(link_names):
        raise HardwareError(f"{where}: link names repeat: {link_names}")
    for link in hw.links:
        for end in (link.src, link.dst):
            if end not in names:
                raise HardwareError(f"{where}: link {link.name}: names tier {end!r}, which does not exist ({', '.join(names)})")
        if link.src == link.dst:
            raise HardwareError(f"{where}: link {link.name}: src and dst are both {link.src!r}")
        if not link.bandwidth > 0 or math.isnan(link.bandwidth):
            raise HardwareError(f"{where}: link {link.name}: field 'gbps' must be > 0, got {link.bandwidth / 1e9!r}")
        if link.latency_s < 0:
            raise HardwareError(f"{where}: link {link.name}: field 'latency_us' must be >= 0")
        for b in link.buses:
            if b not in hw.buses:
                raise HardwareError(f"{where}: link {link.name}: bus {b!r} is not declared under [buses]")
    for b, bw in hw.buses.items():
        if not bw > 0:
            raise HardwareError(f"{where}: bus {b}: bandwidth must be > 0, got {bw!r}")
    if hw.fault_latency_s < 0:
        raise HardwareError(f"{where}: field 'fault_latency_us' must be >= 0")
    for key, attr in _ISSUE_COSTS:
        v = getattr(hw, attr)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < INF:
            raise HardwareError(f"{where}: field '{key}' must be a finite number >= 0, "
                                f"got {v * 1e6 if isinstance(v, (int, float)) else v!r}")
    for key in _FLAGS:
        if not isinstance(getattr(hw, key), bool):
            raise HardwareError(f"{where}: field '{key}' must be true or false, got {getattr(hw, key)!r}")
    ic = hw.interconnect
    if ic is not None:
        if not ic.bandwidth > 0 or ic.bandwidth == INF:
            raise HardwareError(f"{where}: [interconnect]: field 'gbps' must be a finite number > 0")
        if not ic.latency_s >= 0:
            raise HardwareError(f"{where}: [interconnect]: field 'latency_us' must be >= 0")
        for b in ic.buses:
            if b not in hw.buses:
                raise HardwareError(f"{where}: [interconnect]: bus {b!r} is not declared under [buses]")
    hc = hw.host_compute
    if hc is not None:
        v = hc.optimizer_bytes_per_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise HardwareError(f"{where}: [host_compute]: field 'optimizer_gbps' must be a finite number > 0, "
                                f"got {v / 1e9 if isinstance(v, (int, float)) else v!r}")
        if not isinstance(hc.source, str):
            raise HardwareError(f"{where}: [host_compute]: field 'source' must be a string, got {hc.source!r}")


# -- loading ----------------------------------------------------------------------------

_PRESET_PACKAGE = "tierflow.presets"


def preset_names() -> list[str]:
    files = resources.files(_PRESET_PACKAGE).iterdir()
    return sorted(f.name[: -len(".toml")] for f in files if f.name.endswith(".toml"))


def load_hardware(spec: str | Path | Hardware) -> Hardware:
    """A preset by name (``g10-a100``) or a TOML file by path.

    Raises:
        HardwareError: unknown preset, unreadable file, or a field that is missing or
            out of range (the message names the file, the table and the field).
    """
    if isinstance(spec, Hardware):
        return spec
    text_spec = str(spec)
    if text_spec in preset_names():
        text = resources.files(_PRESET_PACKAGE).joinpath(text_spec + ".toml").read_text("utf-8")
        return hardware_from_toml(text, source=f"preset {text_spec}")
    path = Path(text_spec)
    if not path.exists():
        raise HardwareError(
            f"{text_spec}: neither a hardware preset ({', '.join(preset_names())}) nor a TOML file"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise HardwareError(f"{path}: cannot read ({e})") from None
    return hardware_from_toml(text, source=str(path))


def hardware_from_toml(text: str, source: str = "<toml>") -> Hardware:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise HardwareError(f"{source}: not valid TOML ({e})") from None
    try:
        return _from_dict(data, source)
    except HardwareError as e:
        msg = str(e)
        raise HardwareError(msg if msg.startswith(source) else f"{source}: {msg}") from None


def _num(table: dict, key: str, where: str, default: float | None = None) -> float:
    if key not in table:
        if default is None:
            raise HardwareError(f"{where}: missing field '{key}'")
        return default
    v = table[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise HardwareError(f"{where}: field '{key}' must be a number, got {v!r}")
    return float(v)


def _capacity(table: dict, where: str) -> float:
    if "capacity" not in table:
        raise HardwareError(f"{where}: missing field 'capacity'")
    v = table["capacity"]
    if isinstance(v, float) and v == INF:
        return INF
    try:
        return float(parse_bytes(v))
    except ValueError as e:
        raise HardwareError(f"{where}: field 'capacity': {e}") from None


def _from_dict(data: dict, source: str) -> Hardware:
    for key in ("name", "device", "compute", "tiers"):
        if key not in data:
            raise HardwareError(f"{source}: missing field '{key}'")
    comp = data["compute"]
    compute = Compute(
        peak_flops_fp32=_num(comp, "peak_tflops_fp32", f"{source} [compute]") * 1e12,
        peak_flops_bf16=_num(comp, "peak_tflops_bf16", f"{source} [compute]") * 1e12,
        mem_bandwidth=_num(comp, "mem_bandwidth_gbps", f"{source} [compute]") * 1e9,
    )
    tiers = []
    if not isinstance(data["tiers"], dict) or not data["tiers"]:
        raise HardwareError(f"{source}: [tiers] must hold at least one tier table")
    for name, t in data["tiers"].items():
        where = f"{source} [tiers.{name}]"
        kind = t.get("kind", "device" if name == data["device"] else name)
        tiers.append(
            Tier(
                name=name,
                kind=kind,
                capacity=_capacity(t, where),
                read_bw=_num(t, "read_gbps", where, INF) * 1e9,
                write_bw=_num(t, "write_gbps", where, INF) * 1e9,
                latency_s=_num(t, "latency_us", where, 0.0) * 1e-6,
            )
        )
    links = []
    for i, rec in enumerate(data.get("links", [])):
        where = f"{source} [[links]] #{i + 1}"
        for key in ("src", "dst"):
            if key not in rec:
                raise HardwareError(f"{where}: missing field '{key}'")
        buses = rec.get("buses", [])
        if not isinstance(buses, list):
            raise HardwareError(f"{where}: field 'buses' must be a list of bus names")
        links.append(
            Link(
                name=rec.get("name", f"{rec['src']}->{rec['dst']}"),
                src=rec["src"],
                dst=rec["dst"],
                bandwidth=_num(rec, "gbps", where) * 1e9,
                latency_s=_num(rec, "latency_us", where, 0.0) * 1e-6,
                buses=tuple(buses),
            )
        )
    buses = {k: _num(data.get("buses", {}), k, f"{source} [buses]") * 1e9 for k in data.get("buses", {})}
    interconnect = None
    if "interconnect" in data:
        ic = data["interconnect"]
        where = f"{source} [interconnect]"
        if not isinstance(ic, dict):
            raise HardwareError(f"{where}: must be a table")
        ic_buses = ic.get("buses", [])
        if not isinstance(ic_buses, list):
            raise HardwareError(f"{where}: field 'buses' must be a list of bus names")
        interconnect = Interconnect(
            name=str(ic.get("name", "interconnect")),
            bandwidth=_num(ic, "gbps", where) * 1e9,
            latency_s=_num(ic, "latency_us", where, 0.0) * 1e-6,
            buses=tuple(ic_buses),
        )
    return Hardware(
        name=str(data["name"]),
        device=str(data["device"]),
        tiers=tuple(tiers),
        links=tuple(links),
        compute=compute,
        buses=buses,
        fault_latency_s=_num(data, "fault_latency_us", source, 0.0) * 1e-6,
        **{attr: _num(data, key, source, 0.0) * 1e-6 for key, attr in _ISSUE_COSTS},
        **{key: _flag(data, key, source) for key in _FLAGS},
        description=str(data.get("description", "")),
        interconnect=interconnect,
        host_compute=_host_compute(data, source),
    )


def _flag(table: dict, key: str, where: str) -> bool:
    v = table.get(key, False)
    if not isinstance(v, bool):
        raise HardwareError(f"{where}: field '{key}' must be true or false, got {v!r}")
    return v


_HOST_COMPUTE_KEYS = ("optimizer_gbps", "source")


def _host_compute(data: dict, source: str) -> HostCompute | None:
    if "host_compute" not in data:
        return None
    hc = data["host_compute"]
    where = f"{source} [host_compute]"
    if not isinstance(hc, dict):
        raise HardwareError(f"{where}: must be a table")
    unknown = sorted(set(hc) - set(_HOST_COMPUTE_KEYS))
    if unknown:
        raise HardwareError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(_HOST_COMPUTE_KEYS)})")
    gbps = _num(hc, "optimizer_gbps", where)
    if not math.isfinite(gbps) or gbps <= 0:
        raise HardwareError(f"{where}: field 'optimizer_gbps' must be a finite number > 0, got {gbps!r}")
    src = hc.get("source", "")
    if not isinstance(src, str):
        raise HardwareError(f"{where}: field 'source' must be a string, got {src!r}")
    return HostCompute(optimizer_bytes_per_s=gbps * 1e9, source=src)
