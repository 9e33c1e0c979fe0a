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


# -- forwards outside training ---------------------------------------------------------


def _fixed_hw():
    """A fixed machine model: plans do not depend on measured op times (a loaded
    machine makes the same plan)."""
    from tierflow.synthetic import toy_hardware

    return toy_hardware(10.0, 64)


def _validation_loop(use: bool, *, every: int = 3, steps: int = 9, mode: str = "no_grad", eval_: bool = True,
                     follow: str = "ops") -> dict:
    net, opt, data = _setup()
    g = torch.Generator().manual_seed(9)
    data = [torch.randn(4, 16, generator=g) for _ in range(steps)]
    held_out = torch.randn(4, 16, generator=g)
    losses, val = [], []
    run = offload(net, opt, budget="50%", hardware=_fixed_hw(), follow=follow) if use else None
    if run is not None:
        run.__enter__()
    try:
        for i, x in enumerate(data):
            losses.append(_step(net, opt, x))
            if i % every == every - 1:
                if eval_:
                    net.eval()
                with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
                    val.append(net(held_out).pow(2).mean().item())
                net.train()
                sum(p.norm() for p in net.parameters()).item()  # (a metric between step and forward)
    finally:
        if run is not None:
            run.__exit__(None, None, None)
    return {"losses": losses, "val": val, "final": net.state_dict(), "stats": run.stats if run else None}


@pytest.mark.parametrize(("mode", "eval_"), [("no_grad", True), ("inference_mode", True), ("no_grad", False)])
def test_validation_forwards_leave_the_plan_in_force(mode, eval_):
    """A validation loss every 3 steps (and a metric over the parameters): bitwise equal
    to plain PyTorch; one plan; every step after the profile follows it from its first op."""
    plain = _validation_loop(False, mode=mode, eval_=eval_)
    ours = _validation_loop(True, mode=mode, eval_=eval_)
    assert ours["losses"] == plain["losses"] and ours["val"] == plain["val"]
    assert _same_state(ours["final"], plain["final"])
    s = ours["stats"]
    assert s.replans == 1 and s.plans_by_reason == {"first": 1}
    assert s.step_kinds == ["warmup", "profiled"] + ["planned"] * 7
    assert s.outside_forwards == 3 and s.departures == {}
    assert s.peak_device_bytes <= s.budget_bytes and s.peak_device_bytes_outside <= s.budget_bytes


def test_validation_forwards_leave_a_plan_followed_at_hooks_in_force():
    plain = _validation_loop(False, follow="hooks")
    ours = _validation_loop(True, follow="hooks")
    assert ours["losses"] == plain["losses"] and ours["val"] == plain["val"]
    s = ours["stats"]
    assert s.follow == "hooks", s.follow
    assert s.replans == 1 and s.step_kinds[2:] == ["planned"] * 7


def test_a_grad_mode_forward_between_steps_still_begins_an_iteration():
    """Outside means autograd records nothing: a forward with grad mode on is training."""
    from tierflow.runtime.outside import OutsideWork

    w = OutsideWork()
    assert not w.is_outside(in_iteration=False, untracked=False)
    with torch.no_grad():
        assert not w.is_outside(in_iteration=True, untracked=False)  # (accumulation's next forward)
        assert w.is_outside(in_iteration=False, untracked=False)
    assert w.is_outside(in_iteration=False, untracked=True)


# -- a plan per iteration signature ------------------------------------------------------


def _shapes_loop(use: bool, sizes: list[int], **options) -> dict:
    """One step per batch size in ``sizes`` (the batch's shape changes the iteration)."""
    net, opt, _ = _setup()
    g = torch.Generator().manual_seed(3)
    data = [torch.randn(n, 16, generator=g) for n in sizes]
    run = offload(net, opt, budget=40_000, hardware=_fixed_hw(), **options) if use else None
    if run is not None:
        run.__enter__()
    try:
        losses = [_step(net, opt, x) for x in data]
    finally:
        if run is not None:
            run.__exit__(None, None, None)
    return {"losses": losses, "final": net.state_dict(), "stats": run.stats if run else None}


def _same_training(ours: dict, plain: dict) -> bool:
    return ours["losses"] == plain["losses"] and _same_state(ours["final"], plain["final"])


