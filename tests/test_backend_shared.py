"""One back-end object per device for both front-ends (issue 30, point 3): an ``offload``
block and a compiled run share the device's :class:`~tierflow.runtime.backend.Backend`
and its ``Tiers``; the host pool lives while a front-end is attached, and no longer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tierflow
import tierflow.compiled as tc
from tierflow.runtime.backend import Backend, backend_for
from tierflow.runtime.errors import OffloadError


@pytest.fixture(autouse=True)
def _no_front_end_left_attached():
    """Each test starts from the process's cpu back-end with no front-end attached: a
    block an earlier test left open would hold its host pool (said here, not as a
    confusing failure below)."""
    assert backend_for("cpu").users == 0, "an earlier test left a front-end attached to the cpu back-end"
    yield
    assert backend_for("cpu").users == 0


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1))


def _step(fn, opt, x) -> float:
    loss = fn(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _batches(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(64, 32, generator=gen) for _ in range(n)]


def _eager_block_steps(steps: int = 3) -> tierflow.runtime.executor.Run:
    torch.manual_seed(7)
    other = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(other.parameters(), lr=1e-2)
    with tierflow.offload(other, opt, budget="80%") as run:
        for x in _batches(steps):
            _step(other, opt, x)
    return run


def test_an_offload_block_and_a_compiled_run_hold_one_backend_and_one_tiers():
    torch._dynamo.reset()
    crun = tc.compile(_mlp(0), budget="50%", backend="aot_eager")
    other = _mlp(7)
    with crun, tierflow.offload(other, torch.optim.SGD(other.parameters(), lr=1e-2)) as erun:
        assert erun.backend is crun.backend is backend_for("cpu")
        assert erun._tiers is crun.backend.tiers
        assert crun.backend.users == 2


def test_compiled_run_around_an_offload_block_stays_bitwise_and_gives_the_pool_back():
    xs = _batches(4)
    torch._dynamo.reset()
    ref_model = _mlp(0)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    ref_fn = torch.compile(ref_model, backend="aot_eager")
    ref = [_step(ref_fn, ref_opt, x) for x in xs]

    torch._dynamo.reset()
    model = _mlp(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    crun = tc.compile(model, budget="30%", backend="aot_eager", headroom=0.0, recompute=False)
    with crun:
        got = [_step(crun.model, opt, x) for x in xs[:2]]
        tiers = crun.backend.tiers
        _eager_block_steps()  # its exit must leave the compiled run's host buffers alone
        assert crun.backend.tiers is tiers and tiers.host.capacity > 0
        got += [_step(crun.model, opt, x) for x in xs[2:]]
    assert crun.stats.compiled_offloads > 0
    assert got == ref
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters(), strict=True))
    assert not crun.backend.is_open and tiers.host.chunk_sizes == []  # the pool given back
    assert crun.backend.stats.host_bytes == 0


def test_an_offload_block_alone_gives_the_pool_back_when_it_closes():
    run = _eager_block_steps()
    assert not run.backend.is_open and run._tiers.host.chunk_sizes == []


def test_a_compiled_run_entered_again_remakes_its_host_buffers_before_its_first_call():
    torch._dynamo.reset()
    model = _mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    crun = tc.compile(model, budget="30%", backend="aot_eager", headroom=0.0, recompute=False)
    with crun:
        _step(crun.model, opt, _batches(1)[0])
        held = crun.backend.stats.host_bytes
    assert held > 0 and not crun.backend.is_open
    with crun:
        assert crun.backend.stats.host_bytes == held  # before any call
        _step(crun.model, opt, _batches(1)[0])


def test_an_offload_block_asking_for_its_own_pool_after_a_compiled_run_opened_it_is_refused(tmp_path):
    torch._dynamo.reset()
    crun = tc.compile(_mlp(0), budget="50%", backend="aot_eager")
    other = _mlp(7)
    with crun, pytest.raises(OffloadError, match="host_bytes can be given only by the first front-end"):
        tierflow.offload(other, None, host_bytes="8MiB").__enter__()
    assert not crun.backend.is_open


def test_a_compiled_run_inside_a_sized_offload_block_takes_the_blocks_fixed_pool():
    other = _mlp(7)
    with tierflow.offload(other, None, host_bytes="8MiB") as erun:
        crun = tc.compile(_mlp(0), budget="50%", backend="aot_eager")
        with crun:
            assert crun.backend.tiers is erun._tiers and erun._tiers.host.fixed
        assert erun.backend.is_open  # the block still holds it
    assert not erun.backend.is_open


def test_detach_of_a_front_end_not_attached_is_an_error():
    with pytest.raises(ValueError, match="not attached"):
        Backend(torch.device("cpu")).detach(object())
