"""The roofline cost model: FLOP formulas against brute-force counts, bytes, roofline."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from tierflow.capture import cost
from tierflow.hardware import Compute, load_hardware


@given(m=st.integers(1, 16), k=st.integers(1, 16), n=st.integers(1, 16), b=st.integers(1, 4))
def test_matmul_flops_count_every_multiply_add(m, k, n, b):
    a, w = torch.ones(m, k), torch.ones(k, n)
    # each output element is a k-term dot product: k multiplies and k adds
    assert cost.matmul_flops("aten::mm", (a, w), a @ w) == 2 * (a @ w).numel() * k
    bias = torch.ones(m, n)
    assert cost.matmul_flops("aten::addmm", (bias, a, w), bias) == 2 * m * k * n + m * n
    ab, wb = torch.ones(b, m, k), torch.ones(b, k, n)
    assert cost.matmul_flops("aten::bmm", (ab, wb), ab @ wb) == 2 * b * m * k * n
    assert cost.matmul_flops("aten::relu", (a,), a) is None


@given(
    n=st.integers(1, 2), cin=st.integers(1, 4), cout=st.integers(1, 4), hw=st.integers(3, 9),
    k=st.sampled_from([1, 3]), stride=st.integers(1, 2), groups=st.sampled_from([1, 2]),
)
def test_conv_flops_match_an_explicit_unfold_count(n, cin, cout, hw, k, stride, groups):
    cin, cout = cin * groups, cout * groups
    x, w = torch.randn(n, cin, hw, hw), torch.randn(cout, cin // groups, k, k)
    out = F.conv2d(x, w, stride=stride, padding=k // 2, groups=groups)
    # unfold: every output pixel of every output channel is a dot product over
    # (cin/groups)*k*k inputs: that many multiplies and adds
    cols = F.unfold(x, k, padding=k // 2, stride=stride)  # (n, cin*k*k, L)
    macs = cols.shape[2] * n * cout * (cin // groups) * k * k
    assert cols.shape[2] == out.shape[2] * out.shape[3]
    assert cost.conv_flops(x.shape, w.shape, out.shape) == 2 * macs


def test_conv_and_attention_through_op_time():
    hw = Compute(peak_flops_fp32=1e12, peak_flops_bf16=4e12, mem_bandwidth=1e15)
    x, w = torch.empty(8, 64, 56, 56, device="meta"), torch.empty(64, 64, 3, 3, device="meta")
    out = torch.empty(8, 64, 56, 56, device="meta")
    args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    t = cost.op_time(torch.ops.aten.convolution.default, args, {}, out, hw, overhead_s=0)
    assert t == pytest.approx(2 * 8 * 64 * 56 * 56 * 64 * 9 / 1e12)
    q = torch.empty(2, 4, 128, 32, device="meta", dtype=torch.bfloat16)
    o = torch.empty_like(q)
    f = cost.op_flops("aten::_scaled_dot_product_flash_attention", (q, q, q), {}, (o,), {"is_causal": False})
    assert f == 4 * 2 * 4 * 128 * 128 * 32
    fc = cost.op_flops("aten::_scaled_dot_product_flash_attention", (q, q, q), {}, (o,), {"is_causal": True})
    assert fc == f // 2
    assert cost.compute_dtype((q,), {}) == "bf16"


def test_elementwise_is_memory_bound_and_views_are_free():
    hw = load_hardware("h100-80g-pcie5-nvme").compute
    x = torch.empty(1 << 20, device="meta")
    t = cost.op_time(torch.ops.aten.add.Tensor, (x, x), {}, x, hw, overhead_s=0)
    assert t == pytest.approx(3 * 4 * (1 << 20) / hw.mem_bandwidth)
    assert cost.op_time(torch.ops.aten.view.default, (x, [-1]), {}, x, hw) == 0.0
    assert cost.op_time(torch.ops.aten.detach.default, (x,), {}, x, hw) == 0.0
    # foreach optimizer ops: one flop per element of every list entry
    xs = [torch.empty(10, device="meta"), torch.empty(30, device="meta")]
    assert cost.op_flops("aten::_foreach_add_", (xs, xs), {}, None) == 40


def test_roofline_takes_the_slower_of_compute_and_memory():
    c = Compute(peak_flops_fp32=1e12, peak_flops_bf16=8e12, mem_bandwidth=1e12)
    assert cost.roofline(2e12, 1e9, c, "fp32") == pytest.approx(2.0)
    assert cost.roofline(2e12, 1e9, c, "bf16") == pytest.approx(0.25)
    assert cost.roofline(1e9, 3e12, c, "fp32") == pytest.approx(3.0)
    assert cost.roofline(0, 0, c, "fp32", overhead_s=5e-6) == pytest.approx(5e-6)
    with pytest.raises(ValueError):
        cost.roofline(1, 1, c, "int8")
    with pytest.raises(ValueError):
        cost.roofline(-1, 1, c)
