"""capture() records what recompute needs: each op's module scope (forward and
backward), whether it draws random numbers, whether it is safe to re-run."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tierflow.capture import capture, zoo
from tierflow.capture.opflags import draws_random, has_side_effects, writes
from tierflow.capture.scope import ScopeTracker
from tierflow.trace import Trace, load_trace


class Block(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.drop = nn.Dropout(0.25)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x):
        return x + self.bn(self.drop(torch.relu_(self.fc(x))))


class Net(nn.Module):
    def __init__(self, n: int = 2, d: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _loss(out):
    return out.pow(2).mean()


def _capture(device: str, **kw) -> Trace:
    torch.manual_seed(0)
    return capture(Net(), torch.randn(4, 8), _loss, device=device, workspace=False, **kw)


@pytest.fixture(scope="module", params=["cpu", "meta"])
def trace(request) -> Trace:
    return _capture(request.param)


def _ops(trace: Trace, name: str, phase: str):
    return [o for o in trace.ops if o.name == name and o.phase == phase]


def test_forward_ops_carry_the_innermost_module_path(trace):
    assert [o.scope for o in _ops(trace, "aten::addmm", "forward")] == ["blocks.0.fc", "blocks.1.fc", "head"]
    # a functional call in a block's forward belongs to the block itself
    assert [o.scope for o in _ops(trace, "aten::relu_", "forward")] == ["blocks.0", "blocks.1"]
    assert [o.scope for o in _ops(trace, "aten::native_batch_norm", "forward")] == ["blocks.0.bn", "blocks.1.bn"]


def test_every_forward_op_of_a_block_is_scoped_under_it(trace):
    fwd = [o for o in trace.ops if o.phase == "forward"]
    scoped = [o.scope for o in fwd if o.scope is not None and o.scope.startswith("blocks.")]
    # the blocks run in order, each op under its own block
    firsts = [s.split(".")[1] for s in scoped]
    assert firsts == sorted(firsts) and set(firsts) == {"0", "1"}
    # the loss runs outside the model: no scope
    assert [o.scope for o in fwd[-2:]] == [None, None]
    assert [o.name for o in fwd[-2:]] == ["aten::pow", "aten::mean"]


def test_backward_ops_take_the_scope_of_the_forward_op_they_differentiate(trace):
    assert [o.scope for o in _ops(trace, "aten::native_batch_norm_backward", "backward")] == ["blocks.1.bn", "blocks.0.bn"]
    assert [o.scope for o in _ops(trace, "aten::threshold_backward", "backward")] == ["blocks.1", "blocks.0"]
    mm = [o.scope for o in _ops(trace, "aten::mm", "backward")]
    assert mm[:2] == ["head", "head"] and mm[-1] == "blocks.0.fc" and "blocks.1.fc" in mm
    # the loss's backward and the seed gradient ran under no module
    assert trace.ops[[o.phase for o in trace.ops].index("backward")].scope is None


def test_optimizer_ops_have_no_scope(trace):
    assert all(o.scope is None for o in trace.ops if o.phase == "optimizer")


def test_dropout_draws_random_numbers_and_nothing_else_does(trace):
    rng = [o for o in trace.ops if o.rng]
    assert [o.name for o in rng] == ["aten::bernoulli_", "aten::bernoulli_"]
    assert [o.scope for o in rng] == ["blocks.0.drop", "blocks.1.drop"]


def test_training_batch_norm_and_its_counter_are_not_pure(trace):
    impure_fwd = [(o.name, o.scope) for o in trace.ops if o.phase == "forward" and not o.pure]
    # num_batches_tracked += 1, then the running statistics' update, per BatchNorm
    assert impure_fwd == [("aten::add_", "blocks.0.bn"), ("aten::native_batch_norm", "blocks.0.bn"),
                          ("aten::add_", "blocks.1.bn"), ("aten::native_batch_norm", "blocks.1.bn")]


def test_in_place_writes_to_tensors_the_iteration_made_stay_pure(trace):
    # dropout's bernoulli_ fills its own empty_like; relu_ rewrites the addmm's result
    for name in ("aten::bernoulli_", "aten::relu_", "aten::div_"):
        assert all(o.pure for o in _ops(trace, name, "forward")), name


def test_optimizer_updates_are_not_pure(trace):
    opt = [o for o in trace.ops if o.phase == "optimizer"]
    assert all(not o.pure for o in opt if o.name in ("aten::lerp_", "aten::addcdiv_", "aten::addcmul_"))
    assert all(o.pure for o in trace.ops if o.phase == "backward")


def test_gradient_accumulation_into_grad_is_not_pure():
    tr = capture(Net(), torch.randn(4, 8), _loss, device="cpu", workspace=False, accumulation_steps=2)
    bwd_impure = [o for o in tr.ops if o.phase == "backward" and not o.pure]
    assert bwd_impure and all(o.name == "aten::add_" for o in bwd_impure)
    writes_grad = {t for o in bwd_impure for t in o.outputs if tr.tensors[t].kind == "gradient"}
    assert len(writes_grad) == len(bwd_impure)
    # AccumulateGrad has no forward op: the scope is the module owning the parameter
    assert {o.scope for o in bwd_impure} <= {"blocks.0.fc", "blocks.1.fc", "blocks.0.bn", "blocks.1.bn", "head"}


def test_fields_survive_save_and_load(tmp_path, trace):
    again = load_trace(trace.save(tmp_path / "t.json"))
    assert again.ops == trace.ops


def test_checkpointed_module_recomputed_in_backward_keeps_its_scope():
    class Ckpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    net = nn.Sequential(nn.Linear(8, 8), Ckpt())
    tr = capture(net, torch.randn(4, 8), _loss, device="cpu", workspace=False)
    # backward re-runs the first Linear and the GELU to get the second Linear's input
    assert [o.scope for o in _ops(tr, "aten::addmm", "backward")] == ["1.inner.0"]
    assert [o.scope for o in _ops(tr, "aten::gelu", "backward")] == ["1.inner.1"]


def test_tracker_leaves_no_hooks_behind():
    net = nn.Linear(2, 2)
    with ScopeTracker(net) as tr:
        net(torch.randn(1, 2))
        assert tr._stack == []
    pre = torch.nn.modules.module._global_forward_pre_hooks
    post = torch.nn.modules.module._global_forward_hooks
    assert not pre and not post


def test_seeded_attention_draws_only_with_dropout():
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.randn(1, 1, 4, 8)
    assert draws_random(sdpa, (q, q, q), {"dropout_p": 0.1})
    assert not draws_random(sdpa, (q, q, q), {})  # dropout_p defaults to 0
    drop = torch.ops.aten.native_dropout.default
    assert draws_random(drop, (q, 0.1, True), {})
    assert not draws_random(drop, (q, 0.1, False), {})


def test_batch_norm_writes_running_stats_only_when_training():
    bn = torch.ops.aten.native_batch_norm.default
    x, w, b, rm, rv = torch.randn(4, 3), torch.ones(3), torch.zeros(3), torch.zeros(3), torch.ones(3)
    assert [id(t) for t in writes(bn, (x, w, b, rm, rv, True, 0.1, 1e-5), {})] == [id(rm), id(rv)]
    assert writes(bn, (x, w, b, rm, rv, False, 0.1, 1e-5), {}) == []


def test_collectives_have_side_effects():
    assert has_side_effects(torch.ops.c10d.allreduce_.default)
    assert not has_side_effects(torch.ops.aten.mm.default)


@pytest.mark.parametrize("name, blocks", [("gpt-tiny", "h"), ("llama-tiny", "layers"), ("bert-tiny", "layers"),
                                          ("vit-tiny", "blocks")])
def test_zoo_transformer_block_ops_are_scoped_to_their_block(name, blocks):
    from tierflow.capture import zoo_trace

    tr = zoo_trace(name, device="meta")
    fwd = [o for o in tr.ops if o.phase == "forward"]
    inside = [i for i, o in enumerate(fwd) if (o.scope or "").startswith(blocks + ".")]
    # from the first block op to the last, every forward op runs under some block,
    # and the blocks follow each other in order
    span = fwd[inside[0]:inside[-1] + 1]
    assert all((o.scope or "").startswith(blocks + ".") for o in span)
    order = [int(o.scope.split(".")[1]) for o in span]
    assert order == sorted(order) and len(set(order)) == len(zoo.build(name, device="meta").model.get_submodule(blocks))
