"""Synthetic traces carry the fields recompute policies read: scopes, rng, pure."""

from __future__ import annotations

import re

import pytest

from tierflow.hardware import load_hardware
from tierflow.synthetic import gpt_trace, training_trace

HW = load_hardware("g10-a100")


def _trace(dropout: bool = False):
    return gpt_trace(HW, layers=3, d_model=256, batch=2, seq=128, dropout=dropout)


@pytest.mark.parametrize("dropout", [False, True])
def test_block_ops_are_scoped_attn_or_mlp_of_their_layer(dropout):
    tr = _trace(dropout)
    for o in tr.ops:
        m = re.match(r"h(\d+)\.(qkv|attn|proj|fc|out|mlp|attn)", o.name)
        if m:
            part = "attn" if m.group(2) in ("qkv", "attn", "proj") else "mlp"
            assert o.scope == f"blocks.{m.group(1)}.{part}", o.name
    assert [o.scope for o in tr.ops if o.name.startswith(("embedding", "lm_head"))] == ["wte", "lm_head", "lm_head", "wte"]


def test_backward_op_has_its_forward_ops_scope():
    tr = _trace()
    fwd = {o.name: o.scope for o in tr.ops if o.phase == "forward"}
    bwd = [o for o in tr.ops if o.phase == "backward" and o.name.startswith("h")]
    assert bwd and all(o.scope == fwd[o.name[: -len(".backward")]] for o in bwd)


def test_optimizer_updates_are_impure_and_unscoped():
    tr = _trace()
    opt = [o for o in tr.ops if o.phase == "optimizer"]
    assert opt and all(not o.pure and o.scope is None for o in opt)
    assert all(o.pure for o in tr.ops if o.phase != "optimizer")


def test_no_dropout_draws_no_random_numbers_by_default():
    tr = _trace()
    assert not any(o.rng for o in tr.ops)
    assert tr.name == "gpt-L3-d256-b2x128"


def test_dropout_ops_draw_random_numbers_and_save_a_mask_for_backward():
    plain, tr = _trace(), _trace(dropout=True)
    rng = [j for j, o in enumerate(tr.ops) if o.rng]
    assert [tr.ops[j].scope for j in rng] == [f"blocks.{i}.{p}" for i in range(3) for p in ("attn", "mlp")]
    assert all(tr.ops[j].phase == "forward" for j in rng)
    for j in rng:
        mask = tr.ops[j].outputs[1]
        users = tr.uses(mask).tolist()
        assert users[0] == j and tr.ops[users[-1]].name.endswith("dropout.backward")
        assert tr.ops[users[-1]].scope == tr.ops[j].scope
    # four more ops per layer (two dropouts, two backward), the rest unchanged
    assert tr.n_ops == plain.n_ops + 4 * 3
    assert tr.name.endswith("-dropout")


def test_training_trace_scopes_its_layers():
    tr = training_trace(2, [1] * 10, [1] * 8)
    assert [o.scope for o in tr.ops if o.name in ("fwd", "bwd")] == ["layers.0", "layers.1", "layers.1", "layers.0"]
    assert [o.pure for o in tr.ops if o.name == "step"] == [False, False]
