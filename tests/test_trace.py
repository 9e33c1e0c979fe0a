import gzip
import json

import numpy as np
import pytest

from helpers import MB, chain_trace
from tierflow import Op, TensorInfo, Trace, TraceError, load_trace


def test_uses_birth_death_follow_first_and_last_use():
    t = chain_trace()
    assert t.uses(0).tolist() == [0, 2, 3]
    assert t.birth.tolist() == [0, 0, 2]
    assert t.death.tolist() == [3, 2, 3]


def test_gaps_between_uses_and_wrapping_for_persistent():
    t = chain_trace()
    gaps = {(g.tensor, g.after_op, g.before_op): g for g in t.gaps}
    assert gaps[(0, 0, 2)].length_s == pytest.approx(0.020)
    assert not gaps[(0, 0, 2)].wraps
    # the activation is used by ops 0 and 2: one gap of op 1's length
    assert gaps[(1, 0, 2)].length_s == pytest.approx(0.020)
    # W's last use is the last op and its first use op 0: no wrapping gap at all
    assert not any(g.wraps for g in t.gaps)


def test_wrapping_gap_spans_the_iteration_boundary():
    ts = [TensorInfo(0, 8, "parameter", True), TensorInfo(1, 8, "activation")]
    ops = [Op("a", "forward", 1.0, (1,)), Op("b", "forward", 2.0, (0, 1)), Op("c", "backward", 4.0, (1,))]
    (gap,) = [g for g in Trace(ops, ts).gaps if g.tensor == 0]
    assert gap.wraps and (gap.after_op, gap.before_op) == (1, 1)
    assert gap.length_s == pytest.approx(4.0 + 1.0)


def test_live_bytes_counts_persistent_always_and_others_while_alive():
    t = chain_trace()
    assert t.live_bytes.tolist() == [150 * MB, 150 * MB, 180 * MB, 130 * MB]
    assert t.peak_live_bytes == 180 * MB and t.peak_op == 2


def test_ideal_is_the_sum_of_op_times():
    assert chain_trace().ideal_s == pytest.approx(0.045)


def test_in_place_update_counts_the_tensor_once():
    t = chain_trace()
    assert t.op_tensors[3] == (2, 0)
    assert t.working_set_bytes[3] == 130 * MB


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_save_load_round_trip(tmp_path, suffix):
    t = chain_trace()
    path = t.save(tmp_path / f"trace{suffix}")
    if suffix.endswith(".gz"):
        with gzip.open(path, "rt") as f:
            assert json.load(f)["format"] == "tierflow-trace"
    assert load_trace(path) == t


def test_validation_names_the_op_and_field():
    ts = [TensorInfo(0, 8, "activation")]
    with pytest.raises(TraceError, match=r"op 0 \(x\): field 'inputs' names tensor 3"):
        Trace([Op("x", "forward", 1.0, (3,))], ts)
    with pytest.raises(TraceError, match=r"field 'phase'"):
        Trace([Op("x", "sideways", 1.0, (0,))], ts)
    with pytest.raises(TraceError, match=r"field 'duration_s'"):
        Trace([Op("x", "forward", float("nan"), (0,))], ts)
    with pytest.raises(TraceError, match=r"tensor 1 .*no op uses it"):
        Trace([Op("x", "forward", 1.0, (0,))], ts + [TensorInfo(1, 8, "activation")])


def test_load_rejects_bad_files_with_the_file_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TraceError, match="bad.json: not a readable JSON trace"):
        load_trace(bad)
    wrong = tmp_path / "wrong.json"
    data = chain_trace().to_dict()
    data["tensors"][1]["bytes"] = "lots"
    wrong.write_text(json.dumps(data))
    with pytest.raises(TraceError, match=r"wrong.json: tensor 1: field 'bytes' must be an integer"):
        load_trace(wrong)
    data = chain_trace().to_dict()
    data["version"] = 99
    wrong.write_text(json.dumps(data))
    with pytest.raises(TraceError, match="unsupported trace version 99"):
        load_trace(wrong)
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "missing.json")


