"""Training loops as people write them, inside one ``offload`` block: checkpoints
(torch.save/torch.load, mmap, safetensors), validation forwards, changing shapes.
Each is compared with the same loop in plain PyTorch, bitwise."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch import nn

from tierflow.plan import validate
from tierflow.runtime import offload, roundtrip_plan


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


def _roundtrip(trace, hw, budget):
    """Every movable tensor leaves the device in every gap, the one across the
    iteration's end included: between two steps every parameter and Adam moment is away."""
    plan = roundtrip_plan(trace, hw)
    validate(plan, trace, hw)
    return plan


class _Net(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.inp = nn.Linear(width, 32)
        self.mid = nn.Linear(32, 32)
        self.out = nn.Linear(32, width)

    def forward(self, x):
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x)))))


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(seed + 1)
    data = [torch.randn(4, 16, generator=g) for _ in range(6)]
    return net, opt, data


def _step(net, opt, x) -> float:
    loss = net(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _same_state(a: dict, b: dict) -> bool:
    fa, fb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(fa) == len(fb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(fa, fb))


def _save_load_loop(use: bool) -> tuple[list[float], dict, dict]:
    """Save model and optimizer state after step 2, train on, load it back, train on."""
    net, opt, data = _setup()
    buf = io.BytesIO()
    losses = []
    run = offload(net, opt, policy=_roundtrip) if use else None
    if run is not None:
        run.__enter__()
    try:
        for i, x in enumerate(data[:4]):
            losses.append(_step(net, opt, x))
            if i == 2:
                torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, buf)
        buf.seek(0)
        ck = torch.load(buf, weights_only=True)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        for x in data[4:]:
            losses.append(_step(net, opt, x))
    finally:
        if run is not None:
            run.__exit__(None, None, None)
    buf.seek(0)
    return losses, torch.load(buf, weights_only=True), {"model": net.state_dict(), "opt": opt.state_dict()}


def test_a_checkpoint_saved_between_steps_while_the_state_is_away_is_whole():
    """The roundtrip plan has every parameter and Adam moment away between two steps:
    torch.save reads storages directly, so before the state dict hooks it wrote them as
    empty records and torch.load failed ("Trying to resize storage that is not
    resizable"). Now the checkpoint, the losses and the final state equal plain PyTorch's."""
    plain = _save_load_loop(False)
    ours = _save_load_loop(True)
    assert ours[0] == plain[0]
    assert _same_state(ours[1], plain[1])
    assert _same_state(ours[2], plain[2])


def test_an_optimizer_state_dict_inside_the_block_leaves_the_state_where_the_plan_had_it():
    """``opt.state_dict()`` runs no op on the Adam moments (they stay away): its copies
    of them come from their tier and go back there, so the device holds no more than
    before, and the copies equal the moments."""
    net, opt, data = _setup()
    with offload(net, opt, policy=_roundtrip) as run:
        for x in data[:3]:
            _step(net, opt, x)
        before = run.device_bytes
        sd = opt.state_dict()
        assert run.device_bytes == before
        n_params = len(list(net.parameters()))
        # (step, exp_avg, exp_avg_sq: in CPU mode the step counter is on the device too)
        assert run._checkpoints.copies == 3 * n_params, run._checkpoints.copies
    assert _same_state(sd, opt.state_dict())


def _loaded_tensor_loop(make, use: bool) -> list[float]:
    """Train with an extra input made by ``make`` (a storage the runtime did not make)."""
    net, opt, data = _setup()
    extra = make()
    run = offload(net, opt, policy=_roundtrip) if use else None
    if run is not None:
        run.__enter__()
    try:
        losses = [_step(net, opt, x + extra) for x in data]
    finally:
        if run is not None:
            run.__exit__(None, None, None)
    assert extra.untyped_storage().nbytes() == 16 * 4  # never resized
    return losses


@pytest.mark.parametrize("make", [
    lambda: torch.from_numpy(np.linspace(0, 1, 16, dtype=np.float32)),
    lambda: torch.frombuffer(bytearray(np.linspace(0, 1, 16, dtype=np.float32).tobytes()), dtype=torch.float32),
], ids=["from_numpy", "frombuffer"])
def test_storages_the_runtime_did_not_make_are_never_resized(make):
    assert _loaded_tensor_loop(make, True) == _loaded_tensor_loop(make, False)


def _resume_inside(use: bool, tmp_path, how: str) -> tuple[list[float], dict]:
    """Resume from a checkpoint file inside the block: the loaded optimizer state is
    the loader's storage (non-resizable); training goes on exactly."""
    net, opt, data = _setup()
    for x in data[:2]:
        _step(net, opt, x)
    path = tmp_path / f"ck-{how}"
    if how == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    else:
        torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, path)
    net2, opt2, _ = _setup(seed=5)
    run = offload(net2, opt2, policy=_roundtrip) if use else None
    if run is not None:
        run.__enter__()
    try:
        if how == "safetensors":
            from safetensors.torch import load_file

            net2.load_state_dict(load_file(str(path)))
        else:
            ck = torch.load(path, weights_only=True, mmap=how == "mmap")
            net2.load_state_dict(ck["model"])
            opt2.load_state_dict(ck["opt"])
        losses = [_step(net2, opt2, x) for x in data[2:]]
    finally:
        if run is not None:
            run.__exit__(None, None, None)
    return losses, {"model": net2.state_dict(), "opt": opt2.state_dict()}


@pytest.mark.parametrize("how", ["load", "mmap", "safetensors"])
def test_resuming_from_a_file_inside_the_block_is_exact(how, tmp_path):
    if how == "safetensors":
        pytest.importorskip("safetensors", reason="safetensors is not installed")
    plain = _resume_inside(False, tmp_path / "a", how) if (tmp_path / "a").mkdir() is None else None
    ours = _resume_inside(True, tmp_path / "b", how) if (tmp_path / "b").mkdir() is None else None
    assert ours[0] == plain[0]
    assert _same_state(ours[1], plain[1])
