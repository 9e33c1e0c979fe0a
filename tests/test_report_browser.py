"""The HTML report in a real browser: headless Chromium loads it with no console errors,
every embedded figure decodes, the policy tabs switch, and the page is not blank.

Chromium comes from Debian's ``chromium`` package; when it is not on PATH the fixture
installs it (root and apt-get needed) and otherwise skips, saying why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tierflow import load_hardware
from tierflow.policies import make_plan
from tierflow.report import build_report
from tierflow.simulate import simulate
from tierflow.synthetic import gpt_trace

# Put first in <head>: records errors (uncaught, failed loads, console.error) and, once the
# page has loaded, which images decoded and what each tab shows, into <pre id="tf-test">.
SENTINEL = """<script>
(function(){
  var errs = [];
  window.addEventListener('error', function(e){
    errs.push('error: ' + (e.message || ((e.target && e.target.tagName) + ' failed to load')));
  }, true);
  window.addEventListener('unhandledrejection', function(e){ errs.push('rejection: ' + e.reason); });
  var ce = console.error;
  console.error = function(){ errs.push('console.error: ' + [].join.call(arguments, ' ')); ce.apply(console, arguments); };
  window.addEventListener('load', function(){
    var imgs = [].slice.call(document.images);
    var tabs = {};
    [].forEach.call(document.querySelectorAll('.tabs button'), function(b){
      b.click();
      tabs[b.dataset.policy] = [].filter.call(document.querySelectorAll('section.policy'),
        function(s){ return s.offsetHeight > 0; }).map(function(s){ return s.dataset.policy; });
    });
    var first = document.querySelector('.tabs button'); if (first) first.click();
    var out = {errors: errs, images: imgs.length,
               decoded: imgs.filter(function(i){ return i.complete && i.naturalWidth > 0; }).length,
               tabs: tabs};
    var pre = document.createElement('pre'); pre.id = 'tf-test'; pre.textContent = JSON.stringify(out);
    document.body.appendChild(pre);
  });
})();
</script>"""

FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-extensions", "--hide-scrollbars", "--enable-logging=stderr", "--v=0",
]


def _find() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="session")
def chromium() -> str:
    path = _find()
    if path:
        return path
    if shutil.which("apt-get") is None:
        pytest.skip("chromium is not installed and there is no apt-get to install it")
    if os.geteuid() != 0:
        pytest.skip("chromium is not installed and installing it needs root (apt-get install chromium)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]
    try:
        if subprocess.run(cmd, env=env, capture_output=True, timeout=900).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=300, check=True)
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                pytest.skip(f"apt-get install chromium failed: {done.stderr.strip()[-300:]}")
    except (subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"could not install chromium: {e}")
    path = _find()
    if not path:
        pytest.skip("apt-get installed chromium but it is not on PATH")
    return path


def _run(chromium: str, page: Path, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [chromium, *FLAGS, f"--user-data-dir={tmp / 'profile'}", *extra, page.as_uri()]
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)


def _load(chromium: str, html: str, tmp: Path) -> tuple[dict, list[str]]:
    """Load the page with the sentinel; returns its findings and the console lines
    Chromium logged that report uncaught errors."""
    page = tmp / "page.html"
    page.write_text(html.replace('<meta charset="utf-8">', '<meta charset="utf-8">' + SENTINEL, 1),
                    encoding="utf-8")
    done = _run(chromium, page, tmp, "--virtual-time-budget=10000", "--dump-dom")
    m = re.search(r'<pre id="tf-test">(.*?)</pre>', done.stdout, re.S)
    assert m, f"the page did not finish loading (rc {done.returncode}): {done.stderr[-800:]}"
    found = json.loads(m.group(1).replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">")
                       .replace("&amp;", "&"))
    console = [ln for ln in done.stderr.splitlines() if "CONSOLE" in ln and "Uncaught" in ln]
    return found, console


@pytest.fixture(scope="module")
def report_html() -> str:
    hw = load_hardware("rtx4090-24g")
    trace = gpt_trace(hw, layers=4, d_model=1024, batch=8, seq=512)
    results = [simulate(trace, hw, make_plan(p, trace, hw, budget="70%")) for p in ("ideal", "lru", "deepum")]
    assert any(r.transfers for r in results)  # the figures have transfers to draw
    return build_report(trace, hw, results)


def test_report_loads_without_errors_and_figures_decode(chromium, report_html, tmp_path):
    found, console = _load(chromium, report_html, tmp_path)
    assert found["errors"] == [] and console == []
    assert found["images"] == 4 and found["decoded"] == 4  # comparison + one timeline per policy
    # each tab shows its own policy's section and only that one
    assert found["tabs"] == {p: [p] for p in ("ideal", "lru", "deepum")}


def test_report_screenshot_is_not_blank(chromium, report_html, tmp_path):
    from matplotlib.image import imread

    page = tmp_path / "page.html"
    page.write_text(report_html, encoding="utf-8")
    shot = tmp_path / "shot.png"
    done = _run(chromium, page, tmp_path, "--window-size=1400,1800", "--virtual-time-budget=10000",
                f"--screenshot={shot}")
    assert shot.exists(), f"no screenshot (rc {done.returncode}): {done.stderr[-800:]}"
    img = imread(shot)[..., :3]
    assert img.shape[:2] == (1800, 1400)
    assert img.std() > 0.1  # not a blank page
    # the figures drew: many saturated pixels (text and tables are grey or black)
    saturation = img.max(axis=2) - img.min(axis=2)
    assert np.count_nonzero(saturation > 0.25) > 20_000


def test_harness_catches_script_errors(chromium, tmp_path):
    """The check above can fail: a page with a broken script is reported."""
    broken = ('<!DOCTYPE html><html><head><meta charset="utf-8"></head><body>'
              '<script>console.error("bad thing"); notAFunction();</script>'
              '<img src="data:image/png;base64,AAAA"></body></html>')
    found, _ = _load(chromium, broken, tmp_path)
    assert any("bad thing" in e for e in found["errors"])
    assert any("notAFunction" in e for e in found["errors"])
    assert found["images"] == 1 and found["decoded"] == 0
