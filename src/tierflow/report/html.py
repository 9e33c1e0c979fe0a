"""One self-contained HTML page per report: figures embedded as data URIs (SVG by
default), a few lines of inline CSS and JS (tabs per policy), nothing fetched from the
network. Without JavaScript every policy's section is simply shown one after another.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..units import fmt_bandwidth, fmt_bytes, fmt_seconds
from .analysis import breakdown
from .verdict import verdict

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:1400px;
padding:1.2rem 2rem;color:#1d1d1f;background:#fff;line-height:1.4}
h1{font-size:1.5rem;margin:.2rem 0 .6rem}h2{font-size:1.15rem;margin:1.6rem 0 .5rem;border-bottom:1px solid #ddd}
.verdict{background:#f3f7fb;border-left:4px solid #4C72B0;padding:.6rem 1rem;margin:.6rem 0}
.verdict .head{font-size:1.1rem;font-weight:600}.verdict ul{margin:.4rem 0 0;padding-left:1.2rem}
table{border-collapse:collapse;font-size:.86rem;margin:.4rem 0}
.scroll{overflow-x:auto;max-width:100%}
th,td{border-bottom:1px solid #e3e3e3;padding:.25rem .5rem;text-align:right;white-space:nowrap}
th{white-space:normal;vertical-align:bottom}
th:first-child,td:first-child{text-align:left}th{background:#fafafa}
.no{color:#c1121f;font-weight:600}.yes{color:#2b8a3e;font-weight:600}
figure{margin:.4rem 0}figure img{width:100%;height:auto;display:block}
figcaption{font-size:.85rem;color:#555}
.tabs{display:flex;gap:.3rem;flex-wrap:wrap;margin:.4rem 0}
.tabs button{border:1px solid #ccc;background:#f6f6f6;padding:.3rem .9rem;border-radius:4px;cursor:pointer;font:inherit}
.tabs button.active{background:#4C72B0;color:#fff;border-color:#4C72B0}
.js .policy{display:none}.js .policy.active{display:block}
.muted{color:#666;font-size:.85rem}.err{color:#c1121f}
"""

_JS = """
document.documentElement.classList.add('js');
function tfShow(name){
  document.querySelectorAll('.policy').forEach(function(s){s.classList.toggle('active', s.dataset.policy===name);});
  document.querySelectorAll('.tabs button').forEach(function(b){b.classList.toggle('active', b.dataset.policy===name);});
}
document.addEventListener('DOMContentLoaded', function(){
  var buttons = document.querySelectorAll('.tabs button');
  buttons.forEach(function(b){b.addEventListener('click', function(){tfShow(b.dataset.policy);});});
  if (buttons.length) tfShow(buttons[0].dataset.policy);
});
"""


