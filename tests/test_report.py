"""The report: downsampling, the time breakdown, the verdict, the figures, the HTML page
and the ``tierflow report`` command."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import numpy as np
import pytest

from tierflow import load_hardware
from tierflow.cli import main
from tierflow.policies import make_plan
from tierflow.report import Measured, breakdown, build_report, verdict
from tierflow.report.downsample import (
    busy_time,
    downsample_steps,
    merge_intervals,
    minmax_indices,
    overlap_time,
    step_values,
)
from tierflow.simulate import simulate
from tierflow.simulate.result import SimResult
from tierflow.synthetic import gpt_trace
from tierflow.units import fmt_bytes

GIB = 2**30


@pytest.fixture(scope="module")
def setup():
    hw = load_hardware("rtx4090-24g")
    trace = gpt_trace(hw, layers=4, d_model=1024, batch=8, seq=512)
    results = [simulate(trace, hw, make_plan(p, trace, hw, budget="55%")) for p in ("ideal", "lru", "deepum")]
    return trace, hw, results


# -- downsampling ------------------------------------------------------------------------


def test_minmax_keeps_every_bucket_extreme():
    rng = np.random.default_rng(0)
    t = np.sort(rng.uniform(0, 10, 200_000))
    y = rng.normal(size=t.size).cumsum()
    y[rng.integers(0, t.size, 30)] += rng.choice([-500, 500], 30)  # isolated spikes
    buckets = 500
    idx = minmax_indices(t, y, buckets)
    assert len(idx) <= 4 * buckets and np.all(np.diff(idx) > 0)
    assert y[idx].max() == y.max() and y[idx].min() == y.min()
    # in every bucket the kept points reach the bucket's own extremes
    b = np.minimum((t / (10 / buckets)).astype(int), buckets - 1)
    for k in rng.integers(0, buckets, 40):
        inside, kept = b == k, b[idx] == k
        assert y[idx][kept].max() == y[inside].max() and y[idx][kept].min() == y[inside].min()


def test_minmax_short_series_untouched_and_errors():
    assert minmax_indices(np.arange(10.0), np.arange(10.0), 5).tolist() == list(range(10))
    with pytest.raises(ValueError):
        minmax_indices(np.arange(3.0), np.arange(4.0), 5)
    with pytest.raises(ValueError):
        minmax_indices(np.arange(3.0), np.arange(3.0), 0)


def test_downsample_steps_keeps_stacked_peak_and_exact_values():
    rng = np.random.default_rng(1)
    ta = np.sort(rng.uniform(0, 1, 50_000))
    tb = np.sort(rng.uniform(0, 1, 30_000))
    a = rng.integers(0, 100, ta.size).astype(float)
    bb = rng.integers(0, 100, tb.size).astype(float)
    grid, (va, vb) = downsample_steps([(ta, a), (tb, bb)], 300, 0.0, 1.0)
    assert len(grid) <= 4 * 300 * 2 + 1
    # values on the kept grid are the true step values there
    assert np.array_equal(va, step_values(ta, a, grid)) and np.array_equal(vb, step_values(tb, bb, grid))
    full = np.unique(np.r_[0.0, ta, tb])
    total = step_values(ta, a, full) + step_values(tb, bb, full)
    assert (va + vb).max() == total.max()
    assert va.max() == a.max()


def test_merge_intervals_matches_a_brute_force_union():
    rng = np.random.default_rng(2)
    s = rng.uniform(0, 100, 400)
    e = s + rng.exponential(0.3, 400)
    ms, me = merge_intervals(s, e)
    assert np.all(ms[1:] > me[:-1])  # disjoint and sorted
    x = np.linspace(0, 101, 200_001)
    cover = np.zeros(x.size, bool)
    for a, b in zip(s, e):
        cover |= (x >= a) & (x <= b)
    mcover = np.zeros(x.size, bool)
    for a, b in zip(ms, me):
        mcover |= (x >= a) & (x <= b)
    assert np.array_equal(cover, mcover)
    assert busy_time(s, e, 0, 101) == pytest.approx(float(np.sum(me - ms)))


def test_merge_intervals_widens_and_joins():
    s, e = merge_intervals(np.array([0.0, 10.0, 10.6]), np.array([0.01, 10.2, 11.0]), min_width=1.0)
    assert s == pytest.approx([-0.495, 9.6]) and e == pytest.approx([0.505, 11.3])
    s, e = merge_intervals(np.array([0.0, 2.5]), np.array([2.0, 3.0]), min_gap=1.0)
    assert s.tolist() == [0.0] and e.tolist() == [3.0]


def test_overlap_time_against_brute_force():
    rng = np.random.default_rng(3)
    a = (rng.uniform(0, 10, 30), None)
    a = (a[0], a[0] + rng.uniform(0, 1, 30))
    b = (rng.uniform(0, 10, 50), None)
    b = (b[0], b[0] + rng.uniform(0, 0.5, 50))
    x = np.linspace(0, 12, 1_200_001)
    dx = x[1] - x[0]

    def cov(iv):
        c = np.zeros(x.size, bool)
        for lo, hi in zip(*iv):
            c |= (x >= lo) & (x < hi)
        return c

    assert overlap_time(a, b) == pytest.approx(float(np.sum(cov(a) & cov(b))) * dx, abs=1e-4)


# -- the breakdown and the verdict -------------------------------------------------------


def test_breakdown_adds_up(setup):
    trace, _, results = setup
    for r in results:
        b = breakdown(r)
        assert b.compute_s + b.stall_s == pytest.approx(r.time_s)
        assert b.alone_s + b.overlapped_s == pytest.approx(trace.ideal_s)
        assert 0 <= b.overlapped_s <= min(b.compute_s, b.transfer_busy_s) + 1e-12
        assert b.stalled_ops == int(np.count_nonzero(r.op_stall_s > 0))
        for busy in b.link_busy_s.values():
            assert 0 < busy <= b.transfer_busy_s + 1e-12
    ideal, lru = results[0], results[1]
    assert breakdown(ideal).transfer_busy_s == 0 and breakdown(lru).transfer_busy_s > 0
    failed = SimResult("x", "t", "h", math.inf, 1.0, math.inf, {}, {}, False, 1.0, error="too big")
    assert breakdown(failed) is None


def test_verdict_ranks_and_names_failures(setup):
    trace, hw, results = setup
    failed = SimResult("vdnn", trace.name, hw.name, math.inf, trace.ideal_s, math.inf, {}, {}, False,
                       float(hw.device_capacity), error="op 3 needs more than the budget")
    head, details = verdict(trace, hw, [*results, failed])
    best = max(results[1:], key=lambda r: r.ratio)
    other = min(results[1:], key=lambda r: r.ratio)
    assert head.startswith(f"Fits at {fmt_bytes(results[1].budget_bytes)} with {best.policy}, "
                           f"predicted {best.ratio:.2f} of ideal")
    assert f"also fits with {other.policy} ({other.ratio:.2f})" in head
    assert head.endswith("does not fit with vdnn.")
    assert any(d.startswith("vdnn does not fit: op 3 needs") for d in details)
    assert any(d.startswith("Unconstrained, one step of") for d in details)


def test_verdict_when_nothing_fits(setup):
    trace, hw, _ = setup
    failed = SimResult("lru", trace.name, hw.name, math.inf, trace.ideal_s, math.inf, {}, {}, False, 1.0,
                       error="no")
    head, _ = verdict(trace, hw, [failed])
    assert head == "Does not fit in 24.00 GiB with any policy tried."


def test_verdict_measured_against_predicted(setup):
    trace, hw, results = setup
    lru = results[1]
    _, details = verdict(trace, hw, results, {"lru": Measured(time_s=lru.time_s * 1.1)})
    assert "lru measured" in " ".join(details) and "(+10.0%)" in " ".join(details)


# -- figures -----------------------------------------------------------------------------


def _fill_colors_and_top(ax):
    from matplotlib.collections import PolyCollection

    out = []
    for c in ax.collections:
        if isinstance(c, PolyCollection) and c.get_paths():
            verts = np.concatenate([p.vertices for p in c.get_paths()])
            out.append((tuple(np.round(c.get_facecolor()[0][:3], 3)), float(verts[:, 1].max()), len(verts)))
    return out


def test_timeline_downsamples_a_huge_curve_without_losing_its_peak(setup):
    from matplotlib.colors import to_rgb

    from tierflow.report.figures import tier_colors, timeline_figure

    trace, hw, results = setup
    lru = results[1]
    rng = np.random.default_rng(4)
    n = 400_000
    t = np.sort(rng.uniform(0, lru.time_s, n))
    gpu = rng.uniform(1, 10, n) * GIB
    gpu[123_457] = 23.5 * GIB  # one narrow peak
    host = rng.uniform(0, 3, n) * GIB
    big = SimResult(**{**lru.__dict__, "memory": {"gpu": (t, gpu), "host": (t, host)}})
    fig = timeline_figure(trace, hw, big, buckets=800)
    fills = _fill_colors_and_top(fig.axes[0])
    colors = tier_colors(hw)
    gpu_fill = next(f for f in fills if f[0] == tuple(np.round(to_rgb(colors["gpu"]), 3)))
    host_fill = next(f for f in fills if f[0] == tuple(np.round(to_rgb(colors["host"]), 3)))
    assert gpu_fill[1] == pytest.approx(23.5)  # the spike survives
    assert gpu_fill[2] < 40_000  # and the polygon is thinned (4 points per bucket per level)
    stacked = (gpu + host) / GIB
    assert host_fill[1] == pytest.approx(stacked.max())


def test_tier_colours_are_the_same_in_every_figure(setup):
    from matplotlib.colors import to_rgb

    from tierflow.report.figures import comparison_figure, tier_colors, timeline_figure

    trace, hw, results = setup
    colors = tier_colors(hw)
    assert len(set(colors.values())) == len(colors)
    want = {tuple(np.round(to_rgb(colors[n]), 3)) for n in ("gpu", "host")}
    for r in results[1:]:
        got = {f[0] for f in _fill_colors_and_top(timeline_figure(trace, hw, r).axes[0])}
        assert want <= got
    # traffic bars take the off-device tier's colour
    lx = comparison_figure(hw, results).axes[1]
    bar_colors = {tuple(np.round(p.get_facecolor()[:3], 3)) for p in lx.patches}
    assert tuple(np.round(to_rgb(colors["host"]), 3)) in bar_colors


def test_timeline_axes_are_labelled_with_units(setup):
    from tierflow.report.figures import timeline_figure

    trace, hw, results = setup
    fig = timeline_figure(trace, hw, results[2])
    mem, gantt = fig.axes
    assert mem.get_ylabel() == "bytes held (GiB)"
    assert re.fullmatch(r"time within the step \((ms|s)\)", gantt.get_xlabel())
    labels = [t.get_text() for t in gantt.get_yticklabels()]
    assert labels[0].startswith("compute") and labels[1].startswith("stalls")
    assert any(lbl.startswith("host->gpu") for lbl in labels)
    assert mem.get_legend() is not None and gantt.get_legend() is not None


def test_timeline_refuses_a_plan_that_did_not_run(setup):
    from tierflow.report.figures import timeline_figure

    trace, hw, _ = setup
    failed = SimResult("lru", "t", "h", math.inf, 1.0, math.inf, {}, {}, False, 1.0, error="no room")
    with pytest.raises(ValueError, match="no room"):
        timeline_figure(trace, hw, failed)


# -- the page ----------------------------------------------------------------------------


def test_page_is_self_contained_and_complete(setup):
    trace, hw, results = setup
    failed = SimResult("vdnn", trace.name, hw.name, math.inf, trace.ideal_s, math.inf, {}, {}, False,
                       1.0, error="op 7 <too> big")
    page = build_report(trace, hw, [*results, failed], fmt="png")
    assert page.startswith("<!DOCTYPE html>")
    # nothing fetched: every src is a data URI, no stylesheet or script links
    assert all(s.startswith("data:") for s in re.findall(r'\bsrc="([^"]*)"', page))
    assert not re.search(r"<link\b|@import|url\(\s*['\"]?http", page)
    figs = re.findall(r'data-figure="([^"]+)"', page)
    assert figs == ["comparison", "timeline-ideal", "timeline-lru", "timeline-deepum"]
    assert page.count('<section class="policy"') == 4
    assert "The plan could not run: op 7 &lt;too&gt; big" in page  # escaped
    head, _ = verdict(trace, hw, [*results, failed])
    assert head.replace("(", "(") in page.replace("&#x27;", "'")
    assert hw.name in page and "pcie" in page.lower()
    assert "measured" not in page


def test_page_with_measured_series(setup):
    trace, hw, results = setup
    lru = results[1]
    t, b = lru.memory["gpu"]
    m = Measured(time_s=lru.time_s * 0.95, memory={"gpu": (t, b * 0.9)}, peak_bytes={"gpu": int(b.max() * 0.9)},
                 source="A100 run")
    page = build_report(trace, hw, results, measured={"lru": m}, fmt="png")
    assert "<th>measured step</th>" in page and "<th>measured / predicted</th>" in page
    assert "0.950" in page and "A100 run step" in page and "lru measured" in page


def test_report_cli_writes_html_and_pngs(tmp_path, capsys):
    from matplotlib.image import imread

    from helpers import chain_trace

    trace_file = str(chain_trace().save(tmp_path / "chain.json.gz"))
    out = tmp_path / "r.html"
    rc = main(["report", trace_file, "--hardware", "g10-a100", "--policies", "ideal,lru",
               "--budget", "200MB", "-o", str(out), "--png", str(tmp_path / "png"), "--embed", "png"])
    assert rc == 0
    text = capsys.readouterr().out
    assert f"wrote {out}" in text and "Fits at" in text
    page = out.read_text()
    assert 'data-figure="timeline-lru"' in page and "chain on g10-a100" in page
    assert page.count('src="data:image/png;base64,') == 3 and "image/svg" not in page
    pngs = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert pngs == ["comparison.png", "timeline-ideal.png", "timeline-lru.png"]
    img = imread(tmp_path / "png" / "timeline-lru.png")
    assert img.shape[1] > 1000 and img[..., :3].std() > 0.05


def test_report_cli_unknown_policy(tmp_path, capsys):
    from helpers import chain_trace

    trace_file = str(chain_trace().save(tmp_path / "chain.json.gz"))
    assert main(["report", trace_file, "--policies", "lru,magic", "-o", str(tmp_path / "r.html")]) == 2
    assert "unknown policy 'magic'" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()


def test_import_stays_light():
    code = ("import sys, tierflow, tierflow.report, tierflow.report.cli; "
            "print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_small_budget_scales_to_the_data_and_measured_is_drawn(setup):
    from tierflow.report.figures import timeline_figure

    trace, hw, results = setup
    lru = results[1]
    t, b = lru.memory["gpu"]
    m = Measured(time_s=lru.time_s, memory={"gpu": (t, b * 0.9)}, source="A100 run")
    mem = timeline_figure(trace, hw, lru, measured=m).axes[0]
    texts = [x.get_text() for x in mem.get_legend().get_texts()]
    # the 24 GiB device would squash a ~1 GiB budget: capacity goes to the legend only
    assert mem.get_ylim()[1] < 0.2 * hw.device_capacity / GIB
    assert any("capacity" in x and "off the scale" in x for x in texts)
    assert any(x.startswith("budget ") for x in texts) and "A100 run gpu" in texts
    line = next(ln for ln in mem.get_lines() if ln.get_label() == "A100 run gpu")
    assert max(line.get_ydata()) == pytest.approx(b.max() * 0.9 / GIB)
    # at the full device the capacity line is drawn
    full = simulate(trace, hw, make_plan("lru", trace, hw))
    texts = [x.get_text() for x in timeline_figure(trace, hw, full).axes[0].get_legend().get_texts()]
    assert "gpu capacity 24.00 GiB" in texts