def test_derived_views_are_numpy():
    t = chain_trace()
    assert isinstance(t.sizes, np.ndarray) and t.sizes.dtype == np.int64
    assert t.op_start_s[-1] == pytest.approx(t.ideal_s)


def _recompute_trace() -> Trace:
    ts = [TensorInfo(0, 8, "parameter", True, "w"), TensorInfo(1, 8, "input"), TensorInfo(2, 8, "activation"),
          TensorInfo(3, 8, "temporary")]
    return Trace([Op("aten::mm", "forward", 1.0, (1, 0), (2,), scope="blocks.0.mlp"),
                  Op("aten::bernoulli_", "forward", 1.0, (2,), (2,), scope="blocks.0.drop", rng=True),
                  Op("aten::mm", "backward", 1.0, (2, 0), (3,), scope=""),
                  Op("aten::add_", "optimizer", 1.0, (0, 3), (0,), pure=False)], ts)


def test_version_2_round_trip_keeps_scope_rng_and_pure(tmp_path):
    t = _recompute_trace()
    data = json.loads(t.save(tmp_path / "t.json").read_text())
    assert data["version"] == 2
    # written only where they differ from the default
    assert [sorted(set(o) - {"name", "phase", "duration_s", "inputs", "outputs"}) for o in data["ops"]] == [
        ["scope"], ["rng", "scope"], ["scope"], ["pure"]]
    assert load_trace(tmp_path / "t.json") == t


def test_version_1_file_loads_with_defaults(tmp_path):
    data = _recompute_trace().to_dict()
    data["version"] = 1
    for o in data["ops"]:
        for k in ("scope", "rng", "pure"):
            o.pop(k, None)
    (tmp_path / "v1.json").write_text(json.dumps(data))
    t = load_trace(tmp_path / "v1.json")
    assert [(o.scope, o.rng, o.pure) for o in t.ops] == [(None, False, True)] * 4


@pytest.mark.parametrize("field, value, message", [
    ("scope", 3, r"op 1: field 'scope' must be a str, got 3"),
    ("rng", "yes", r"op 1: field 'rng' must be a bool, got 'yes'"),
    ("pure", 0, r"op 1: field 'pure' must be a bool, got 0"),
])
def test_bad_recompute_field_names_file_op_and_field(tmp_path, field, value, message):
    data = _recompute_trace().to_dict()
    data["ops"][1][field] = value
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(TraceError, match=r"bad\.json: " + message):
        load_trace(tmp_path / "bad.json")


def test_constructed_op_with_bad_recompute_field_is_rejected():
    ts = [TensorInfo(0, 8, "activation")]
    with pytest.raises(TraceError, match=r"op 0 \(x\): field 'scope' must be a string or None"):
        Trace([Op("x", "forward", 1.0, (0,), scope=1)], ts)
    with pytest.raises(TraceError, match=r"op 0 \(x\): field 'rng' must be a bool"):
        Trace([Op("x", "forward", 1.0, (0,), rng=1)], ts)


def test_op_groups_by_shared_tensors_and_links():
    """Ops that share a tensor are one group, and so are linked ones; an op linked to
    nothing and sharing nothing stays alone; groups come sorted, in order of first op."""
    ts = [TensorInfo(i, 8, "optimizer_state") for i in range(5)]
    ops = [Op("a", "optimizer", 1.0, (0,), (1,)),   # 0: tensors 0, 1
           Op("b", "optimizer", 1.0, (2,)),         # 1: tensor 2
           Op("c", "optimizer", 1.0, (1,), (3,)),   # 2: shares 1 with op 0
           Op("d", "optimizer", 1.0, ()),           # 3: no tensor
           Op("e", "optimizer", 1.0, (4,))]         # 4: tensor 4
    tr = Trace(ops, ts)
    assert tr.op_groups(range(5)) == [[0, 2], [1], [3], [4]]
    assert tr.op_groups(range(5), [(3, 4)]) == [[0, 2], [1], [3, 4]]
    assert tr.op_groups([4, 2, 0]) == [[0, 2], [4]]
    assert tr.op_groups([]) == []
