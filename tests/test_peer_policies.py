"""The peer policies users run today: checkpoint, selective, save_on_cpu, offload_activations.

Recompute plans are checked on a hand-made transformer trace whose every tensor is
known (which ones a block keeps, drops and re-creates, and where), offload plans on the
synthetic GPT trace with scopes; every plan is checked by the validator and simulated.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import MB, simple_hw
from tierflow import Op, TensorInfo, Trace, load_hardware, validate
from tierflow.errors import PlanError, PolicyError
from tierflow.policies import make_plan, policy_options
from tierflow.policies._recompute import find_blocks, planned_device_bytes
from tierflow.simulate import simulate
from tierflow.synthetic import gpt_trace

PEERS = ("checkpoint", "selective", "save_on_cpu", "offload_activations")
# per block: what a block makes that backward uses, by name (o and m are read only in forward)
BLOCK_SAVED = ("n", "mean", "q", "a", "lse", "h", "g")


class _Builder:
    def __init__(self) -> None:
        self.tensors: list[TensorInfo] = []
        self.ops: list[Op] = []
        self.ids: dict[str, int] = {}

    def t(self, name: str, nbytes: int, kind: str = "activation", persistent: bool = False) -> int:
        self.tensors.append(TensorInfo(len(self.tensors), nbytes, kind, persistent, name))
        self.ids[name] = len(self.tensors) - 1
        return self.ids[name]

    def op(self, name: str, phase: str, ins, outs, scope=None, dur=1e-3, **kw) -> int:
        self.ops.append(Op(name, phase, dur, tuple(ins), tuple(outs), scope=scope, **kw))
        return len(self.ops) - 1


def transformer(layers: int = 3, act: int = 10 * MB, dropout: bool = False, batchnorm: bool = False) -> tuple[Trace, dict]:
    """A pre-norm transformer with aten op names and module scopes ``layers.N``:
    per block norm, q projection (mm), flash attention, output projection (mm), residual
    add, GELU, MLP mm, residual add; then the head (scope ``output``) and the loss (no
    scope). ``dropout`` adds an RNG op after the attention; ``batchnorm`` makes the norm
    an impure batch norm that updates a running-stats buffer."""
    b = _Builder()
    ids = b.t("ids", 1 * MB, "input")
    emb = b.t("emb", 20 * MB, "parameter", True)
    x = b.t("x0", act)
    b.op("aten::embedding", "forward", (ids, emb), (x,), scope="tok_embeddings")
    blocks = []
    for i in range(layers):
        s = f"layers.{i}"
        w = {k: b.t(f"{s}.{k}", 2 * MB, "parameter", True) for k in ("ln", "q", "o", "w2")}
        n, mean = b.t(f"{s}.n", act), b.t(f"{s}.mean", 1 * MB)
        ops = {}
        if batchnorm:
            stats = b.t(f"{s}.running", 1 * MB, "parameter", True)
            ops["norm"] = b.op("aten::native_batch_norm", "forward", (x, w["ln"], stats), (n, mean, stats),
                               scope=f"{s}.norm", pure=False)
        else:
            ops["norm"] = b.op("aten::native_layer_norm", "forward", (x, w["ln"]), (n, mean), scope=f"{s}.norm")
        q = b.t(f"{s}.q", act)
        ops["q"] = b.op("aten::mm", "forward", (n, w["q"]), (q,), scope=f"{s}.attention.wq")
        a, lse = b.t(f"{s}.a", act), b.t(f"{s}.lse", 1 * MB)
        ops["sdpa"] = b.op("aten::_scaled_dot_product_flash_attention", "forward", (q,), (a, lse), scope=f"{s}.attention")
        if dropout:
            mask = b.t(f"{s}.mask", act)
            a2 = b.t(f"{s}.a2", act)
            b.op("aten::native_dropout", "forward", (a,), (a2, mask), scope=f"{s}.attention", rng=True)
        o = b.t(f"{s}.o", act)
        ops["o"] = b.op("aten::mm", "forward", (a2 if dropout else a, w["o"]), (o,), scope=f"{s}.attention.wo")
        h = b.t(f"{s}.h", act)
        ops["add"] = b.op("aten::add", "forward", (x, o), (h,), scope=s)
        g = b.t(f"{s}.g", 4 * act)
        ops["gelu"] = b.op("aten::gelu", "forward", (h,), (g,), scope=f"{s}.feed_forward")
        m = b.t(f"{s}.m", act)
        ops["w2"] = b.op("aten::mm", "forward", (g, w["w2"]), (m,), scope=f"{s}.feed_forward.w2")
        nxt = b.t(f"x{i + 1}", act)
        ops["add2"] = b.op("aten::add", "forward", (h, m), (nxt,), scope=s)
        blocks.append(dict(x=x, w=w, n=n, mean=mean, q=q, a=a, lse=lse, h=h, g=g, o=o, m=m, out=nxt, ops=ops,
                           mask=mask if dropout else None, a2=a2 if dropout else None))
        x = nxt
    w_out = b.t("output.weight", 20 * MB, "parameter", True)
    logits = b.t("logits", 4 * act)
    b.op("aten::mm", "forward", (x, w_out), (logits,), scope="output")
    loss = b.t("loss", 4, "temporary")
    b.op("aten::_log_softmax", "forward", (logits,), (loss,))
    dlogits = b.t("dlogits", 4 * act, "temporary")
    b.op("aten::_log_softmax_backward_data", "backward", (loss, logits), (dlogits,))
    dx = b.t(f"dx{layers}", act, "temporary")
    dw_out = b.t("output.weight.grad", 20 * MB, "gradient")
    b.op("aten::mm", "backward", (dlogits, x, w_out), (dx, dw_out))
    for i in reversed(range(layers)):
        blk = blocks[i]
        w = blk["w"]
        grads = {k: b.t(f"layers.{i}.{k}.grad", 2 * MB, "gradient") for k in w}
        dg = b.t(f"d{i}.g", 4 * act, "temporary")
        blk["bwd_first"] = b.op("aten::mm", "backward", (dx, blk["g"], w["w2"]), (dg, grads["w2"]))
        dh1 = b.t(f"d{i}.h1", act, "temporary")
        b.op("aten::gelu_backward", "backward", (dg, blk["h"]), (dh1,))
        dh = b.t(f"d{i}.h", act, "temporary")
        b.op("aten::add", "backward", (dx, dh1), (dh,))
        da = b.t(f"d{i}.a", act, "temporary")
        b.op("aten::mm", "backward", (dh, blk["a2"] if dropout else blk["a"], w["o"]), (da, grads["o"]))
        if dropout:
            da2 = b.t(f"d{i}.a2", act, "temporary")
            b.op("aten::native_dropout_backward", "backward", (da, blk["mask"]), (da2,))
            da = da2
        dq = b.t(f"d{i}.q", act, "temporary")
        b.op("aten::_scaled_dot_product_flash_attention_backward", "backward",
             (da, blk["q"], blk["a"], blk["lse"]), (dq,))
        dn = b.t(f"d{i}.n", act, "temporary")
        b.op("aten::mm", "backward", (dq, blk["n"], w["q"]), (dn, grads["q"]))
        dxi = b.t(f"dx{i}", act, "temporary")
        b.op("aten::native_layer_norm_backward", "backward", (dn, blk["x"], blk["mean"], w["ln"], dh), (dxi, grads["ln"]))
        dx = dxi
    b.op("aten::embedding_dense_backward", "backward", (dx, ids), (b.t("emb.grad", 20 * MB, "gradient"),))
    return Trace(b.ops, b.tensors, "mini-transformer"), {"blocks": blocks, "logits": logits, "ids": b.ids}


def _check(plan, trace, hw, budget):
    assert plan.budget_bytes == budget
    res = validate(plan, trace, hw)  # raises if inconsistent or over any capacity
    assert res.tier_bytes[hw.device].max() <= budget
    if plan.recomputes:  # the policy's own count is the validator's
        assert (planned_device_bytes(trace, plan.recomputes) == res.tier_bytes[hw.device]).all()
    r = simulate(trace, hw, plan)
    assert r.error is None and r.fits and r.peak_bytes[hw.device] <= budget
    assert r.time_s >= trace.ideal_s
    return r


@pytest.fixture(scope="module")
def tiny():
    return transformer()


def _tight(trace: Trace) -> int:
    return int(0.9 * trace.peak_live_bytes)


# -- blocks ---------------------------------------------------------------------------------


def test_blocks_are_the_repeated_layers(tiny):
    trace, info = tiny
    blocks = find_blocks(trace)
    assert blocks.found_by == "scopes"
    assert [b.name for b in blocks.blocks] == ["layers.0", "layers.1", "layers.2"]
    for b, blk in zip(blocks.blocks, info["blocks"]):
        assert b.ops == tuple(range(blk["ops"]["norm"], blk["ops"]["add2"] + 1))


def _scoped(scopes_and_names) -> Trace:
    ts = [TensorInfo(0, MB, "activation")]
    ops = [Op(name, "forward", 1e-3, (0,), (0,), scope=scope) for scope, name in scopes_and_names]
    return Trace(ops, ts, "scoped")


def _resnet18_like():
    # four stages of two blocks; block 0 of stages 2-4 has a downsample, so stages
    # 2-4 are identical to each other and their two blocks are not
    out = []
    for s in range(1, 5):
        for j in range(2):
            parts = ["conv1", "bn1", "conv2", "bn2"] + (["downsample.0"] if s > 1 and j == 0 else [])
            out += [(f"layer{s}.{j}.{k}", "aten::convolution" if "conv" in k or "down" in k else "aten::native_batch_norm")
                    for k in parts]
    return [("conv1", "aten::convolution")] + out + [("fc", "aten::addmm")]


def test_blocks_are_resnet_blocks_not_stages():
    names = [b.name for b in find_blocks(_scoped(_resnet18_like())).blocks]
    assert names == [f"layer{s}.{j}" for s in range(1, 5) for j in range(2)]


def test_blocks_are_layers_not_the_experts_inside():
    ops = []
    for i in range(3):
        ops += [(f"layers.{i}.attention", "aten::mm"), (f"layers.{i}.attention", "aten::_scaled_dot_product_flash_attention"),
                (f"layers.{i}.attention", "aten::mm"), (f"layers.{i}.moe.router", "aten::mm"), (f"layers.{i}.moe.router", "aten::topk")]
        for e in range(4):
            ops += [(f"layers.{i}.moe.experts.{e}", "aten::mm"), (f"layers.{i}.moe.experts.{e}", "aten::silu")]
    names = [b.name for b in find_blocks(_scoped(ops)).blocks]
    assert names == ["layers.0", "layers.1", "layers.2"]


def test_leaf_layers_of_a_sequential_are_not_blocks():
    # Linear (two ops) and ReLU, eight times: the Linears match but have no submodules
    ops = [op for j in range(8) for op in ((f"net.{2 * j}", "aten::t"), (f"net.{2 * j}", "aten::addmm"),
                                           (f"net.{2 * j + 1}", "aten::relu"))]
    assert find_blocks(_scoped(ops)).found_by == "sqrt(n)"


def test_blocks_from_a_pattern(tiny):
    trace, _ = tiny
    blocks = find_blocks(trace, pattern=r"layers\.\d+\.feed_forward")
    assert blocks.found_by == "pattern" and len(blocks.blocks) == 3
    assert all(b.name.endswith("feed_forward") for b in blocks.blocks)
    with pytest.raises(PolicyError, match="matches no"):
        find_blocks(trace, pattern="nothing")
    with pytest.raises(PolicyError, match="regular expression"):
        find_blocks(trace, pattern="(")


def test_without_scopes_sqrt_n_segments():
    trace = gpt_trace(load_hardware("rtx4090-24g"), layers=8, d_model=256, batch=2, seq=128)
    trace = dataclasses.replace(trace, ops=tuple(dataclasses.replace(o, scope=None) for o in trace.ops))
    n = sum(o.phase == "forward" for o in trace.ops)
    blocks = find_blocks(trace)
    k = round(math.sqrt(n))
    assert blocks.found_by == "sqrt(n)"
    # checkpoint_sequential: k segments of n // k ops, the last one not checkpointed
    assert len(blocks.blocks) == k - 1
    assert all(len(b.ops) == n // k for b in blocks.blocks)
    assert len(find_blocks(trace, segments=3).blocks) == 2


# -- checkpoint -------------------------------------------------------------------------------


def test_checkpoint_drops_exactly_the_blocks_saved_interior(tiny):
    trace, info = tiny
    hw = simple_hw()
    plan = make_plan("checkpoint", trace, hw, budget=_tight(trace))
    assert len(plan.recomputes) == 3 and not plan.moves
    kept_inputs = {blk["x"] for blk in info["blocks"]}
    for r, blk in zip(plan.recomputes, info["blocks"]):
        assert set(r.tensors) == {blk[k] for k in BLOCK_SAVED}
        assert not set(r.tensors) & kept_inputs  # block inputs and outputs stay
        assert r.before_op == blk["bwd_first"]
        # early stop: re-run up to the MLP's mm (it saves its weight), not the last add
        ops = blk["ops"]
        assert r.ops == tuple(range(ops["norm"], ops["w2"] + 1))
        assert r.restore_rng
    r = _check(plan, trace, hw, plan.budget_bytes)
    # the chains run on the compute stream: the step pays for every re-run op
    assert r.recompute_ops == sum(len(c.ops) for c in plan.recomputes)
    assert r.recompute_s == pytest.approx(plan.meta["recompute_s"])
    assert r.time_s >= trace.ideal_s + plan.meta["recompute_s"] - 1e-12


def test_checkpoint_planned_peak(tiny):
    trace, info = tiny
    plan = make_plan("checkpoint", trace, simple_hw(), budget=_tight(trace))
    curve = planned_device_bytes(trace, plan.recomputes)
    assert plan.meta["planned_peak_bytes"] == curve.max() <= plan.budget_bytes
    # in forward, after block 0 has run, its saved interior is gone
    blk = info["blocks"][0]
    after = blk["ops"]["add2"] + 1
    gone = sum(trace.tensors[blk[k]].bytes for k in BLOCK_SAVED)
    assert trace.live_bytes[after] - curve[after] == gone
    assert curve.max() < trace.peak_live_bytes


def test_checkpoint_without_early_stop_reruns_the_whole_block(tiny):
    trace, info = tiny
    plan = make_plan("checkpoint", trace, simple_hw(), budget=_tight(trace), early_stop=False)
    ops = info["blocks"][0]["ops"]
    assert plan.recomputes[0].ops == tuple(range(ops["norm"], ops["add2"] + 1))


def test_checkpoint_reruns_dropout_with_its_rng_state():
    trace, info = transformer(dropout=True)
    plan = make_plan("checkpoint", trace, simple_hw(), budget=_tight(trace))
    r = plan.recomputes[0]
    assert info["blocks"][0]["mask"] in r.tensors
    assert any(trace.ops[i].rng for i in r.ops) and r.restore_rng


def test_checkpoint_reruns_batchnorm_as_torch_does_or_keeps_it():
    trace, info = transformer(batchnorm=True)
    hw = simple_hw()
    rerun = make_plan("checkpoint", trace, hw, budget=_tight(trace))
    assert rerun.meta["impure_reruns"] == 3
    assert info["blocks"][0]["ops"]["norm"] in rerun.recomputes[0].ops
    keep = make_plan("checkpoint", trace, hw, budget=_tight(trace), impure="keep")
    r = keep.recomputes[0]
    blk = info["blocks"][0]
    assert keep.meta["impure_reruns"] == 0 and blk["ops"]["norm"] not in r.ops
    assert blk["n"] not in r.tensors and blk["q"] in r.tensors
    with pytest.raises(PolicyError, match="impure"):
        make_plan("checkpoint", trace, hw, impure="skip")
    # selective checkpointing is torch.utils.checkpoint underneath: it re-runs it too
    sac = make_plan("selective", trace, hw, budget=_tight(trace))
    assert sac.meta["impure_reruns"] == 3
    for plan in (rerun, keep, sac):
        _check(plan, trace, hw, plan.budget_bytes)


def test_checkpoint_refuses_with_bytes_when_even_checkpointing_is_too_big(tiny):
    trace, _ = tiny
    hw = simple_hw()
    plan = make_plan("checkpoint", trace, hw, budget=_tight(trace))
    too_small = plan.meta["planned_peak_bytes"] - 1
    with pytest.raises(PlanError, match=r"checkpoint: no plan fits .* bytes") as e:
        make_plan("checkpoint", trace, hw, budget=too_small)
    assert str(plan.meta["planned_peak_bytes"]) in str(e.value)


# -- selective ----------------------------------------------------------------------------------


def test_selective_saves_attention_and_every_other_mm(tiny):
    trace, info = tiny
    hw = simple_hw()
    plan = make_plan("selective", trace, hw, budget=_tight(trace))
    for r, blk in zip(plan.recomputes, info["blocks"]):
        ops = blk["ops"]
        # mm #1 (wq) and #3 (w2) and the attention are saved; mm #2 (wo) is recomputed
        assert not {ops["q"], ops["sdpa"], ops["w2"]} & set(r.ops)
        assert ops["o"] in r.ops
        # kept: the saved ops' outputs; re-created: what the cheap ops saved
        assert set(r.tensors) == {blk[k] for k in ("n", "mean", "h", "g")}
        # early_stop=False in torchtitan: the last add is re-run too
        assert ops["add2"] in r.ops and r.restore_rng
    assert plan.meta["saved_ops"] == 9
    _check(plan, trace, hw, plan.budget_bytes)


def test_selective_keeps_more_than_checkpoint(tiny):
    trace, _ = tiny
    hw = simple_hw()
    full = make_plan("checkpoint", trace, hw, budget=_tight(trace))
    sac = make_plan("selective", trace, hw, budget=_tight(trace))
    assert sac.meta["recomputed_bytes"] < full.meta["recomputed_bytes"]
    assert sac.meta["recompute_s"] < full.meta["recompute_s"]
    # a budget only full checkpointing meets
    between = (full.meta["planned_peak_bytes"] + sac.meta["planned_peak_bytes"]) // 2
    make_plan("checkpoint", trace, hw, budget=between)
    with pytest.raises(PlanError, match=r"selective: no plan fits .* bytes"):
        make_plan("selective", trace, hw, budget=between)


def test_selective_holds_a_saved_output_the_rerun_reads(tiny):
    trace, info = tiny
    plan = make_plan("selective", trace, simple_hw(), budget=_tight(trace))
    blk = info["blocks"][1]
    m = blk["m"]  # w2's output: read only by the last add in forward, which is re-run
    r = plan.recomputes[1]
    curve = planned_device_bytes(trace, plan.recomputes)
    mid = (blk["ops"]["add2"] + r.before_op) // 2
    other = planned_device_bytes(trace, plan.recomputes[:1] + plan.recomputes[2:])
    assert trace.death[m] < mid < r.before_op
    # held by the cache until the rerun, whatever else the rerun of block 1 changes
    assert curve[mid] - other[mid] == trace.sizes[m] - sum(trace.sizes[t] for t in r.tensors)


def test_selective_force_recompute_option(tiny):
    trace, info = tiny
    plan = make_plan("selective", trace, simple_hw(), budget=_tight(trace), force_recompute="attention.wq")
    ops = info["blocks"][0]["ops"]
    r = plan.recomputes[0]
    # wq recomputed and not counted: wo is now mm #1 (saved), w2 mm #2 (recomputed)
    assert ops["q"] in r.ops and ops["w2"] in r.ops and ops["o"] not in r.ops


# -- offloading peers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt():
    hw = load_hardware("rtx4090-24g")
    trace = gpt_trace(hw, layers=6, d_model=1024, batch=8, seq=512)

    def scope(o):
        if o.phase != "forward":
            return None
        m = re.match(r"h(\d+)\.", o.name)
        return f"transformer.h.{m.group(1)}" if m else ("lm_head" if "lm_head" in o.name else "transformer.wte")

    ops = tuple(dataclasses.replace(o, scope=scope(o)) for o in trace.ops)
    return dataclasses.replace(trace, ops=ops), hw


def test_save_on_cpu_offloads_every_saved_activation_fetched_at_unpack(gpt):
    trace, hw = gpt
    budget = int(0.9 * trace.peak_live_bytes)
    plan = make_plan("save_on_cpu", trace, hw, budget=budget)
    evicted = {m.tensor for m in plan.moves if m.kind == "evict"}
    from tierflow.policies.flashneuron import forward_to_backward_gaps

    assert evicted == {g.tensor for g in forward_to_backward_gaps(trace)}
    for m in plan.moves:
        if m.kind == "prefetch":  # issued when the op before the one that needs it ends
            assert m.after_op == m.needed_by - 1 and m.tier == "host"
    assert plan.meta["uncharged_pack_s"] > 0
    _check(plan, trace, hw, budget)


def test_offload_activations_follows_torchtune(gpt):
    trace, hw = gpt
    budget = int(0.9 * trace.peak_live_bytes)
    soc = make_plan("save_on_cpu", trace, hw, budget=budget)
    plan = make_plan("offload_activations", trace, hw, budget=budget)
    evicts = sorted((m.after_op, m.tensor) for m in plan.moves if m.kind == "evict")
    soc_evicts = sorted((m.after_op, m.tensor) for m in soc.moves if m.kind == "evict")
    # the head's input is not offloaded (NoOpManager), nor the last 5 packed (stash)
    head_in = {t for i, o in enumerate(trace.ops) if o.scope == "lm_head" for t in o.inputs}
    assert not head_in & {t for _, t in evicts}
    rest = [e for e in soc_evicts if e[1] not in head_in]
    assert evicts == rest[:-5] and plan.meta["stashed"] == 5
    for m in plan.moves:  # one op of CPU run-ahead
        if m.kind == "prefetch":
            assert m.after_op == max(m.needed_by - 2, next(e for e, t in evicts if t == m.tensor) + 1)
    assert plan.meta["uncharged_pack_s"] == 0
    _check(plan, trace, hw, budget)


def test_offload_activations_options(gpt):
    trace, hw = gpt
    budget = int(0.9 * trace.peak_live_bytes)
    big = max(int(trace.sizes[m.tensor]) for m in make_plan("offload_activations", trace, hw, budget=budget).moves)
    only_big = make_plan("offload_activations", trace, hw, min_offload_size=big, max_fwd_stash_size=1, always=True)
    assert only_big.moves and all(trace.sizes[m.tensor] >= big for m in only_big.moves)
    single = make_plan("offload_activations", trace, hw, budget=budget, use_streams=False)
    soc = make_plan("save_on_cpu", trace, hw, budget=budget, always=True)
    head_in = {t for o in trace.ops if o.scope == "lm_head" for t in o.inputs}
    # one stream: save_on_cpu's schedule, less the head; the pack copies are on compute
    assert set(single.moves) == {m for m in soc.moves if m.tensor not in head_in}
    assert single.meta["uncharged_pack_s"] > 0
    with pytest.raises(PolicyError, match="max_fwd_stash_size"):
        make_plan("offload_activations", trace, hw, max_fwd_stash_size=0)


# -- all four --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PEERS)
def test_nothing_to_do_when_the_trace_fits(tiny, name):
    trace, _ = tiny
    hw = simple_hw()
    plan = make_plan(name, trace, hw)
    assert not plan.moves and not plan.recomputes
    assert simulate(trace, hw, plan).time_s == pytest.approx(trace.ideal_s)
    forced = make_plan(name, trace, hw, always=True)
    assert forced.moves or forced.recomputes


@pytest.mark.parametrize("name", PEERS)
def test_options_are_declared(name):
    declared = {o.name for o in policy_options(name)}
    assert "always" in declared


@pytest.mark.parametrize("name", PEERS)
def test_refuses_with_bytes_below_what_its_method_reaches(gpt, name):
    trace, hw = gpt
    with pytest.raises(PlanError, match=rf"{name}: no plan fits in .* \(\d+ bytes\)"):
        make_plan(name, trace, hw, budget=int(0.6 * trace.peak_live_bytes))


@pytest.mark.parametrize("name", PEERS)
def test_deterministic(tiny, name):
    trace, _ = tiny
    a = make_plan(name, trace, simple_hw(), budget=_tight(trace))
    b = make_plan(name, trace, simple_hw(), budget=_tight(trace))
    assert a == b


# -- property: any plan a peer returns is valid and within its budget -------------------------------


@settings(max_examples=25)
@given(
    layers=st.integers(1, 4),
    act_mb=st.integers(1, 30),
    dropout=st.booleans(),
    batchnorm=st.booleans(),
    share=st.floats(0.3, 1.0),
    name=st.sampled_from(PEERS),
)
def test_every_plan_is_valid_or_refused_with_bytes(layers, act_mb, dropout, batchnorm, share, name):
    trace, _ = transformer(layers, act_mb * MB, dropout, batchnorm)
    hw = simple_hw()
    budget = min(max(int(share * trace.peak_live_bytes), int(trace.working_set_bytes.max())), 2**30)
    try:
        plan = make_plan(name, trace, hw, budget=budget, always=True)
    except PlanError as e:
        assert re.search(r"\(\d+ bytes\)", str(e))
        return
    if plan.recomputes:
        assert planned_device_bytes(trace, plan.recomputes).max() <= budget
    _check(plan, trace, hw, budget)
