"""The end of an ``offload`` block (runtime/homecoming.py): the state comes back to the
device where it fits, else to the host; in both cases nothing is lost and training goes
on after the block exactly as plain PyTorch's."""

from __future__ import annotations

import pytest
import torch

from tierflow.runtime import homecoming, offload, roundtrip_plan

STEPS, AFTER = 3, 2


class TiedLM(torch.nn.Module):
    """Embedding and output head sharing one weight (two tensors, one storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(97, 32)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        self.register_buffer("scale", torch.full((32,), 0.5))
        self.head = torch.nn.Linear(32, 97, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(self.emb(x)) * self.scale)


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 97, (16, 8), generator=g), torch.randint(0, 97, (16, 8), generator=g)


def _step(model, opt, i: int) -> float:
    x, y = _batch(i)
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # (gradients kept: they are state the block must give back too)
    return loss.item()


def _train(inside, tmp_path=None, before_exit=None):
    """``STEPS`` steps (under ``inside``, a context factory, or plain), then ``AFTER``
    plain steps after it; (model, optimizer, losses)."""
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    if inside is None:
        losses += [_step(model, opt, i) for i in range(STEPS)]
    else:
        with inside(model, opt) as run:
            losses += [_step(model, opt, i) for i in range(STEPS)]
            if before_exit is not None:
                before_exit(run)
    losses += [_step(model, opt, STEPS + i) for i in range(AFTER)]
    return model, opt, losses, (run if inside is not None else None)


def _everything_leaves(tmp_path):
    # every keyed tensor leaves the device in each of its gaps, host and SSD in turn: at
    # the end of the block parameters, gradients and Adam moments are away
    return lambda model, opt: offload(model, opt, policy=roundtrip_plan, ssd_dir=str(tmp_path))


def _assert_same(a, b) -> None:
    ma, oa, la, _ = a
    mb, ob, lb, _ = b
    assert la == lb
    for (na, pa), (_, pb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert torch.equal(pa, pb), na
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(pa.grad, pb.grad)
        for k, v in oa.state[pa].items():
            assert torch.equal(v, ob.state[pb][k]), k


def test_state_that_fits_comes_back_to_the_device(tmp_path):
    got = _train(_everything_leaves(tmp_path))
    assert got[3].stats.state_after_block == "device"
    assert sum(got[3].stats.moved_bytes.values()) > 0
    _assert_same(got, _train(None))


def test_state_that_does_not_fit_goes_to_the_host_whole_and_training_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(homecoming, "device_free_bytes", lambda device: 0)
    with pytest.warns(UserWarning, match="does not fit the device's free memory"):
        got = _train(_everything_leaves(tmp_path))
    model = got[0]
    assert got[3].stats.state_after_block == "host"
    assert model.head.weight is model.emb.weight  # (the tie is one parameter still)
    _assert_same(got, _train(None))  # (the steps after the block are plain PyTorch's on the new tensors)


def test_an_out_of_memory_while_coming_back_loses_nothing(tmp_path):
    def fail_once(run):
        real = run._mover.fetch  # (the back-end's fetch, which the homecoming calls)
        calls = []

        def fetch(e):
            calls.append(e)
            if len(calls) == 2:  # (one storage already back: the switch happens midway)
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return real(e)

        run._mover.fetch = fetch

    with pytest.warns(UserWarning, match="does not fit"):
        got = _train(_everything_leaves(tmp_path), before_exit=fail_once)
    assert got[3].stats.state_after_block == "host"
    _assert_same(got, _train(None))
