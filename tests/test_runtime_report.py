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
