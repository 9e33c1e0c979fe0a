"""The G10 importer against the facts in shared/benchmarks/g10/README.md."""

import json

import pytest

from tierflow import TraceError, load_trace
from tierflow.cli import main

# case: (kernels, tensors, globals, sum of Execution Time in cycles, makeLoss kernel)
FACTS = {
    "bert-256": (1369, 1463, 156, 8_742_558_777),
    "vit-1280": (1489, 1563, 157, 4_459_141_336),
    "inceptionv3-1536": (929, 2171, 378, 71_633_241_480),
    "resnet152-1280": (1299, 3330, 622, 135_107_260_924),
    "senet154-1024": (2319, 4341, 730, 159_444_570_406),
}


@pytest.mark.parametrize("case", sorted(FACTS))
def test_case_matches_published_facts(g10_dir, case):
    kernels, tensors, globals_, cycles = FACTS[case]
    t = load_trace(g10_dir / case)
    assert (t.n_ops, t.n_tensors, int(t.persistent.sum())) == (kernels, tensors, globals_)
    assert t.meta["total_cycles"] == cycles
    assert t.ideal_s == pytest.approx(cycles / 1.2e9, rel=1e-12)


def test_kinds_and_phases_are_inferred(g10_dir):
    t = load_trace(g10_dir / "resnet152-1280")
    kinds = t.bytes_by_kind()
    assert kinds["parameter"] == 242_307_072  # the README's weight total
    assert kinds["temporary"] > 300 * 2**30  # cuDNN workspaces, never read
    assert kinds["input"] > 0 and kinds["gradient"] > 0
    assert t.ops[0].name == "LoadData_A0"
    assert {o.phase for o in t.ops} == {"forward", "backward", "optimizer"}
    assert t.ops[415].name == "makeLoss" and t.ops[415].phase == "forward" and t.ops[416].phase != "forward"


def test_ideal_cli_reports_the_kernel_sum(g10_dir, capsys):
    assert main(["simulate", str(g10_dir / "bert-256"), "--hardware", "g10-a100", "--policy", "ideal", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ideal_s"] == pytest.approx(8_742_558_777 / 1.2e9, rel=1e-12)
    assert out["ratio"] == 1.0 and out["stall_s"] == 0.0


def test_malformed_case_names_file_and_line(tmp_path, g10_dir):
    case = tmp_path / "broken"
    case.mkdir()
    (case / "tensors.config").write_text((g10_dir / "bert-256" / "tensors.config").read_text())
    text = (g10_dir / "bert-256" / "kernels.config").read_text().splitlines()
    text[2] = "Execution Time: fast"
    (case / "kernels.config").write_text("\n".join(text))
    with pytest.raises(TraceError, match=r"kernels.config:3: field 'Execution Time'"):
        load_trace(case)
    (case / "tensors.config").unlink()
    with pytest.raises(TraceError, match="tensors.config is missing"):
        load_trace(case)
