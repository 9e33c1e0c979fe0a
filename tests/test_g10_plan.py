"""Reading G10's prefetch_guide.config as a tierflow plan, and replaying it."""

from __future__ import annotations

import json

import pytest

from helpers import chain_trace, simple_hw
from tierflow import PlanError, load_hardware, load_trace
from tierflow.cli import main
from tierflow.formats.g10_plan import load_g10_plan
from tierflow.simulate import simulate
from tierflow.simulate.engine import CopyEngines

# chain_trace: W (0, persistent) used by ops 0, 2, 3; A (1) born at 0, read at 2;
# G (2) born at 2, read at 3.
HINTS = """\
Issued Time: 0 Tensor: 1 G:x From: Not_Known, To: In_gpu
Issued Time: 1 Tensor: 1 G:x From: Not_Known, To: In_cpu
Issued Time: 1 Tensor: 0 G:o From: Not_Known, To: In_ssd
Issued Time: 2 Tensor: 0 G:o From: Not_Known, To: In_gpu
Issued Time: 2 Tensor: 1 G:x From: Not_Known, To: In_gpu
Issued Time: 3 Tensor: 1 G:x From: Not_Known, To: Not_present
Issued Time: 4 Tensor: 2 G:x From: Not_Known, To: Not_present
"""


def _write(tmp_path, text):
    path = tmp_path / "prefetch_guide.config"
    path.write_text(text)
    return path


def test_hints_become_moves(tmp_path):
    trace, hw = chain_trace(), simple_hw()
    plan = load_g10_plan(_write(tmp_path, HINTS), trace, hw, budget=2**30)
    assert plan.reactive and plan.frees_dead and plan.budget_bytes == 2**30
    moves = {(m.kind, m.tensor): m for m in plan.moves}
    # a hint at kernel k acts as kernel k begins: after op k - 1 ends
    assert moves[("evict", 1)].after_op == 0 and moves[("evict", 1)].tier == "host"
    assert moves[("evict", 0)].after_op == 0 and moves[("evict", 0)].tier == "ssd"
    assert moves[("prefetch", 1)].after_op == 1 and moves[("prefetch", 1)].needed_by == 2
    assert moves[("prefetch", 0)].needed_by == 2
    hints = plan.meta["hints"]
    # In_gpu at the birth kernel is a pre-allocation; both frees match the deaths
    assert hints["prealloc_dropped"] == 1 and hints["free"] == 2 and hints["free_mismatch"] == 0
    assert len(plan.moves) == 4
    res = simulate(trace, hw, plan)
    # on this machine the SSD is reached through host memory: both cross gpu->host
    assert res.error is None and res.traffic_bytes["gpu->host"] == trace.sizes[0] + trace.sizes[1]


@pytest.mark.parametrize(
    "line, message",
    [
        ("Issued Time: x Tensor: 1", r"prefetch_guide.config:8: not a G10 hint"),
        ("Issued Time: 1 Tensor: 9 G:x From: Not_Known, To: In_cpu", r":8: tensor 9 does not exist"),
        ("Issued Time: 7 Tensor: 1 G:x From: Not_Known, To: In_cpu", r":8: issued time 7 is outside"),
        ("Issued Time: 1 Tensor: 1 G:o From: Not_Known, To: In_cpu", r":8: tensor 1 is marked G:o"),
        ("Issued Time: 1 Tensor: 1 G:x From: Not_Known, To: In_pmem", r":8: field 'To' is 'In_pmem'"),
    ],
)
def test_bad_lines_are_named(tmp_path, line, message):
    with pytest.raises(PlanError, match=message):
        load_g10_plan(_write(tmp_path, HINTS + line + "\n"), chain_trace(), simple_hw(), budget=2**30)


def test_a_fault_does_not_wait_behind_queued_prefetches():
    eng = CopyEngines(simple_hw(pcie_gbps=10.0))
    done = {}
    eng.submit(0, 10 * 10**9, "host", "gpu", "prefetch", lambda f: done.setdefault("prefetch", eng.now))
    eng.submit(1, 10 * 10**9, "host", "gpu", "prefetch", lambda f: done.setdefault("queued", eng.now))
    eng.submit(2, 10**9, "host", "gpu", "fault", lambda f: done.setdefault("fault", eng.now))
    while eng.busy():
        eng.step()
    # the fault shares the link with the head prefetch (5 GB/s each) instead of
    # waiting two seconds for both prefetches
    assert done["fault"] == pytest.approx(0.2)
    assert done["queued"] == pytest.approx(2.1)


def test_replaying_g10s_bert_plan(g10_dir):
    case = g10_dir / "bert-256"
    trace, hw = load_trace(case), load_hardware("g10-a100")
    plan = load_g10_plan(case / "prefetch_guide.config", trace, hw, budget=40 * 2**30)
    assert plan.meta["hints"]["free_mismatch"] == 0
    res = simulate(trace, hw, plan)
    assert res.ratio == pytest.approx(0.997, abs=0.05)  # G10's published ratio
    # G10's published SSD traffic for this plan: 565,248 pages each way
    assert res.traffic_bytes["gpu->ssd"] / 4096 == pytest.approx(565_248, rel=0.01)
    assert res.traffic_bytes["ssd->gpu"] / 4096 == pytest.approx(565_248, rel=0.01)


def test_cli_replays_a_plan_file(g10_dir, capsys):
    case = g10_dir / "bert-256"
    argv = ["simulate", str(case), "--plan-file", str(case / "prefetch_guide.config"), "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "g10-replay" and out["ratio"] > 0.9
