"""capture(): op order, storage identity, kinds and keys, liveness, memory truth against
PyTorch's own allocation record, autocast, gradient accumulation, round trip."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tierflow
from tierflow.capture import capture, summarize, zoo, zoo_trace
from tierflow.capture.check import torch_step_peak
from tierflow.errors import TraceError
from tierflow.trace import Trace, load_trace


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(seen.values())


class Net(nn.Module):
    """Views, an in-place op and a tied weight, to exercise storage identity."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16)
        self.b2 = nn.Linear(32, 16, bias=False)
        self.b2.weight = self.b.weight  # tied

    def forward(self, x):
        h = self.a(x).view(-1, 2, 16).transpose(1, 2).reshape(x.shape[0], 32)
        h = torch.relu_(h)  # in place: same storage as h
        return self.b(h) + self.b2(h)


@pytest.fixture(scope="module")
def net_trace() -> tuple[Net, Trace]:
    torch.manual_seed(0)
    net = Net()
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    return net, capture(net, x, F.mse_loss, "adamw", "cpu", target=y, workspace=False)


def test_kinds_keys_and_bytes_match_the_model(net_trace):
    net, tr = net_trace
    params = dict(net.named_parameters())
    assert len(params) == 4  # a.weight, a.bias, b.weight (tied with b2.weight, listed once), b.bias
    by_key = {t.key: t for t in tr.tensors if t.key}
    for n, p in params.items():
        t = by_key[f"param:{n}"]
        assert (t.kind, t.persistent, t.bytes) == ("parameter", True, p.numel() * 4)
        g = by_key[f"grad:{n}"]
        assert (g.kind, g.persistent, g.bytes) == ("gradient", False, p.numel() * 4)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            o = by_key[f"opt:{n}:{k}"]
            assert o.kind == "optimizer_state" and o.persistent
    kinds = tr.bytes_by_kind()
    assert kinds["parameter"] == _storage_bytes(net.parameters())
    assert kinds["gradient"] == kinds["parameter"]
    assert kinds["optimizer_state"] == 2 * kinds["parameter"] + 4 * len(params)  # + fp32 step counters on cpu
    assert by_key["input:0"].kind == by_key["input:1"].kind == "input"
    assert len({t.key for t in tr.tensors if t.key}) == sum(1 for t in tr.tensors if t.key)  # keys unique


