"""What lowers a compiled graph's floor: the plan past an op it cannot lower, and a
storage several saved views share (attention's q, k, v) offloaded once as its base.

Small models on ``aot_eager`` (the partitioner hook and the graph rewrite are the same
with inductor), bitwise against plain ``torch.compile``."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from compiled_fit import fit_compiled
from tierflow.compiled.plan import curve_with, plan_graph


class QKVAttention(nn.Module):
    """Causal self-attention blocks whose q, k and v are slices of one projection (as
    in GPT-2's ``c_attn``): the partitioner saves three non-dense views of one storage."""

    def __init__(self, d: int = 64, heads: int = 4, n: int = 3) -> None:
        super().__init__()
        self.d, self.heads = d, heads
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(n))
        self.out = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        for qkv, out in zip(self.qkv, self.out, strict=True):
            q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in qkv(x).split(d, dim=2))
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + out(y.transpose(1, 2).reshape(b, s, d))
        return x.pow(2).mean()


def _train(budget, steps: int = 2):
    gen = torch.Generator().manual_seed(1)
    return fit_compiled(QKVAttention, [torch.randn(4, 64, 64, generator=gen) for _ in range(steps)], budget)


def test_qkv_views_are_offloaded_once_as_their_storage_and_training_stays_bitwise():
    want = _train(None)
    got = _train("10%")
    assert got[0] == want[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    (rec,) = got[2].records
    groups: dict[str, list[str]] = {}
    for s in rec.facts.saved:
        if s.group:
            groups.setdefault(s.group, []).append(s.name)
    assert groups, "the partitioner saved no views of a shared storage"
    moved = [g for g, names in groups.items() if set(names) <= set(rec.offloaded)]
    assert moved
    # one slot per storage, moving the base's bytes (three slices of d each: 3x one view)
    owners = [n for n in rec.slot_bytes if n in rec.offloaded]
    assert len(owners) == len(moved)
    sizes = {s.name: s.bytes for s in rec.facts.saved}
    assert all(rec.slot_bytes[n] == 3 * sizes[n] for n in owners)
    assert got[2].stats.compiled_offloads > 0


def test_a_storage_group_is_planned_whole_or_not_at_all():
    rec = _train("10%", steps=1)[2].records[0]
    plan = plan_graph(rec.facts, target_bytes=0, min_bytes=0, allow_recompute=False)
    for s in rec.facts.saved:
        if s.group:
            members = {t.name for t in rec.facts.saved if t.group == s.group}
            assert members <= plan.offload or not members & plan.offload


def test_plan_lowers_the_rest_of_the_curve_past_an_op_it_cannot_lower():
    facts = _train("10%", steps=1)[2].records[0].facts
    target = int(0.7 * facts.peak_bytes)
    assert not plan_graph(facts, target, min_bytes=0, allow_recompute=False).unreachable
    # a spike at the forward's end that no saved tensor can pay for (a loss's working set)
    spike = facts.n_fwd - 1
    curve = facts.curve.copy()
    curve[spike] += 10 * facts.peak_bytes
    spiked = dataclasses.replace(facts, curve=curve)
    plan = plan_graph(spiked, target, min_bytes=0, allow_recompute=False)
    assert plan.unreachable
    chosen = [s for s in facts.saved if s.name in plan.offload]
    rest = np.delete(curve_with(spiked, chosen), spike)
    assert int(rest.max()) <= target < int(np.delete(curve, spike).max())


class TiedLM(nn.Module):
    """A language model whose head is its embedding (as GPT-2's): the embedding's
    gradient is the sum of the head's product and the lookup's, made at the backward's
    end. It returns logits; the loss is computed outside the compiled graph, so the
    logits' gradient enters the backward graph as a tangent."""

    def __init__(self, vocab: int = 512, d: int = 32, n: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for b in self.blocks:
            h = h + b(h)
        # (W h^T)^T: the weight's gradient is then mm(tangent^T, h), made with the lookup's
        # gradient at the end (GPT-2's head reaches the same form through inductor's passes)
        return torch.mm(self.emb.weight, h.flatten(0, 1).t()).t()


def _fused_partitioner(monkeypatch) -> None:
    """Partition as for inductor (products sunk to the add they fuse into) on aot_eager,
    which runs the graph's order as it is: the sunk product then runs at the add."""
    from tierflow.compiled import hook

    orig = hook.PlanPartitioner.__init__

    def init(self, *a, **k):
        k["fused_addmm"] = True
        orig(self, *a, **k)

    monkeypatch.setattr(hook.PlanPartitioner, "__init__", init)


def _train_lm(budget, steps: int = 2):
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 512, (8, 64), generator=gen) for _ in range(steps)]
    return fit_compiled(TiedLM, batches, budget, loss=lambda y, ids: nn.functional.cross_entropy(y, ids.flatten()))


def test_the_logits_gradient_is_held_to_the_backward_graphs_end_on_the_trace(monkeypatch):
    """Torch's runtime keeps a backward graph's output gradients to its end, and a
    product sunk to its add (as inductor fuses it) does not change the result."""
    want = _train_lm(None)
    _fused_partitioner(monkeypatch)
    got = _train_lm("5%")
    assert got[0] == want[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    trace = got[2].records[0].facts.trace
    (tangent,) = [t for t in trace.tensors if t.name.startswith("tangents")]
    assert tangent.bytes == 8 * 64 * 512 * 4 and tangent.kind == "input" and not tangent.external
    assert tangent.held_until == trace.n_ops - 1


def test_sink_moves_the_fused_product_next_to_its_add_and_keeps_the_result():
    from torch.fx.experimental.proxy_tensor import make_fx

    from tierflow.compiled.hook import sink_fused_matmuls

    def f(a, b, c, x):
        m = torch.mm(a.t(), b)  # made early, used by the last op
        y = torch.relu(x) * 2 + x.sum()
        return y, c + m

    args = (torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 8), torch.randn(32, 32))
    gm = make_fx(f)(*args)
    want = gm(*args)
    assert sink_fused_matmuls(gm) == 1
    nodes = list(gm.graph.nodes)
    prod = next(n for n in nodes if n.target is torch.ops.aten.mm.default)
    assert prod.next.target is torch.ops.aten.add.Tensor
    assert prod.all_input_nodes[0].next is prod  # the transpose view moved along
    got = gm(*args)
    assert all(torch.equal(x, y) for x, y in zip(want, got, strict=True))
