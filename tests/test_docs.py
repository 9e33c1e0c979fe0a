"""Every Python block and every ``tierflow`` command in README.md and docs/*.md runs.

Extraction: each fenced block whose info string is ``python`` is a Python block; in
every other fenced block, each line starting with ``tierflow `` (or ``$ tierflow ``),
with ``\\`` continuations joined and a trailing ``# comment`` dropped, is a command.
Output shown in a page is not in a fenced block (it is indented), so it is not run.

Running: one subprocess runs every page in document order, each page in its own empty
directory and its own namespace (a page is a tutorial: a later block may use what an
earlier block or command made). Commands run in-process through ``tierflow.cli.main``
(one torch import for all of them), Python blocks through ``exec``. Each must return
exit 0 and print no traceback.

Sizes: the substitutions in ``SMALLER`` (applied to commands and Python blocks, printed
in a failure) shrink models and search limits so the whole file stays well under a
minute; the pages show the sizes a user would run.

A block that cannot run here (torchrun, a multi-hour benchmark) is preceded in the
markdown by ``<!-- no-run: reason -->``; ``NO_RUN`` lists how many each page has, so none
is skipped silently. Commands on G10's workloads (``g10/CASE``) read the shared copy and
are skipped, by name, where it is absent; so are Python blocks that import transformers
where it is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import G10_DIR, REPO

PAGES = ["README.md"] + sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))

# (pattern, replacement): smaller models and shorter searches than the pages show.
SMALLER: list[tuple[str, str]] = [
    (r"\bgpt2-(medium|large)\b", "gpt-tiny"),
    (r"\bllama-7b\b", "llama-tiny"),
    (r"--seq (1024|2048)\b", "--seq 32"),
    (r"num_layers=24\b", "num_layers=2"),
    (r"--steps 20\b", "--steps 5"),
    (r"--time-limit (10|600)\b", "--time-limit 1"),
    (r"time_limit=10\b", "time_limit=1"),
    (r"--node-limit 1000000\b", "--node-limit 20000"),
    (r"episodes=8\b", "episodes=2"),
    (r"\bdemo --no-train\b", "demo --no-train --model gpt-tiny --policies ideal,deepum"),
]

# pages with blocks marked <!-- no-run: reason --> (and how many)
NO_RUN = {"docs/benchmarks.md": 1, "docs/distributed.md": 2}

NO_RUN_MARK = re.compile(r"<!--\s*no-run:\s*(\S.*?)\s*-->", re.S)
FENCE = re.compile(r"^```(\w*)\s*$")


def extract(text: str) -> tuple[list[dict], list[str]]:
    """The items of a page in order (``kind``: python or command, ``code``, ``line``), and
    the reasons of its no-run blocks."""
    lines = text.splitlines()
    items: list[dict] = []
    no_run: list[str] = []
    i = 0
    pending_no_run: str | None = None
    while i < len(lines):
        m_mark = NO_RUN_MARK.search(lines[i])
        if m_mark or lines[i].lstrip().startswith("<!-- no-run"):
            if not m_mark:  # a mark over several lines
                j = i
                while "-->" not in lines[j]:
                    j += 1
                m_mark = NO_RUN_MARK.search("\n".join(lines[i:j + 1]))
                i = j
            assert m_mark, f"line {i + 1}: a no-run mark needs a reason"
            pending_no_run = m_mark.group(1)
            i += 1
            continue
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].strip():
                pending_no_run = None  # the mark belongs to the block right after it
            i += 1
            continue
        lang, start = m.group(1), i + 1
        j = start
        while not lines[j].startswith("```"):
            j += 1
        body = lines[start:j]
        if pending_no_run is not None:
            no_run.append(pending_no_run)
        elif lang == "python":
            items.append({"kind": "python", "code": "\n".join(body), "line": start + 1})
        else:
            k = 0
            while k < len(body):
                first = k
                cmd = body[k]
                while cmd.rstrip().endswith("\\") and k + 1 < len(body):
                    k += 1
                    cmd = cmd.rstrip()[:-1].rstrip() + " " + body[k].strip()
                k += 1
                cmd = cmd.strip()
                if cmd.startswith("$ "):
                    cmd = cmd[2:]
                if cmd.startswith("tierflow "):
                    cmd = re.split(r"\s#\s", cmd)[0].strip()
                    items.append({"kind": "command", "code": cmd, "line": start + first + 1})
        pending_no_run = None
        i = j + 1
    return items, no_run


def smaller(code: str) -> str:
    for pattern, repl in SMALLER:
        code = re.sub(pattern, repl, code)
    return code


RUNNER = r'''
import contextlib, io, json, os, shlex, sys, time, traceback
os.environ.setdefault("COLUMNS", "120")
import torch
torch.set_num_threads(1)
from tierflow.cli import main

pages, out_path = json.load(open(sys.argv[1])), sys.argv[2]
results = {}
for page, (workdir, items) in pages.items():
    os.chdir(workdir)
    ns = {"__name__": "__docs__"}
    rows = []
    for it in items:
        buf = io.StringIO()
        ok, detail = True, ""
        t0 = time.perf_counter()
        code, target = it["code"], None
        if it["kind"] == "command" and " > " in code:  # a shell redirection of stdout
            code, target = (s.strip() for s in code.rsplit(" > ", 1))
        try:
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                if it["kind"] == "python":
                    exec(compile(it["code"], f"{page}:{it['line']}", "exec"), ns)
                else:
                    rc = main(shlex.split(code)[1:])
                    if rc != 0:
                        ok, detail = False, f"exit {rc}"
        except SystemExit as e:
            ok, detail = e.code in (0, None), f"exit {e.code}"
        except BaseException:
            ok, detail = False, traceback.format_exc()
        text = buf.getvalue()
        if target is not None:
            with open(target, "w") as f:
                f.write(text)
        if "Traceback" in text:
            ok = False
        rows.append({"ok": ok, "detail": detail, "output": text[-3000:], "seconds": time.perf_counter() - t0})
    results[page] = rows
json.dump(results, open(out_path, "w"))
'''


HAVE_TRANSFORMERS = all(importlib.util.find_spec(m) is not None for m in ("transformers", "accelerate"))

# pages whose commands start processes (two gloo ranks): tens of seconds on 2 cores
SLOW_PAGES = {"docs/distributed.md"}


def _run_pages(pages: list[str], base: Path) -> dict[str, tuple[list[dict], list[dict], list[dict]]]:
    """Run ``pages`` in one subprocess; returns {page: (items run, results, items skipped)}."""
    plan: dict[str, tuple[str, list[dict]]] = {}
    skipped: dict[str, list[dict]] = {}
    for page in pages:
        items, _ = extract((REPO / page).read_text(encoding="utf-8"))
        run, skipped[page] = [], []
        for it in items:
            code = smaller(it["code"])
            if re.search(r"(?<![\w/.-])g10/", code):
                if not G10_DIR.exists():
                    skipped[page].append({**it, "why": f"needs G10's workloads at {G10_DIR}"})
                    continue
                code = re.sub(r"(?<![\w/.-])g10/", f"{G10_DIR}/", code)
            if re.search(r"^\s*(from|import) transformers\b", code, re.M) and not HAVE_TRANSFORMERS:
                skipped[page].append({**it, "why": "needs transformers and accelerate (the test extra)"})
                continue
            run.append({**it, "code": code})
        workdir = base / page.replace("/", "_")
        workdir.mkdir()
        plan[page] = (str(workdir), run)
    spec, out = base / "pages.json", base / "results.json"
    spec.write_text(json.dumps(plan))
    env = {"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin", "HOME": str(base)}
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(spec), str(out)], cwd=base, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    return {page: (plan[page][1], results[page], skipped[page]) for page in pages}


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    return _run_pages([p for p in PAGES if p not in SLOW_PAGES], tmp_path_factory.mktemp("docs"))


@pytest.fixture(scope="module")
def ran_slow(tmp_path_factory):
    return _run_pages(sorted(SLOW_PAGES), tmp_path_factory.mktemp("docs-slow"))


def test_extraction_finds_blocks_commands_and_marks():
    text = "\n".join([
        "```python", "x = 1", "```", "", "```sh", "tierflow policies   # list them",
        "$ tierflow hardware list", "tierflow compare a.json \\", "    --budget 30%", "make demo", "```",
        "", "<!-- no-run: needs torchrun -->", "```sh", "tierflow train --nproc 2", "```",
        "", "    tierflow output lines are not run", "",
    ])
    items, no_run = extract(text)
    assert [(i["kind"], i["code"]) for i in items] == [
        ("python", "x = 1"), ("command", "tierflow policies"), ("command", "tierflow hardware list"),
        ("command", "tierflow compare a.json --budget 30%"),
    ]
    assert no_run == ["needs torchrun"]


def test_no_block_is_skipped_silently():
    counts = {}
    for page in PAGES:
        items, no_run = extract((REPO / page).read_text(encoding="utf-8"))
        assert items, f"{page}: nothing to run"
        if no_run:
            counts[page] = len(no_run)
    assert counts == NO_RUN


@pytest.mark.parametrize(
    "page", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW_PAGES else p for p in PAGES])
def test_page_runs(request, page):
    items, results, skipped = request.getfixturevalue("ran_slow" if page in SLOW_PAGES else "ran")[page]
    failed = [
        f"{page}:{it['line']}: {it['code'].splitlines()[0]}\n{r['detail']}\n{r['output']}"
        for it, r in zip(items, results) if not r["ok"]
    ]
    assert not failed, "\n\n".join(failed)
    if os.environ.get("DOCS_TIMES"):  # DOCS_TIMES=1 pytest -s: where the seconds go
        for it, r in zip(items, results):
            print(f"TIME {r['seconds']:6.2f} {page}:{it['line']} {it['code'].splitlines()[0][:90]}")
    if skipped:
        pytest.skip("; ".join(f"{page}:{it['line']} {it['why']}" for it in skipped))
