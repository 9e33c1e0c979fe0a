"""benchmarks/peak_breakdown.py: the live set at a profiled step's allocator peak."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from helpers import load_benchmark

pb = load_benchmark("peak_breakdown")


def _profiled(step) -> object:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return prof


def test_eager_blocks_sum_to_the_peak_and_name_the_largest() -> None:
    def step() -> None:
        a = torch.ones(256, 256)  # 256 KiB, live at the peak
        b = torch.ones(512, 512)  # 1 MiB, live at the peak
        c = a.sum() + b.sum()
        del a, b, c
        torch.ones(64, 64)  # after the peak: not in it

    bd = pb.peak_breakdown(_profiled(step))
    assert bd.peak_bytes == sum(b.bytes for b in bd.blocks)
    sizes = [b.bytes for b in bd.blocks]
    assert 1 << 20 in sizes and 1 << 18 in sizes and 64 * 64 * 4 not in sizes
    assert bd.region == "eager"
    assert {bd.category(b) for b in bd.blocks} == {"working"}  # made where the peak is


def test_compiled_backward_peak_names_saved_and_working_blocks() -> None:
    torch._dynamo.reset()
    lin = torch.nn.Linear(256, 256)
    f = torch.compile(lambda x: torch.relu(lin(x)).pow(2).sum(), backend="aot_eager")
    x = torch.randn(512, 256)
    f(x).backward()

    bd = pb.peak_breakdown(_profiled(lambda: f(x).backward()))
    cats = {bd.category(b) for b in bd.blocks}
    text = pb.format_breakdown(bd)
    # the peak is in graph 0's backward while its forward's saved tensors are live
    assert bd.region == "bwd 0", text
    assert "saved" in cats and "working" in cats, text
    saved = sum(b.bytes for b in bd.blocks if bd.category(b) == "saved")
    assert saved >= 512 * 256 * 4, text  # at least the relu output (or its mask's source)
    assert "saved" in text and "MiB" in text


def test_the_optimizers_allocations_are_labelled_optimizer_and_count_as_eager() -> None:
    lin = torch.nn.Linear(512, 512, bias=False)  # 1 MiB of weight
    opt = torch.optim.Adam(lin.parameters(), foreach=False)

    def step() -> None:
        lin(torch.randn(4, 512)).sum().backward()
        opt.step()  # the first step makes two 1 MiB moments: the peak

    bd = pb.peak_breakdown(_profiled(step))
    text = pb.format_breakdown(bd)
    assert bd.region == "optimizer", text
    made = [b for b in bd.blocks if b.made_in == "optimizer" and b.bytes == 1 << 20]
    assert len(made) >= 2 and {bd.category(b) for b in made} == {"working"}, text  # (moments, temporaries)
    eager = pb.Block(4, "optimizer", False, "x", 0)
    assert pb.Breakdown(8, "bwd 0", "y", [eager]).category(eager) == "eager"