def build_figures(trace: Any, hardware: Any, results: Sequence[Any],
                  measured: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report's figures: ``"comparison"`` and ``"timeline-POLICY"`` per policy that ran.

    Every timeline stacks the same tiers and shows the same link rows, so they line up.

    Args:
        trace, hardware, results, measured: as for :func:`build_report`.

    Returns:
        Figure name -> :class:`matplotlib.figure.Figure`, in display order.

    Raises:
        ValueError: ``results`` is empty.

    Example:
        >>> from tierflow import load_hardware
        >>> from tierflow.policies import make_plan
        >>> from tierflow.simulate import simulate
        >>> from tierflow.synthetic import gpt_trace
        >>> hw = load_hardware("rtx4090-24g")
        >>> tr = gpt_trace(hw, layers=2, d_model=256, batch=2, seq=128)
        >>> sorted(build_figures(tr, hw, [simulate(tr, hw, make_plan("lru", tr, hw))]))
        ['comparison', 'timeline-lru']
    """
    from .figures import comparison_figure, shown_links, shown_tiers, timeline_figure

    if not results:
        raise ValueError("no results to report")
    measured = measured or {}
    tiers = shown_tiers(hardware, results)
    links = shown_links(hardware, results)
    figs = {"comparison": comparison_figure(hardware, results, measured=measured)}
    for r in results:
        if math.isfinite(r.time_s):
            figs[f"timeline-{r.policy}"] = timeline_figure(
                trace, hardware, r, tiers=tiers, links=links, measured=measured.get(r.policy)
            )
    return figs


def build_report(trace: Any, hardware: Any, results: Sequence[Any], *,
                 measured: dict[str, Any] | None = None, title: str | None = None,
                 command: str | None = None, figures: dict[str, Any] | None = None,
                 fmt: str = "svg") -> str:
    """The report as one HTML document (a string), needing nothing from the network.

    Args:
        trace: the trace simulated.
        hardware: the machine it was simulated on.
        results: one :class:`~tierflow.simulate.result.SimResult` per policy, in the
            order to show them.
        measured: per policy name, a :class:`~tierflow.report.measured.Measured` from a
            real run; adds measured columns, markers and sentences (optional).
        title: the page title (default: "TRACE on HARDWARE").
        command: the command line that made it, shown in the footer.
        figures: figures already built by :func:`build_figures` (built here if not).
        fmt: how figures are embedded: ``"svg"`` (sharp, larger) or ``"png"``.

    Returns:
        The HTML text.

    Raises:
        ValueError: ``results`` is empty or ``fmt`` is unknown.

    Example:
        >>> from tierflow import load_hardware
        >>> from tierflow.policies import make_plan
        >>> from tierflow.simulate import simulate
        >>> from tierflow.synthetic import gpt_trace
        >>> hw = load_hardware("rtx4090-24g")
        >>> tr = gpt_trace(hw, layers=2, d_model=256, batch=2, seq=128)
        >>> page = build_report(tr, hw, [simulate(tr, hw, make_plan("lru", tr, hw))])
        >>> page.startswith("<!DOCTYPE html>") and "http" not in page.split("<body>")[0]
        True
    """
    from .figures import render

    if not results:
        raise ValueError("no results to report")
    if fmt not in ("svg", "png"):
        raise ValueError(f"unknown figure format {fmt!r} (svg or png)")
    measured = measured or {}
    figs = figures if figures is not None else build_figures(trace, hardware, results, measured)
    mime = "image/svg+xml" if fmt == "svg" else "image/png"

    def img(name: str, alt: str) -> str:
        data = base64.b64encode(render(figs[name], fmt)).decode("ascii")
        return f'<img src="data:{mime};base64,{data}" alt="{_e(alt)}" data-figure="{_e(name)}">'

    title = title or f"{trace.name} on {hardware.name}"
    head, details = verdict(trace, hardware, results, measured)
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>tierflow report: {_e(title)}</title>",
        f"<style>{_CSS}</style>",
        f"<script>{_JS}</script>",
        "</head><body>",
        f"<h1>tierflow report: {_e(title)}</h1>",
        f'<p class="muted">{_e(_trace_line(trace))}</p>',
        '<div class="verdict" id="verdict">',
        f'<div class="head">{_e(head)}</div><ul>',
        *(f"<li>{_e(d)}</li>" for d in details),
        "</ul></div>",
        "<h2>Comparison</h2>",
        _comparison_table(hardware, results, measured),
        "<figure>",
        img("comparison", "step time breakdown and traffic per link, per policy"),
        "<figcaption>Left: the step split into compute with no transfer in flight, compute "
        "overlapped with transfers (hidden) and stalls (the compute stream waiting for "
        "tensors); the dashed line is the ideal step. Right: bytes moved per step over "
        "each link (hatched: leaving the device).</figcaption></figure>",
        "<h2>Per policy</h2>",
        '<div class="tabs">',
        *(f'<button type="button" data-policy="{_e(r.policy)}">{_e(r.policy)}</button>' for r in results),
        "</div>",
    ]
    for r in results:
        out.append(f'<section class="policy" data-policy="{_e(r.policy)}" id="policy-{_e(r.policy)}">')
        out.append(f"<h3>{_e(r.policy)}</h3>")
        name = f"timeline-{r.policy}"
        if name in figs:
            out.append("<figure>")
            out.append(img(name, f"{r.policy}: memory per tier, compute with stalls, transfers per link"))
            out.append(
                "<figcaption>Top: bytes held per tier over the step, stacked (resident or reserved "
                "for a transfer in flight), with the device's capacity (dashed) and the plan's "
                "budget (dotted, when lower); the triangle marks the device's peak. Bottom: the "
                "compute stream by phase, its stalls in red, and every link's transfers by kind "
                "(bars narrower than a pixel are widened to one).</figcaption></figure>"
            )
            out.append(_policy_table(r, measured.get(r.policy)))
        else:
            out.append(f'<p class="err">The plan could not run: {_e(r.error or "unknown reason")}</p>')
        out.append("</section>")
    out += [
        "<h2>Hardware</h2>",
        _hardware_tables(hardware),
        f'<p class="muted">Generated by tierflow {_e(_version())}'
        + (f": <code>{_e(command)}</code>" if command else "") + ". Self-contained: no network needed.</p>",
        "</body></html>",
    ]
    return "\n".join(out) + "\n"


def write_report(path: str | Path, trace: Any, hardware: Any, results: Sequence[Any], *,
                 measured: dict[str, Any] | None = None, png_dir: str | Path | None = None,
                 command: str | None = None, fmt: str = "svg") -> list[Path]:
    """Write the HTML report, and the same figures as PNG files when ``png_dir`` is given.

    Args:
        path: the HTML file to write (its folder is created).
        trace, hardware, results, measured, command, fmt: as for :func:`build_report`.
        png_dir: a folder for ``comparison.png`` and ``timeline-POLICY.png``.

    Returns:
        The files written, the HTML first.

    Raises:
        ValueError: ``results`` is empty.
        OSError: a file cannot be written.

    Example:
        >>> import tempfile
        >>> from tierflow import load_hardware
        >>> from tierflow.policies import make_plan
        >>> from tierflow.simulate import simulate
        >>> from tierflow.synthetic import gpt_trace
        >>> hw = load_hardware("rtx4090-24g")
        >>> tr = gpt_trace(hw, layers=2, d_model=256, batch=2, seq=128)
        >>> d = tempfile.mkdtemp()
        >>> files = write_report(d + "/r.html", tr, hw, [simulate(tr, hw, make_plan("lru", tr, hw))], png_dir=d)
        >>> [f.name for f in files]
        ['r.html', 'comparison.png', 'timeline-lru.png']
    """
    figs = build_figures(trace, hardware, results, measured)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(build_report(trace, hardware, results, measured=measured, command=command, figures=figs,
                                fmt=fmt),
                    encoding="utf-8")
    written = [path]
    if png_dir is not None:
        written += write_pngs(png_dir, figs)
    return written


def write_pngs(folder: str | Path, figures: dict[str, Any]) -> list[Path]:
    """Write each figure as ``NAME.png`` in ``folder`` (created if missing).

    Args:
        folder: where to write.
        figures: name -> figure, from :func:`build_figures`.

    Returns:
        The PNG files written.

    Raises:
        OSError: the folder or a file cannot be written.

    Example:
        >>> import tempfile
        >>> from matplotlib.figure import Figure
        >>> [p.name for p in write_pngs(tempfile.mkdtemp(), {"blank": Figure(figsize=(1, 1))})]
        ['blank.png']
    """
    from .figures import render

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, fig in figures.items():
        p = folder / f"{_safe(name)}.png"
        p.write_bytes(render(fig, "png"))
        out.append(p)
    return out


# -- pieces ----------------------------------------------------------------------------------


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _version() -> str:
    from .. import __version__

    return __version__


def _trace_line(trace: Any) -> str:
    return (f"{trace.name}: {trace.n_ops} ops, {trace.n_tensors} tensors, ideal step "
            f"{fmt_seconds(trace.ideal_s)}, live tensors peak at {fmt_bytes(trace.peak_live_bytes)}.")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], caption: str | None = None) -> str:
    out = ['<div class="scroll"><table>']
    if caption:
        out.append(f'<caption class="muted" style="caption-side:bottom;text-align:left">{_e(caption)}</caption>')
    out.append("<tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr>")
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>")
    out.append("</table></div>")
    return "\n".join(out)


def _comparison_table(hardware: Any, results: Sequence[Any], measured: dict[str, Any]) -> str:
    from .figures import shown_links, shown_tiers

    links = shown_links(hardware, results)
    tiers = shown_tiers(hardware, results)
    header = ["policy", "step", "of ideal", "stall", "stalled ops", "hidden"]
    header += [f"{n} GB" for n in links] + [f"peak {n} GiB" for n in tiers] + ["faults", "fits"]
    if measured:
        header += ["measured step", "measured / predicted"]
    rows = []
    for r in results:
        b = breakdown(r)
        row = [_e(r.policy), _e(fmt_seconds(r.time_s)), f"{r.ratio:.3f}", _e(fmt_seconds(r.stall_s)),
               str(b.stalled_ops) if b else "-",
               f"{b.hidden_share:.0%}" if b and sum(r.traffic_bytes.values()) else "-"]
        row += [f"{r.traffic_bytes.get(n, 0) / 1e9:.1f}" for n in links]
        row += [f"{r.peak_bytes.get(n, 0) / 2**30:.2f}" for n in tiers]
        row.append(str(r.faults))
        row.append('<span class="yes">yes</span>' if r.fits else '<span class="no">no</span>')
        if measured:
            m = measured.get(r.policy)
            row.append(_e(fmt_seconds(m.time_s)) if m else "-")
            row.append(f"{m.time_s / r.time_s:.3f}" if m and math.isfinite(r.time_s) and r.time_s > 0 else "-")
        rows.append(row)
    return _table(header, rows, "hidden: share of transfer time overlapped with compute; "
                                "traffic in GB (10^9 bytes) per step; peaks in GiB.")


def _policy_table(r: Any, m: Any) -> str:
    b = breakdown(r)
    rows = [
        ["step", _e(fmt_seconds(r.time_s))],
        ["compute (ideal step)", _e(fmt_seconds(r.ideal_s))],
        ["compute overlapped with transfers", _e(fmt_seconds(b.overlapped_s)) if b else "-"],
        ["compute with no transfer in flight", _e(fmt_seconds(b.alone_s)) if b else "-"],
        ["stalls", _e(f"{fmt_seconds(r.stall_s)} over {b.stalled_ops if b else 0} ops")],
    ]
    if r.recompute_ops:
        rows.append(["recompute", _e(f"{fmt_seconds(r.recompute_s)} ({r.recompute_ops} ops re-run)")])
    if r.host_step_s:
        rows.append(["optimizer on the host", _e(
            f"{fmt_seconds(r.host_step_s)} of host compute; {fmt_seconds(r.host_op_s)} off the compute stream; "
            f"{fmt_bytes(r.host_step_bytes)} copied")])
    rows += [
        ["some transfer in flight", _e(fmt_seconds(b.transfer_busy_s)) if b else "-"],
    ]
    if b:
        rows += [[_e(f"{name} busy"), _e(f"{fmt_seconds(s)} ({s / b.step_s:.0%})")]
                 for name, s in b.link_busy_s.items()]
    rows += [
        ["on-demand faults", _e(f"{r.faults} ({fmt_bytes(r.fault_bytes)})")],
        ["planned moves skipped", str(r.skipped_moves)],
        ["device budget", _e(fmt_bytes(r.budget_bytes)) if math.isfinite(r.budget_bytes) else "unlimited"],
    ]
    if m is not None:
        rows.append([_e(f"{m.source} step"), _e(fmt_seconds(m.time_s))])
        rows += [[_e(f"{m.source} peak {t}"), _e(fmt_bytes(v))] for t, v in m.peak_bytes.items()]
        lv = getattr(m, "levers", {}) or {}
        if lv.get("recompute_ops"):
            rows.append([_e(f"{m.source} recompute"), _e(
                f"{fmt_seconds(lv.get('recompute_s', 0.0))} per step ({lv['recompute_ops']:g} ops re-run)")])
        if lv.get("host_steps"):
            rows.append([_e(f"{m.source} optimizer on the host"), _e(
                f"{fmt_seconds(lv.get('host_step_s', 0.0))} per step ({lv['host_steps']:g} parameters)")])
    return _table(["", ""], rows)


def _hardware_tables(hw: Any) -> str:
    tiers = [[_e(t.name), _e(t.kind), _e(fmt_bytes(t.capacity)),
              _e(fmt_bandwidth(t.read_bw)) if math.isfinite(t.read_bw) else "-",
              _e(fmt_bandwidth(t.write_bw)) if math.isfinite(t.write_bw) else "-",
              _e(fmt_seconds(t.latency_s)) if t.latency_s else "-"] for t in hw.tiers]
    links = [[_e(link.name), _e(f"{link.src} → {link.dst}"), _e(fmt_bandwidth(link.bandwidth)),
              _e(fmt_seconds(link.latency_s)) if link.latency_s else "-",
              _e(", ".join(f"{b} ({fmt_bandwidth(hw.buses[b])})" for b in link.buses) or "-")]
             for link in hw.links]
    c = hw.compute
    return "\n".join([
        f"<p><b>{_e(hw.name)}</b>: {_e(hw.description)}</p>",
        f'<p class="muted">compute device {_e(hw.device)}: {c.peak_flops_fp32 / 1e12:.1f} TFLOP/s fp32, '
        f"{c.peak_flops_bf16 / 1e12:.0f} TFLOP/s bf16, {c.mem_bandwidth / 1e9:.0f} GB/s memory; "
        f"on-demand fault latency {_e(fmt_seconds(hw.fault_latency_s))}.</p>",
        _table(["tier", "kind", "capacity", "read", "write", "latency"], tiers),
        _table(["link", "route", "bandwidth", "latency", "shares bus"], links),
    ])
