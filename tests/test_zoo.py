"""The built-in models: published parameter counts, no allocation on meta, tiny variants
that train on a CPU quickly."""

from __future__ import annotations

import time

import pytest
import torch

from tierflow.capture import zoo
from tierflow.errors import TraceError

PUBLISHED = {
    "gpt2-small": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200, "llama-7b": 6_738_415_616, "llama-1b": 1_235_814_400,
    "bert-base": 109_514_298, "bert-large": 335_174_458, "vit-b16": 86_567_656, "vit-l16": 304_326_632,
    "resnet50": 25_557_032, "resnet152": 60_192_808,
}
TINY = [n for n in zoo.names() if n.endswith("-tiny")]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_published_figures(name):
    m = zoo.build(name, device="meta")
    assert zoo.param_count(m.model) == PUBLISHED[name] == zoo.spec(name).params
    assert all(p.is_meta for p in m.model.parameters())


def test_gpt2_ties_its_embeddings_and_llama_7b_does_not():
    g = zoo.build("gpt2-medium", device="meta").model
    assert g.lm_head.weight is g.wte.weight
    ll = zoo.build("llama-7b", device="meta").model
    assert ll.lm_head.weight is not ll.embed_tokens.weight
    assert zoo.param_count(ll) - zoo.param_count(ll.layers) == 2 * 32000 * 4096 + 4096


def test_building_7b_on_meta_allocates_nothing():
    import tracemalloc

    tracemalloc.start()
    t0 = time.perf_counter()
    m = zoo.build("llama-7b", device="meta")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert time.perf_counter() - t0 < 10
    assert peak < 64 << 20  # python objects only, vs 27 GB of fp32 weights
    x, y = m.make_batch(1, 16)
    assert x.is_meta and y.is_meta and x.shape == (1, 16)


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_train_on_cpu_quickly(name):
    m = zoo.build(name, device="cpu", seed=1)
    x, y = m.make_batch(zoo.spec(name).batch)
    opt = torch.optim.AdamW(m.model.parameters(), lr=3e-3)
    losses = []
    t0 = time.perf_counter()
    for _ in range(5):
        loss = m.loss_fn(m.model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    per_step = (time.perf_counter() - t0) / 5
    assert per_step < 1.0
    assert losses[-1] < losses[0]  # it learns the fixed batch


def test_build_is_deterministic_and_dtype_applies():
    a, b = zoo.build("gpt-tiny", seed=3), zoo.build("gpt-tiny", seed=3)
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    xa, _ = a.make_batch(2, 8)
    xb, _ = b.make_batch(2, 8)
    assert torch.equal(xa, xb)
    h = zoo.build("vit-tiny", dtype="bf16")
    assert all(p.dtype == torch.bfloat16 for p in h.model.parameters())
    assert h.make_batch(2)[0].dtype == torch.bfloat16


def test_bad_names_and_sizes_raise_trace_errors():
    with pytest.raises(TraceError, match="unknown zoo model 'gpt5'"):
        zoo.build("gpt5")
    with pytest.raises(TraceError, match="dtype"):
        zoo.build("gpt-tiny", dtype="fp8")
    m = zoo.build("gpt-tiny")
    with pytest.raises(TraceError, match="seq"):
        m.make_batch(2, 4096)
    with pytest.raises(TraceError, match="not a sequence model"):
        zoo.build("mlp-tiny").make_batch(2, 16)