def test_every_aten_op_is_recorded_in_order(net_trace):
    _, tr = net_trace
    # The same iteration under a bare dispatch mode lists the same aten ops.
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    net = Net()
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    for _ in range(1):
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    names: list[str] = []

    class Names(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            names.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    with Names():
        F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    # aten::detach (no kernel, no allocation) is left out: autograd issues it or not
    # depending on whether saved-tensor hooks are installed
    assert [o.name for o in tr.ops] == [n for n in names if n != "aten::detach"]
    phases = [o.phase for o in tr.ops]
    assert phases == sorted(phases, key=("forward", "backward", "optimizer").index)
    assert {"forward", "backward", "optimizer"} == set(phases)


def test_views_and_in_place_ops_share_one_tensor(net_trace):
    _, tr = net_trace
    for o in tr.ops:
        if o.name in ("aten::view", "aten::transpose", "aten::t", "aten::relu_", "aten::add_", "aten::detach"):
            assert set(o.outputs) <= set(o.inputs), o  # the result is the input's storage
    # the 8x32 hidden activation is one storage though it is viewed, reshaped, relu'd in place
    relu = next(o for o in tr.ops if o.name == "aten::relu_")
    assert tr.tensors[relu.outputs[0]].bytes == 8 * 32 * 4
    # ids never reused: distinct storages alive at once never share an id, and sizes are fixed
    assert [t.id for t in tr.tensors] == list(range(tr.n_tensors))


def test_saved_activations_die_in_backward_and_keys_follow_pack_order(net_trace):
    _, tr = net_trace
    acts = [t for t in tr.tensors if t.kind == "activation"]
    assert acts
    seqs = [int(t.key.split(":")[1]) for t in acts]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    for t in acts:
        assert tr.ops[tr.first_use[t.id]].phase == "forward"
        assert tr.ops[tr.last_use[t.id]].phase == "backward"
    for t in tr.tensors:
        if t.kind == "gradient":
            assert tr.ops[tr.first_use[t.id]].phase == "backward"
            assert tr.ops[tr.last_use[t.id]].phase == "optimizer"
    assert tr.meta["saved_tensors"] >= len(acts)


@pytest.mark.parametrize("name,batch,seq", [("gpt-tiny", 8, 64), ("resnet-tiny", 16, None), ("vit-tiny", 16, None)])
def test_peak_live_bytes_within_5_percent_of_pytorch(name, batch, seq):
    m = zoo.build(name, device="cpu")
    x, y = m.make_batch(batch, seq)
    tr = capture(m.model, x, m.loss_fn, "adamw", "cpu", target=y)
    ref = zoo.build(name, device="cpu")
    rx, ry = ref.make_batch(batch, seq)
    got = torch_step_peak(ref.model, rx, ry, ref.loss_fn, torch.optim.AdamW(ref.model.parameters(), lr=1e-4))
    assert tr.peak_live_bytes == pytest.approx(got["peak_bytes"], rel=0.05)
    # and the peak is the interesting part of the step, not the persistent state alone
    assert got["peak_bytes"] > 1.5 * got["baseline_bytes"]


def test_workspace_matters_for_convolutions():
    m = zoo.build("resnet-tiny", device="cpu")
    x, y = m.make_batch(2)
    with_ws = capture(m.model, x, m.loss_fn, "none", "cpu", target=y, warmup=0)
    without = capture(m.model, x, m.loss_fn, "none", "cpu", target=y, warmup=0, workspace=False)
    ws = [t for t in with_ws.tensors if t.name.startswith("<workspace")]
    assert ws and all(len(with_ws.uses(t.id)) == 1 for t in ws)
    assert with_ws.n_ops == without.n_ops
    assert with_ws.peak_live_bytes > without.peak_live_bytes


def test_meta_capture_matches_cpu_capture_bytes():
    cpu = zoo_trace("mlp-tiny", batch=8, device="cpu")
    meta = zoo_trace("mlp-tiny", batch=8, device="meta")
    sc, sm = summarize(cpu), summarize(meta)
    assert sm["param_bytes"] == sc["param_bytes"]
    assert sm["grad_bytes"] == sc["grad_bytes"]
    assert sm["activation_peak_bytes"] == sc["activation_peak_bytes"]
    # meta leaves out AdamW's step counters, which stay on the host
    assert sc["optimizer_bytes"] - sm["optimizer_bytes"] == 4 * len(list(zoo.build("mlp-tiny").model.parameters()))
    assert meta.meta["timing"] == "roofline" and cpu.meta["timing"] == "measured"
    assert all(o.duration_s >= 0 for o in meta.ops) and meta.ideal_s > 0


def test_meta_durations_follow_the_cost_model():
    from tierflow.capture.cost import roofline
    from tierflow.hardware import load_hardware

    hw = load_hardware("a100-40g-pcie4-nvme")
    net = nn.Linear(512, 256, bias=False)
    tr = capture(net, torch.randn(128, 512), optimizer="none", device="meta", hardware=hw)
    mm = next(o for o in tr.ops if o.name == "aten::mm" and o.phase == "forward")
    flops, nbytes = 2 * 128 * 512 * 256, 4 * (128 * 512 + 512 * 256 + 128 * 256)
    assert mm.duration_s == pytest.approx(roofline(flops, nbytes, hw.compute, "fp32") + 4e-6)
    assert tr.meta["hardware"] == "a100-40g-pcie4-nvme"


def test_gradient_accumulation_is_faithful():
    m = zoo.build("mlp-tiny", device="cpu")
    x, y = m.make_batch(8)
    one = capture(m.model, x, m.loss_fn, "adamw", "cpu", target=y, workspace=False)
    two = capture(m.model, x, m.loss_fn, "adamw", "cpu", target=y, accumulation_steps=2, workspace=False)
    runs = [two.ops[0].phase]
    for o in two.ops[1:]:
        if o.phase != runs[-1]:
            runs.append(o.phase)
    assert runs == ["forward", "backward", "forward", "backward", "optimizer"]
    assert summarize(two)["grad_bytes"] == summarize(one)["grad_bytes"]  # grads accumulate in place
    assert two.meta["saved_tensors"] == 2 * one.meta["saved_tensors"]
    b1 = next(i for i, o in enumerate(two.ops) if o.phase == "backward")
    f2 = next(i for i, o in enumerate(two.ops) if i > b1 and o.phase == "forward")
    for t in two.tensors:
        if t.kind == "gradient":  # born in the first backward, alive through the second
            assert two.first_use[t.id] < f2 < two.last_use[t.id]
    # half-size micro-batches: less activation memory at the peak
    assert summarize(two)["activation_peak_bytes"] < summarize(one)["activation_peak_bytes"]
    with pytest.raises(TraceError, match="does not divide"):
        capture(m.model, x, m.loss_fn, target=y, accumulation_steps=3)


def test_bf16_autocast_keeps_fp32_state_and_halves_matmul_operands():
    for device in ("cpu", "meta"):
        full = zoo_trace("gpt-tiny", batch=4, device=device)
        amp = zoo_trace("gpt-tiny", batch=4, device=device, autocast="bf16")
        sf, sa = summarize(full), summarize(amp)
        assert sa["param_bytes"] == sf["param_bytes"] and sa["optimizer_bytes"] == sf["optimizer_bytes"]
        assert amp.meta["autocast"] == "bfloat16"
        casts = [o for o in amp.ops if o.name == "aten::_to_copy" and o.phase == "forward"]
        assert casts, device
        # a bf16 copy of each weight is saved for the matmul backward: an activation half the weight's size
        w = next(t for t in amp.tensors if t.key == "param:h.0.mlp.fc.weight")
        halves = [t for t in amp.tensors if t.kind == "activation" and t.bytes == w.bytes // 2]
        assert halves, device


def test_round_trip_save_load(tmp_path, net_trace):
    _, tr = net_trace
    for name in ("t.json", "t.json.gz"):
        back = load_trace(tr.save(tmp_path / name))
        assert back.to_dict() == tr.to_dict()
        assert back.peak_live_bytes == tr.peak_live_bytes


def test_captured_trace_simulates_and_compares():
    simulate = pytest.importorskip("tierflow.simulate")
    policies = pytest.importorskip("tierflow.policies")
    from tierflow.hardware import load_hardware

    tr = zoo_trace("gpt-tiny", batch=4)
    hw = load_hardware("h100-80g-pcie5-nvme")
    ideal = simulate.simulate(tr, hw, policies.make_plan("ideal", tr, hw))
    assert ideal.fits and ideal.time_s == pytest.approx(tr.ideal_s, rel=1e-6)
    plan = policies.make_plan("lru", tr, hw, budget="60%")
    res = simulate.simulate(tr, hw, plan)
    assert res.fits and res.time_s >= tr.ideal_s
    assert res.peak_bytes[hw.device] <= plan.budget_bytes


def test_any_module_and_hf_style_outputs():
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x, labels):
            out = self.lin(x).squeeze(-1)
            return {"loss": F.mse_loss(out, labels), "logits": out}

    tr = tierflow.capture(WithLoss(), {"x": torch.randn(6, 4), "labels": torch.randn(6)}, device="cpu")
    assert {t.key for t in tr.tensors} >= {"param:lin.weight", "input:0", "input:1"}
    with pytest.raises(TraceError, match="optimizer"):
        capture(nn.Linear(2, 2), torch.randn(1, 2), optimizer="lamb")
    with pytest.raises(TraceError, match="timing"):
        capture(nn.Linear(2, 2), torch.randn(1, 2), device="meta", timing="measured")
    with pytest.raises(TraceError, match="device"):
        capture(nn.Linear(2, 2), torch.randn(1, 2), device="tpu")


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_hugging_face_model_from_config():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    tr = capture(model, {"input_ids": ids, "labels": ids}, device="meta")
    n = sum(p.numel() for p in model.parameters())
    s = summarize(tr)
    assert s["param_bytes"] == 4 * n and s["optimizer_bytes"] == 8 * n and s["grad_bytes"] == 4 * n
    assert any(t.kind == "activation" for t in tr.tensors)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_zoo_parameter_counts_equal_hugging_face_models():
    import transformers as tf

    cases = {
        "gpt2-medium": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=24, n_embd=1024, n_head=16)),
        "bert-base": lambda: tf.BertForMaskedLM(tf.BertConfig()),
        "vit-b16": lambda: tf.ViTForImageClassification(tf.ViTConfig(num_labels=1000)),
    }
    for name, make in cases.items():
        with torch.device("meta"):
            hf = make()
        assert zoo.param_count(hf) == zoo.param_count(zoo.build(name, device="meta").model), name
