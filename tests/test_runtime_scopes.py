"""The runtime's own trace (tierflow.runtime.opfacts) carries what tierflow.capture's
does: each op's module scope, its rng and pure flags; so recompute policies run through
``offload`` checkpoint the model's blocks, and the scope tracker's module hooks live
only while an iteration is profiled."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module

from helpers import assert_training_equal
from tierflow.capture import capture, zoo
from tierflow.policies._recompute import find_blocks
from tierflow.runtime import offload

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def _global_hooks() -> int:
    return len(nn_module._global_forward_pre_hooks) + len(nn_module._global_forward_hooks)


def _train(net, opt, batches, loss_fn, run=None, on_step=None):
    """The user's loop; ``run``: an entered offload. Losses, per-step gradients."""
    losses, grads = [], []
    for k, (x, y) in enumerate(batches):
        loss = loss_fn(net(x), y)
        if on_step is not None:
            on_step(k)
        loss.backward()
        with (run.untracked() if run is not None else torch.no_grad()):
            grads.append([p.grad.clone() for p in net.parameters()])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def _zoo_run(name, steps, budget=None, policy=None, on_step=None, **kw):
    """Zoo model ``name`` trained ``steps`` steps on one batch, plainly or under offload:
    ``(model, optimizer, losses, grads, run)``."""
    m = zoo.build(name, device="cpu", seed=0)
    opt = torch.optim.AdamW(m.model.parameters(), lr=1e-3)
    batch = m.make_batch(zoo.spec(name).batch, None)
    torch.manual_seed(0)
    if policy is None:
        return (m.model, opt, *_train(m.model, opt, [batch] * steps, m.loss_fn, on_step=on_step), None)
    with offload(m.model, opt, budget=budget, policy=policy, **kw) as run:
        losses, grads = _train(m.model, opt, [batch] * steps, m.loss_fn, run, on_step)
    return m.model, opt, losses, grads, run


@pytest.fixture(scope="module")
def gpt_traces():
    """gpt-tiny's trace as the runtime profiled it, and as tierflow.capture records it."""
    run = _zoo_run("gpt-tiny", 3, policy="lru")[-1]
    m = zoo.build("gpt-tiny", device="cpu", seed=0)
    x, y = m.make_batch(zoo.spec("gpt-tiny").batch, None)
    captured = capture(m.model, x, m.loss_fn, target=y, optimizer="adamw")
    return run.trace, captured


def test_runtime_trace_has_captures_forward_scopes(gpt_traces):
    runtime, captured = gpt_traces
    fwd = {o.scope for o in runtime.ops if o.phase == "forward"}
    assert fwd == {o.scope for o in captured.ops if o.phase == "forward"}
    assert {"h.0", "h.1.attn.qkv", "lm_head"} <= fwd


def test_runtime_ops_have_captures_scopes_op_by_op(gpt_traces):
    """Forward and backward, op by op (the runtime also records ``aten::detach``, which
    capture leaves out; capture's iteration goes on to ``zero_grad``)."""
    runtime, captured = gpt_traces
    ops = [o for o in runtime.ops if o.name != "aten::detach"]
    n = next(i for i, o in enumerate(captured.ops) if o.phase == "optimizer")
    assert [o.name for o in ops[:n]] == [o.name for o in captured.ops[:n]]
    assert [o.scope for o in ops[:n]] == [o.scope for o in captured.ops[:n]]
    assert any(o.phase == "backward" and o.scope == "h.1.mlp.fc" for o in ops[:n])


def test_find_blocks_on_the_runtime_trace_uses_scopes(gpt_traces):
    blocks = find_blocks(gpt_traces[0])
    assert blocks.found_by == "scopes"
    assert [b.name for b in blocks.blocks] == ["h.0", "h.1"]


class DropNorm(nn.Module):
    """Two blocks of Linear, training-mode BatchNorm, ReLU and dropout (p > 0)."""

    def __init__(self, width=32):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.3)) for _ in range(2))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _dropnorm_traces():
    torch.manual_seed(0)
    net = DropNorm()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    with offload(net, opt, policy="lru") as run:
        _train(net, opt, [(x, y)] * 3, nn.functional.cross_entropy, run)
    torch.manual_seed(0)
    net2 = DropNorm()
    captured = capture(net2, x, nn.functional.cross_entropy, target=y, optimizer="adamw")
    return run.trace, captured


@pytest.fixture(scope="module")
def dropnorm_traces():
    return _dropnorm_traces()


def test_dropout_ops_are_flagged_rng(dropnorm_traces):
    runtime, captured = dropnorm_traces
    rng = [(o.name, o.scope) for o in runtime.ops if o.rng]
    assert rng == [(o.name, o.scope) for o in captured.ops if o.rng]
    assert [scope for _, scope in rng] == ["blocks.0.3", "blocks.1.3"]  # (the Dropout modules: a bernoulli_ each on CPU)


def test_an_op_writing_batchnorm_running_stats_is_impure_as_in_capture(dropnorm_traces):
    runtime, captured = dropnorm_traces
    stats = {t.id for t in runtime.tensors if t.key and t.key.startswith("buffer:") and "running_" in t.key}
    assert len(stats) == 4
    bn = [o for o in runtime.ops if o.phase == "forward" and "batch_norm" in o.name]
    assert bn and all(not o.pure for o in bn)
    assert [(o.name, o.scope, o.pure) for o in bn] == [
        (o.name, o.scope, o.pure) for o in captured.ops if o.phase == "forward" and "batch_norm" in o.name]
    # every other forward op is pure, in both traces (num_batches_tracked's add_ aside)
    impure = [(o.name, o.scope) for o in runtime.ops if o.phase == "forward" and not o.pure]
    assert impure == [(o.name, o.scope) for o in captured.ops if o.phase == "forward" and not o.pure]


def test_checkpoint_through_offload_is_bitwise_and_recomputes_the_blocks():
    steps = 8
    ref = _zoo_run("gpt-tiny", steps)
    got = _zoo_run("gpt-tiny", steps, budget="90%", policy="checkpoint")
    assert_training_equal(got, ref)
    run = got[-1]
    plan, trace, s = run.plan, run.trace, run.stats
    assert plan.policy == "checkpoint" and plan.meta["blocks_from"] == "scopes", s.plan_error
    assert s.recomputed_ops > 0 and s.stale_plans == 0 and s.peak_device_bytes <= s.budget_bytes
    regions = []
    for r in plan.recomputes:
        blocks = {".".join(trace.ops[i].scope.split(".")[:2]) for i in r.ops}
        assert len(blocks) == 1  # one chain, one block
        regions += blocks
    assert regions == ["h.0", "h.1"]


def test_scope_hooks_live_only_while_an_iteration_is_profiled():
    before = _global_hooks()
    seen = []
    got = _zoo_run("gpt-tiny", 4, policy="lru", on_step=lambda k: seen.append(_global_hooks() - before))
    # steps 0 (Adam's warm-up) and 1 are profiled; 2 and 3 follow the plan. A profiled
    # step has two pairs (pre, post) of global module hooks: the scope tracker's and
    # the tick log's (runtime/segments.py)
    assert got[-1].stats.profiled_steps == 2 and seen == [4, 4, 0, 0]
    assert _global_hooks() == before


def test_scope_hooks_are_removed_after_an_error_in_a_profiled_iteration():
    before = _global_hooks()

    def fail(k):
        assert _global_hooks() > before  # (the hooks are there when it fails)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _zoo_run("gpt-tiny", 2, policy="lru", on_step=fail)
    assert _global_hooks() == before