def test_each_bucket_is_planned_once_and_followed_from_then_on():
    sizes = [4, 8, 12] * 4
    plain, ours = _shapes_loop(False, sizes), _shapes_loop(True, sizes)
    assert _same_training(ours, plain)
    s = ours["stats"]
    assert s.plans_by_reason == {"first": 1, "new signature": 2}
    assert s.step_kinds == ["warmup", "profiled", "profiled", "profiled"] + ["planned"] * 8
    assert s.signature_hits == 8 and s.signatures_cached == 3 and s.stale_plans == 0
    assert s.peak_device_bytes <= s.budget_bytes


def test_each_bucket_keeps_its_plan_followed_at_hooks():
    sizes = [4, 8, 12] * 3
    plain, ours = _shapes_loop(False, sizes), _shapes_loop(True, sizes, follow="hooks")
    assert _same_training(ours, plain)
    s = ours["stats"]
    assert s.follow == "hooks", s.follow
    assert s.step_kinds == ["warmup", "profiled", "profiled", "profiled"] + ["planned"] * 5


def test_more_buckets_than_max_plans_evicts_the_least_recently_used():
    sizes = [4, 8, 12] * 3
    plain, ours = _shapes_loop(False, sizes), _shapes_loop(True, sizes, max_plans=2)
    assert _same_training(ours, plain)
    s = ours["stats"]
    assert s.signatures_cached == 2 and s.signatures_evicted > 0 and s.stale_plans == 0
    assert s.peak_device_bytes <= s.budget_bytes


def test_shapes_that_never_repeat_run_on_the_pager_within_the_budget():
    """After CHURN_WINDOW plans made and never followed, a new shape is not profiled:
    the pager runs it, within the budget."""
    from tierflow.runtime.signatures import CHURN_WINDOW

    sizes = list(range(2, 14))
    plain, ours = _shapes_loop(False, sizes), _shapes_loop(True, sizes)
    assert _same_training(ours, plain)
    s = ours["stats"]
    assert s.replans == CHURN_WINDOW
    assert s.reactive_signature_steps == len(sizes) - 1 - CHURN_WINDOW
    assert s.step_kinds == ["warmup"] + ["profiled"] * CHURN_WINDOW + ["reactive"] * s.reactive_signature_steps
    assert s.peak_device_bytes <= s.budget_bytes


def test_a_shape_the_pager_ran_is_planned_when_it_comes_back():
    sizes = list(range(2, 9)) + [8, 8, 8]
    plain, ours = _shapes_loop(False, sizes), _shapes_loop(True, sizes)
    assert _same_training(ours, plain)
    s = ours["stats"]
    assert s.step_kinds[-4:] == ["reactive", "profiled", "planned", "planned"]


def test_a_shape_smaller_than_a_planned_one_follows_that_plan_within_the_budget():
    """Sizes that only shrink: after the churn window, each new size follows the cached
    plan of the smallest larger size (every tensor no larger), bitwise, within the budget."""
    from tierflow.runtime.signatures import CHURN_WINDOW

    sizes = list(range(13, 1, -1))
    plain, ours = _shapes_loop(False, sizes), _shapes_loop(True, sizes)
    assert _same_training(ours, plain)
    s = ours["stats"]
    assert s.replans == CHURN_WINDOW and s.dominated_steps == len(sizes) - 1 - CHURN_WINDOW
    assert s.step_kinds == ["warmup"] + ["profiled"] * CHURN_WINDOW + ["planned"] * s.dominated_steps
    assert s.stale_plans == 0 and s.peak_device_bytes <= s.budget_bytes


def test_a_larger_signature_dominates_a_smaller_one_of_the_same_arguments_only():
    from tierflow.runtime.signatures import dominates, signature_of

    def sig(*shapes, dtype=torch.float32, **kw):
        return signature_of(tuple(torch.zeros(s, dtype=dtype) for s in shapes), kw, True)

    assert dominates(sig((4, 40), (4, 40)), sig((4, 24), (4, 40)))
    assert not dominates(sig((4, 40)), sig((4, 40)))  # (the same signature: its own plan)
    assert not dominates(sig((4, 40)), sig((8, 24)))
    assert not dominates(sig((4, 40)), sig((4, 24), dtype=torch.float64))
    assert not dominates(sig((4, 40), causal=True), sig((4, 24), causal=False))
    assert not dominates(sig((4, 40)), sig((4, 24), (4, 24)))


def test_max_plans_below_one_is_refused():
    from tierflow.runtime.errors import OffloadError

    with pytest.raises(OffloadError, match="max_plans=0"):
        offload(nn.Linear(2, 2), None, max_plans=0)


