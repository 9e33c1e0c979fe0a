"""tierflow train --report: the followed plan's prediction beside what was measured."""

from tierflow.cli import main


def test_train_writes_a_report_with_measured_beside_predicted(tmp_path, capsys):
    out = tmp_path / "train.html"
    argv = ["train", "--model", "mlp-tiny", "--budget", "60%", "--steps", "3", "--policy", "lru",
            "--report", str(out), "--json"]
    assert main(argv) == 0
    html = out.read_text()
    assert "measured on cpu" in html and "predicted" in html
    assert "http://" not in html and "https://" not in html


def test_planned_evictions_take_the_pool_planners_slots():
    from tierflow.runtime import train

    res = train("gpt-tiny", budget="60%", steps=4, device="cpu", policy="singa",
                policy_options={"min_bytes": 4096}, check_parity=True)
    assert res.parity is True
    assert res.stats.planned_slots > 0  # evictions landed where the pool planner put them


def test_arena_takes_a_planned_slot_only_when_free():
    from tierflow.runtime.tiers import Arena

    a = Arena(1024, align=64)
    assert a.alloc_at(128, 100) == 128 and a.used == 128
    assert a.alloc_at(192, 64) is None  # overlaps the first slot
    assert a.alloc_at(100, 64) is None  # unaligned
    assert a.alloc(64) == 0
    a.release(128, 100)
    a.release(0, 64)
    assert a.used == 0 and a.largest_free() == 1024  # neighbours merged back
