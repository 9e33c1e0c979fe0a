"""The report's figures, drawn with matplotlib (imported inside the functions, so that
``import tierflow`` stays light).

Figures are built with :class:`matplotlib.figure.Figure` directly (no pyplot, no global
state, no display needed) and rendered to SVG or PNG bytes by :func:`render`.

* :func:`timeline_figure`: one policy's step on a shared time axis: bytes held per tier
  (stacked, with the device capacity and budget), then the compute stream (ops by phase,
  stalls in red) and a Gantt row per link (transfers by kind).
* :func:`comparison_figure`: every policy side by side: where the step's time goes
  (compute alone, compute overlapped with transfers, stalls) and the bytes each link
  moved.

Colours are fixed per tier kind (device blue, host orange, persistent memory green, SSD
purple) and per transfer kind, the same in every figure.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..units import fmt_bytes, fmt_seconds
from .analysis import breakdown, phase_intervals, stall_intervals, transfer_intervals
from .downsample import downsample_steps, merge_intervals

GIB = float(2**30)

TIER_COLORS = {"device": "#4C72B0", "host": "#DD8452", "pmem": "#55A868", "ssd": "#8172B3"}
_SPARE_COLORS = ("#64B5CD", "#CCB974", "#DA8BC3", "#8C8C8C")
KIND_COLORS = {"evict": "#E9A23B", "prefetch": "#2A9D8F", "fault": "#B5179E",
               "host_grad": "#6A4C93", "host_param": "#1982C4"}
KIND_LABELS = {"evict": "evict (off the device)", "prefetch": "prefetch (planned)", "fault": "fault (on demand)",
               "host_grad": "gradient to the host (host step)", "host_param": "updated parameter back (host step)"}
RECOMPUTE_COLOR = "#F4A261"  # recompute chains on the compute stream
HOST_COLOR = "#8AC926"  # optimizer updates on the host's stream
PHASE_COLORS = {"forward": "#C9C9C9", "backward": "#A3A3A3", "optimizer": "#767676"}
STALL_COLOR = "#E63946"
OVERLAP_COLOR = "#3D5A80"
MEASURED_COLOR = "#111111"

WIDTH_IN = 12.0
DPI = 110


def tier_colors(hardware: Any) -> dict[str, str]:
    """A colour per tier of ``hardware``, by tier kind (stable across figures and runs).

    Example:
        >>> from tierflow import load_hardware
        >>> tier_colors(load_hardware("g10-a100"))["gpu"]
        '#4C72B0'
    """
    out: dict[str, str] = {}
    used: set[str] = set()
    spare = iter(_SPARE_COLORS)
    for t in hardware.tiers:
        c = TIER_COLORS.get(t.kind)
        if c is None or c in used:
            c = next(spare, "#444444")
        out[t.name] = c
        used.add(c)
    return out


def time_scale(seconds: float) -> tuple[str, float]:
    """The unit a time axis of this length reads best in: ``("s", 1)`` from 2 s up,
    else ``("ms", 1000)``.

    Example:
        >>> time_scale(0.3)
        ('ms', 1000.0)
    """
    return ("s", 1.0) if seconds >= 2.0 else ("ms", 1000.0)


def shown_tiers(hardware: Any, results: Sequence[Any]) -> list[str]:
    """Tiers worth a layer: the device, and any tier some result put bytes in."""
    out = []
    for t in hardware.tiers:
        if t.name == hardware.device or any(r.peak_bytes.get(t.name, 0) > 0 for r in results):
            out.append(t.name)
    return out


def shown_links(hardware: Any, results: Sequence[Any]) -> list[str]:
    """Links worth a Gantt row: those some result moved bytes over (hardware order)."""
    used = {name for r in results for name, b in r.traffic_bytes.items() if b > 0}
    used |= {name for r in results for t in r.transfers for name in t.links}
    return [link.name for link in hardware.links if link.name in used]


def timeline_figure(trace: Any, hardware: Any, result: Any, *, tiers: Sequence[str] | None = None,
                    links: Sequence[str] | None = None, measured: Any = None, buckets: int = 1000):
    """One policy's simulated step: memory per tier, compute with stalls, link Gantt.

    Args:
        trace: the trace simulated (for op phases).
        hardware: the machine (tier colours, capacity).
        result: a :class:`~tierflow.simulate.result.SimResult` that ran (finite time).
        tiers, links: which tiers to stack and which links get a row (default: those
            this result used); pass the same lists for every policy of a report so the
            figures line up.
        measured: a :class:`~tierflow.report.measured.Measured`; its device memory curve
            is drawn over the prediction.
        buckets: time buckets for thinning (about the plot's width in pixels).

    Returns:
        A :class:`matplotlib.figure.Figure`.

    Raises:
        ValueError: the result did not run (its time is infinite).

    Example:
        >>> from tierflow import load_hardware
        >>> from tierflow.policies import make_plan
        >>> from tierflow.simulate import simulate
        >>> from tierflow.synthetic import gpt_trace
        >>> hw = load_hardware("rtx4090-24g")
        >>> tr = gpt_trace(hw, layers=2, d_model=256, batch=2, seq=128)
        >>> fig = timeline_figure(tr, hw, simulate(tr, hw, make_plan("lru", tr, hw)))
        >>> len(fig.axes)
        2
    """
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if not math.isfinite(result.time_s):
        raise ValueError(f"{result.policy}: the plan did not run ({result.error}); nothing to draw")
    tiers = list(tiers) if tiers is not None else shown_tiers(hardware, [result])
    links = list(links) if links is not None else shown_links(hardware, [result])
    colors = tier_colors(hardware)
    end = float(result.op_end_s[-1]) if len(result.op_end_s) else float(result.time_s)
    end = end if end > 0 else 1.0
    unit, k = time_scale(end)
    px = end / buckets  # seconds per pixel

    host_row = bool(getattr(result, "host_steps", None))
    n_rows = 2 + len(links) + host_row
    fig = Figure(figsize=(WIDTH_IN, 4.2 + 0.45 * n_rows + 0.6), dpi=DPI)
    gs = fig.add_gridspec(2, 1, height_ratios=[4.2, 0.45 * n_rows + 0.3], hspace=0.08)
    ax = fig.add_subplot(gs[0])
    gx = fig.add_subplot(gs[1], sharex=ax)

    # -- memory: stacked step curves ----------------------------------------------------
    curves = [result.memory.get(name, (np.zeros(0), np.zeros(0))) for name in tiers]
    grid, vals = downsample_steps(curves, buckets, 0.0, end)
    grid = np.r_[grid, end]
    vals = [np.r_[v, v[-1] if len(v) else 0.0] for v in vals]
    base = np.zeros(len(grid))
    top = 0.0
    for name, v in zip(tiers, vals):
        upper = base + v / GIB
        label = name + (" (device)" if name == hardware.device else "")
        peak = result.peak_bytes.get(name, 0)
        label += f", peak {fmt_bytes(peak)}"
        if len(v) and v.max() > 0:
            ax.fill_between(grid * k, base, upper, step="post", color=colors[name], alpha=0.85,
                            linewidth=0, label=label)
            ax.step(grid * k, upper, where="post", color=colors[name], linewidth=0.6)
        else:  # an empty layer: in the legend (so every policy lists the same tiers), not drawn
            ax.fill_between([], [], [], color=colors[name], alpha=0.85, linewidth=0, label=label)
        base = upper
        top = max(top, float(upper.max()) if len(upper) else 0.0)
    budget = result.budget_bytes / GIB if math.isfinite(result.budget_bytes) else math.inf
    show_budget = budget < hardware.device_capacity / GIB * 0.999
    if show_budget:
        ax.axhline(budget, color="#222222", linestyle=":", linewidth=1.2, label=f"budget {fmt_bytes(result.budget_bytes)}")
        top = max(top, budget)
    dev_curve = result.memory.get(hardware.device)
    if dev_curve is not None and len(dev_curve[0]):
        i = int(np.argmax(dev_curve[1]))
        ax.plot([dev_curve[0][i] * k], [dev_curve[1][i] / GIB], marker="v", color="#222222",
                markersize=6, linestyle="none")
    if measured is not None and hardware.device in measured.memory:
        mt, mb = measured.memory[hardware.device]
        mg, (mv,) = downsample_steps([(mt, mb)], buckets, 0.0, max(end, float(mt[-1]) if len(mt) else end))
        ax.step(mg * k, mv / GIB, where="post", color=MEASURED_COLOR, linewidth=1.4,
                label=f"{measured.source} {hardware.device}")
        top = max(top, float(mv.max()) / GIB if len(mv) else 0.0)
    # the capacity line, unless a small budget would squash the plot under it
    cap = hardware.device_capacity / GIB
    cap_label = f"{hardware.device} capacity {fmt_bytes(hardware.device_capacity)}"
    if cap <= 2.0 * top or not show_budget:
        ax.axhline(cap, color="#222222", linestyle="--", linewidth=1.2, label=cap_label)
        top = max(top, cap)
    else:
        ax.plot([], [], color="#222222", linestyle="--", linewidth=1.2, label=cap_label + "\n(off the scale)")
    ax.set_ylim(0, (top or 1.0) * 1.12)
    ax.set_ylabel("bytes held (GiB)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8.5, frameon=False)
    ax.tick_params(labelbottom=False)
    ax.set_title(
        f"{result.policy}: {fmt_seconds(result.time_s)} a step, {result.ratio:.2f} of ideal, "
        f"{fmt_seconds(result.stall_s)} stalled ({result.trace} on {result.hardware})",
        loc="left", fontsize=11,
    )

    # -- Gantt: compute (with stalls) and one row per link -------------------------------
    rows = ["compute", "stalls"] + (["host"] if host_row else []) + links
    y_of = {name: n_rows - 1 - i for i, name in enumerate(rows)}  # compute on top
    y = y_of["compute"]
    for phase, color in PHASE_COLORS.items():
        s, e = phase_intervals(trace, result, phase, min_gap=px)
        if len(s):
            gx.broken_barh(list(zip(s * k, (e - s) * k)), (y - 0.35, 0.7), color=color, linewidth=0)
    chains = getattr(result, "recomputes", None) or []
    if chains:  # the chains run between ops, on the same stream
        s, e = merge_intervals(np.array([c.start_s for c in chains]), np.array([c.end_s for c in chains]),
                               min_width=px, min_gap=px)
        gx.broken_barh(list(zip(s * k, (e - s) * k)), (y - 0.35, 0.7), color=RECOMPUTE_COLOR, linewidth=0)
    if host_row:
        work = [(h.start_s, h.end_s if math.isfinite(h.end_s) else end) for h in result.host_steps
                if math.isfinite(h.start_s) and h.start_s < end]
        if work:
            s, e = merge_intervals(np.array([a for a, _ in work]), np.minimum(np.array([b for _, b in work]), end),
                                   min_width=px, min_gap=px)
            gx.broken_barh(list(zip(s * k, (e - s) * k)), (y_of["host"] - 0.35, 0.7), color=HOST_COLOR,
                           linewidth=0)
    ss, se = stall_intervals(result)
    ss, se = merge_intervals(ss, se, min_width=px, min_gap=px)
    if len(ss):
        gx.broken_barh(list(zip(ss * k, (se - ss) * k)), (y_of["stalls"] - 0.35, 0.7), color=STALL_COLOR,
                       linewidth=0)
    b = breakdown(result)
    labels = {"compute": "compute\nby phase",
              "stalls": f"stalls\n{b.stalled_ops if b else 0} ops, {fmt_seconds(result.stall_s)}",
              "host": f"host updates\n{fmt_seconds(getattr(result, 'host_step_s', 0.0))}"}
    kinds_drawn: set[str] = set()
    for name in links:
        y = y_of[name]
        kinds = [kd for kd in KIND_COLORS if any(t.kind == kd and name in t.links for t in result.transfers)]
        lane_h = 0.76 / max(1, len(kinds))
        for j, kd in enumerate(kinds):
            s, e = transfer_intervals(result, 0.0, end, link=name, kind=kd)
            s, e = merge_intervals(s, e, min_width=px, min_gap=px)
            lo = y + 0.38 - (j + 1) * lane_h
            gx.broken_barh(list(zip(s * k, (e - s) * k)), (lo, lane_h * 0.92), color=KIND_COLORS[kd], linewidth=0)
            kinds_drawn.add(kd)
        busy = b.link_busy_s.get(name, 0.0) if b else 0.0
        labels[name] = f"{name}\n{busy / end:.0%} busy"
    gx.set_yticks([y_of[r] for r in rows], [labels[r] for r in rows], fontsize=8.5)
    gx.set_ylim(-0.6, n_rows - 0.4)
    gx.set_xlim(0, end * k)
    gx.set_xlabel(f"time within the step ({unit})")
    gx.grid(axis="x", alpha=0.3)
    handles = [Patch(color=c, label=p) for p, c in PHASE_COLORS.items()]
    if chains:
        handles.append(Patch(color=RECOMPUTE_COLOR, label=f"recompute ({fmt_seconds(result.recompute_s)})"))
    handles.append(Patch(color=STALL_COLOR, label="stall (waiting for tensors)"))
    if host_row:
        handles.append(Patch(color=HOST_COLOR, label="optimizer update on the host"))
    handles += [Patch(color=KIND_COLORS[kd], label=KIND_LABELS[kd]) for kd in KIND_COLORS if kd in kinds_drawn]
    handles.append(Line2D([], [], marker="v", color="#222222", linestyle="none", label=f"{hardware.device} peak"))
    gx.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    fig.subplots_adjust(left=0.105, right=0.78, top=0.94, bottom=0.08)
    return fig


def comparison_figure(hardware: Any, results: Sequence[Any], *, measured: dict[str, Any] | None = None):
    """Every policy side by side: the step's time split into compute alone, compute
    overlapped with transfers and stalls; and the bytes each link moved.

    Args:
        hardware: the machine (tier colours, links).
        results: one :class:`~tierflow.simulate.result.SimResult` per policy.
        measured: per policy name, a :class:`~tierflow.report.measured.Measured`; its
            step time is marked on that policy's bar.

    Returns:
        A :class:`matplotlib.figure.Figure`.

    Raises:
        ValueError: ``results`` is empty.

    Example:
        >>> from tierflow import load_hardware
        >>> from tierflow.policies import make_plan
        >>> from tierflow.simulate import simulate
        >>> from tierflow.synthetic import gpt_trace
        >>> hw = load_hardware("rtx4090-24g")
        >>> tr = gpt_trace(hw, layers=2, d_model=256, batch=2, seq=128)
        >>> fig = comparison_figure(hw, [simulate(tr, hw, make_plan(p, tr, hw)) for p in ("ideal", "lru")])
        >>> len(fig.axes)
        2
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if not results:
        raise ValueError("no results to compare")
    measured = measured or {}
    colors = tier_colors(hardware)
    links = shown_links(hardware, results)
    n = len(results)
    # fixed margins in inches: title above, tick labels, axis label and legend below
    top_in, bottom_in = 0.4, 1.3
    height = top_in + bottom_in + 0.5 + 0.5 * n
    below = -0.62 / (height - top_in - bottom_in)  # legend offset, in axes heights
    fig = Figure(figsize=(WIDTH_IN, height), dpi=DPI)
    ax, lx = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.6, 1.0], "wspace": 0.35})
    finite = [r.time_s for r in results if math.isfinite(r.time_s)]
    finite += [m.time_s for m in measured.values()]
    longest = max(finite) if finite else 1.0
    unit, k = time_scale(longest)
    ys = np.arange(n)[::-1]
    for y, r in zip(ys, results):
        b = breakdown(r)
        if b is None:
            ax.text(0, y, f"  cannot run: {(r.error or '')[:70]}", va="center", fontsize=8, color=STALL_COLOR)
            continue
        left = 0.0
        for value, color in ((b.alone_s, PHASE_COLORS["backward"]), (b.overlapped_s, OVERLAP_COLOR),
                             (b.stall_s, STALL_COLOR)):
            ax.barh(y, value * k, left=left * k, color=color, height=0.6)
            left += value
        note = f" {r.ratio:.2f} of ideal" + ("" if r.fits else f", does not fit in {fmt_bytes(hardware.device_capacity)}")
        m = measured.get(r.policy)
        if m is not None:
            ax.plot([m.time_s * k], [y], marker="D", color=MEASURED_COLOR, linestyle="none", markersize=6)
            note = f"  {note}" if m.time_s >= left else note
            left = max(left, m.time_s)
        ax.text(left * k, y, note, va="center", fontsize=8.5, color="#222222" if r.fits else STALL_COLOR)
    ideal = next((r.ideal_s for r in results if math.isfinite(r.ideal_s)), None)
    if ideal is not None:
        ax.axvline(ideal * k, color="#222222", linestyle="--", linewidth=1)
    ax.set_yticks(ys, [r.policy for r in results])
    ax.set_xlim(0, longest * k * 1.25)
    ax.set_xlabel(f"step time ({unit})")
    ax.set_title("where the step's time goes", loc="left", fontsize=10.5)
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=PHASE_COLORS["backward"], label="compute, no transfer in flight"),
               Patch(color=OVERLAP_COLOR, label="compute overlapped with transfers"),
               Patch(color=STALL_COLOR, label="stall (waiting for tensors)")]
    if measured:
        from matplotlib.lines import Line2D

        handles.append(Line2D([], [], marker="D", color=MEASURED_COLOR, linestyle="none", label="measured step"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, below),
              ncol=2, fontsize=8, frameon=False)

    # traffic per link: the off-device tier's colour; hatched when leaving the device
    h = 0.8 / max(1, len(links))
    link_objs = {link.name: link for link in hardware.links}
    for j, name in enumerate(links):
        link = link_objs[name]
        other = link.dst if link.src == hardware.device else link.src
        off = link.src == hardware.device
        gb = [r.traffic_bytes.get(name, 0) / 1e9 for r in results]
        lx.barh(ys + 0.4 - (j + 0.5) * h, gb, height=h * 0.9, color=colors.get(other, "#888888"),
                hatch="///" if off else None, edgecolor="white", linewidth=0, label=name)
    lx.set_yticks(ys, [r.policy for r in results])
    lx.set_xlabel("bytes moved per step (GB)")
    lx.set_title("traffic per link", loc="left", fontsize=10.5)
    lx.grid(axis="x", alpha=0.3)
    if links:
        lx.legend(loc="upper center", bbox_to_anchor=(0.5, below), ncol=2, fontsize=8,
                  frameon=False)
    else:
        lx.text(0.5, 0.5, "nothing moved", transform=lx.transAxes, ha="center", va="center", color="#666666")
    fig.subplots_adjust(left=0.08, right=0.97, top=1 - top_in / height, bottom=bottom_in / height)
    return fig


def render(fig: Any, fmt: str = "svg") -> bytes:
    """The figure as SVG or PNG bytes (deterministic: no date stamp, fixed SVG ids).

    Raises:
        ValueError: an unknown format.

    Example:
        >>> from matplotlib.figure import Figure
        >>> render(Figure(figsize=(1, 1)), "png")[:4]
        b'\\x89PNG'
    """
    import matplotlib

    if fmt not in ("svg", "png"):
        raise ValueError(f"unknown figure format {fmt!r} (svg or png)")
    buf = io.BytesIO()
    meta = {"Date": None} if fmt == "svg" else {"Software": None}
    with matplotlib.rc_context({"svg.hashsalt": "tierflow", "svg.fonttype": "path"}):
        fig.savefig(buf, format=fmt, dpi=DPI, metadata=meta)
    return buf.getvalue()