def test_the_signature_is_the_shapes_and_dtypes_not_the_values():
    from tierflow.runtime.signatures import signature_of

    a = signature_of((torch.zeros(2, 3),), {}, True)
    assert a == signature_of((torch.ones(2, 3),), {}, True)
    assert a != signature_of((torch.zeros(2, 3, dtype=torch.float64),), {}, True)
    assert a != signature_of((torch.zeros(2, 3),), {}, False)  # (eval mode runs other ops)
    assert a != signature_of((torch.zeros(2, 3),), {"mask": None}, True)


def test_the_plan_cache_keeps_at_most_max_plans_and_follows_only_what_it_keeps():
    """Property: any sequence of signatures; the cache never holds more than its bound,
    says "follow" exactly for a signature it holds, and "pager" only while churning."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tierflow.runtime.signatures import CachedPlan, PlanCache

    @settings(max_examples=60, deadline=None)
    @given(st.integers(1, 4), st.lists(st.integers(0, 6), max_size=40))
    def check(bound, seq):
        c = PlanCache(bound)
        for sig in seq:
            held, churning = sig in c.plans, c.churning
            d = c.decide(sig)
            assert (d == "follow") == held
            assert d != "pager" or churning
            if isinstance(d, tuple):  # (integer signatures never dominate one another)
                raise AssertionError(d)
            if d == "follow":
                c.followed(sig)
            elif d == "profile":
                c.store(sig, CachedPlan({}, {}))
            assert len(c.plans) <= bound

    check()


def test_optimizer_state_loaded_inside_the_block_is_moved_by_the_plan_as_before():
    """``opt.load_state_dict(torch.load(...))`` leaves the optimizer holding the loaded
    tensors, whose storages nobody may resize: they are replaced by copies the runtime
    made, so the plan's moves of them still happen and the loop stays on its plan."""
    net, opt, data = _setup()
    g = torch.Generator().manual_seed(4)
    data = [torch.randn(4, 16, generator=g) for _ in range(8)]
    with offload(net, opt, policy=_roundtrip) as run:
        for i, x in enumerate(data):
            _step(net, opt, x)
            if i == 3:
                buf = io.BytesIO()
                torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, buf)
                buf.seek(0)
                ck = torch.load(buf, weights_only=True)
                net.load_state_dict(ck["model"])
                opt.load_state_dict(ck["opt"])
                del ck
    s = run.stats
    n_params = len(list(net.parameters()))
    assert run._checkpoints.adopted == 3 * n_params  # (step, exp_avg, exp_avg_sq)
    assert s.stale_plans == 0 and s.step_kinds == ["warmup", "profiled"] + ["planned"] * 6


def test_tierflow_train_says_how_many_plans_were_made_and_why():
    from tierflow.runtime.cli import _plan_count_rows, plans_summary
    from tierflow.runtime.stats import RunStats

    s = RunStats(replans=3, plans_by_reason={"first": 1, "new signature": 2}, signature_hits=8,
                 signatures_cached=3, outside_forwards=4)
    assert plans_summary(s) == "3 plans made (first 1, new signature 2)"
    rows = dict(_plan_count_rows(s))
    assert rows["signatures: cached / hits / evicted / run on the pager"] == "3 / 8 / 0 / 0"
    assert rows["forwards outside training (validation)"] == "4"


def _accumulating_loop(use: bool) -> dict:
    """Two micro-batches per step under bf16 autocast, clipping, a cosine schedule."""
    net, opt, _ = _setup()
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 8)
    g = torch.Generator().manual_seed(6)
    data = [torch.randn(4, 16, generator=g) for _ in range(12)]
    losses = []
    run = offload(net, opt, budget="50%", hardware=_fixed_hw()) if use else None
    if run is not None:
        run.__enter__()
    try:
        for i in range(6):
            for x in data[2 * i:2 * i + 2]:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = net(x).float().pow(2).mean() / 2
                loss.backward()
                losses.append(loss.item())
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
            sched.step()
    finally:
        if run is not None:
            run.__exit__(None, None, None)
    return {"losses": losses, "final": net.state_dict(), "stats": run.stats if run else None}


def test_accumulation_clipping_a_schedule_and_autocast_still_make_one_plan():
    """What the issue found planned once and followed: it stays so with signatures
    (the second micro-batch's forward is inside the iteration, not a new one)."""
    plain, ours = _accumulating_loop(False), _accumulating_loop(True)
    assert _same_training(ours, plain)
    s = ours["stats"]
    assert s.plans_by_reason == {"first": 1} and s.step_kinds == ["warmup", "profiled"] + ["planned"] * 4
