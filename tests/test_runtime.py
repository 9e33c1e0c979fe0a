"""The runtime: plans executed in real (CPU) training, bitwise parity with plain PyTorch,
the budget, stale plans, SSD faults, the SSD file's life, the CLI."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tierflow.capture import zoo
from tierflow.plan import validate
from tierflow.policies import policy_names
from tierflow.runtime import BudgetError, SSDError, offload, roundtrip_plan, train
from tierflow.runtime.tiers import Arena, SSDStore, clean_stale

MODELS = ("gpt-tiny", "vit-tiny", "resnet-tiny")
# SINGA only swaps blocks of at least 1 MB (the paper's threshold): scaled to tiny models;
# DeepSpeed's 5e8-element gradient bucket, likewise (the ZeRO peers then plan host steps,
# which the runtime executes)
_BUCKET = {"reduce_bucket_size": 1000}
OPTIONS = {"singa": {"min_bytes": 4096}, "zero_offload": _BUCKET, "zero_offload+checkpoint": _BUCKET,
           "zero_infinity": _BUCKET}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # tiny models: threads only add contention (and make timing noisy on a shared box)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _roundtrip(trace, hw, budget):
    plan = roundtrip_plan(trace, hw)
    validate(plan, trace, hw)  # a planned plan, checked like any policy's
    return plan


# -- the allocator ------------------------------------------------------------------------


def test_arena_first_fit_coalesces_and_refuses_when_full():
    a = Arena(1024, align=64)
    x, y, z = a.alloc(100), a.alloc(64), a.alloc(200)
    assert (x, y, z) == (0, 128, 192)
    a.release(y, 64)
    assert a.alloc(64) == 128  # the hole is reused
    a.release(x, 100)
    a.release(128, 64)
    assert a.largest_free() >= 192  # 0..192 merged
    assert a.alloc(2000) is None
    a.release(z, 200)
    assert a.used == 0 and a.largest_free() == 1024


# -- parity ------------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_roundtrip_parity_every_kind_through_host_and_ssd(model, tmp_path):
    """Every parameter, gradient, optimizer state and saved activation leaves the device
    in every gap, alternating host and SSD; 20 steps stay bitwise equal to plain PyTorch."""
    res = train(model, budget=None, steps=20, policy=_roundtrip, ssd_dir=str(tmp_path), check_parity=True)
    assert res.parity, res.parity_detail
    kinds = res.stats.moves_by_kind
    for kind in ("parameter", "gradient", "optimizer_state", "activation"):
        for tier in ("host", "ssd"):
            assert kinds.get(f"{kind}@{tier}", 0) > 0, (kind, tier, kinds)
    s = res.stats
    assert s.planned_steps >= 17 and s.stale_plans == 0
    assert s.transfers["device->ssd"] > 0 and s.transfers["ssd->device"] > 0
    assert list(tmp_path.iterdir()) == []  # the SSD file and its directory are gone


# Checkpointing drops activations only: where a model's peak is its state (vit-tiny's and
# resnet-tiny's is at the end of backward, parameters, gradients and Adam moments all
# live), no budget under the peak can be planned by it; on gpt-tiny activations rule.
PLANNABLE_ON = {"checkpoint": "gpt-tiny", "selective": "gpt-tiny"}


@pytest.mark.parametrize("policy", policy_names())
def test_every_policy_parity_and_budget(policy, tmp_path, fixed_op_times):
    """Each policy plans at a budget (the tightest of 60/80/95% of the peak), on a model
    picked round-robin: 20 steps bitwise equal, peak within the budget. (Fixed op times
    and machine: the plan, and so the verdict, is the same on a loaded machine.)"""
    model = PLANNABLE_ON.get(policy, MODELS[policy_names().index(policy) % len(MODELS)])
    tried = {}
    for budget in ("60%", "80%", "95%"):
        res = train(model, budget=budget, steps=20, policy=policy, ssd_dir=str(tmp_path), check_parity=True,
                    policy_options=OPTIONS.get(policy), hardware="h100-80g-pcie5-nvme")
        s = res.stats
        # whatever the policy made of it, training is exact and within the budget
        assert res.parity, res.parity_detail
        assert s.peak_device_bytes <= s.budget_bytes
        tried[budget] = s.plan_error
        if s.plan_error is None:  # the policy planned (else the runtime fell back to its pager)
            break
    # the policy itself is under test, not the runtime's fallback pager
    assert s.plan_error is None, f"policy {policy} planned on {model} at none of the budgets: {tried}"
    assert s.policy == policy
    assert s.planned_steps >= 17 and s.stale_plans == 0
    assert s.predicted_step_time_s is not None and s.predicted_step_time_s > 0
    if policy != "ideal":  # the budget made something move, or be dropped and recomputed
        assert sum(s.moved_bytes.values()) > 0 or (s.dropped_bytes > 0 and s.recomputed_ops > 0)


def test_budget_in_bytes_is_enforced_from_the_first_step():
    m = zoo.build("mlp-tiny", seed=0)
    x, y = m.make_batch(8)
    opt = torch.optim.AdamW(m.model.parameters(), lr=1e-3)
    total = sum(p.untyped_storage().nbytes() for p in m.model.parameters())
    budget = int(2.5 * total)  # below weights + grads + two Adam moments
    with offload(m.model, opt, budget=budget, policy="lru") as run:
        for _ in range(6):
            m.loss_fn(m.model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert run.stats.peak_device_bytes <= budget
    assert run.stats.unplanned_evictions > 0 and run.stats.moved_bytes["host"] > 0


def test_byte_budget_holds_in_the_first_iteration_of_a_model_with_a_large_late_result():
    """gpt-tiny's logits (256 KiB, made late in the first forward) are larger than any
    result before them: the pager makes room for them from the op's meta kernel, not
    from the largest result seen so far, so no iteration, the first included, goes
    over a byte budget."""
    m = zoo.build("gpt-tiny", seed=0)
    x, y = m.make_batch(4)
    opt = torch.optim.AdamW(m.model.parameters(), lr=1e-3, foreach=False)
    budget = 1_300_000  # about 36% of the profiled peak
    with offload(m.model, opt, budget=budget) as run:
        for _ in range(4):
            m.loss_fn(m.model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert run.stats.planned_steps >= 1
    assert run.stats.peak_device_bytes <= budget


def test_result_bytes_come_from_meta_kernels_without_touching_the_random_stream():
    from tierflow.runtime.storages import _new_result_bytes

    aten = torch.ops.aten
    a, b = torch.randn(32, 8), torch.randn(8, 16)
    state = torch.get_rng_state()
    assert _new_result_bytes(aten.mm.default, (a, b), {}) == 32 * 16 * 4
    assert _new_result_bytes(aten.randn.default, ([64, 4],), {"device": torch.device("cpu")}) == 64 * 4 * 4
    assert _new_result_bytes(aten.view.default, (a, [256]), {}) == 0  # a view: no new storage
    assert _new_result_bytes(aten.nonzero.default, (a,), {}) is None  # data-dependent shape
    assert torch.equal(torch.get_rng_state(), state)


def test_budget_below_working_set_fails_before_any_update():
    m = zoo.build("mlp-tiny", seed=0)
    x, y = m.make_batch(8)
    opt = torch.optim.AdamW(m.model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in m.model.parameters()]
    with pytest.raises(BudgetError, match=r"minimum working set: .* needs .* bytes"):
        with offload(m.model, opt, budget="8KiB", policy="lru"):
            for _ in range(3):
                m.loss_fn(m.model(x), y).backward()
                opt.step()
                opt.zero_grad()
    for p, q in zip(m.model.parameters(), before):
        assert p.untyped_storage().nbytes() == q.untyped_storage().nbytes()
        assert torch.equal(p, q)  # nothing was updated, nothing left off the device


# -- stale plans --------------------------------------------------------------------------


def _plain_and_offloaded(batches, tmp_path, **kw):
    def build():
        m = zoo.build("gpt-tiny", seed=0)
        return m, torch.optim.AdamW(m.model.parameters(), lr=1e-3)

    def loop(m, opt, aside=None):
        losses = []
        for x, y in batches:
            loss = m.loss_fn(m.model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses

    m0, o0 = build()
    ref = loop(m0, o0)
    m1, o1 = build()
    with offload(m1.model, o1, ssd_dir=str(tmp_path), **kw) as run:
        got = loop(m1, o1)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    for p, q in zip(m0.model.parameters(), m1.model.parameters()):
        assert torch.equal(p, q)
    return run


def test_a_batch_shape_change_is_a_new_signature_planned_once_and_stays_exact(tmp_path):
    """Long batches, short ones, long ones again: the short ones are a new signature
    (profiled and planned once, not a departure), and the long ones come back to their
    cached plan (runtime/signatures.py; tests/test_runtime_loops.py has the rest)."""
    g = zoo.build("gpt-tiny", seed=0).make_batch
    long, short = g(4, 32), g(4, 16)
    batches = [long] * 4 + [short] * 4 + [long] * 3
    run = _plain_and_offloaded(batches, tmp_path, budget="3MiB", policy=_roundtrip)
    s = run.stats
    assert s.stale_plans == 0 and s.plans_by_reason == {"first": 1, "new signature": 1}
    assert s.step_kinds == ["warmup", "profiled", "planned", "planned", "profiled"] + ["planned"] * 6
    assert s.signature_hits == 1
    assert s.peak_device_bytes <= s.budget_bytes


# -- SSD ----------------------------------------------------------------------------------


def test_ssd_file_is_private_preallocated_and_removed(tmp_path):
    store = SSDStore(tmp_path, capacity=1 << 20, bounce_bytes=1 << 20)
    try:
        assert stat.S_IMODE(store.dir.stat().st_mode) == 0o700
        assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
        assert store.path.stat().st_blocks * 512 >= 1 << 20  # allocated, not sparse
    finally:
        store.close()
    assert not store.dir.exists()


def test_stale_run_directory_of_a_dead_process_is_removed(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"tierflow-{int(proc.stdout)}-abc"
    dead.mkdir()
    (dead / "swap").write_bytes(b"x" * 10)
    mine = tmp_path / f"tierflow-{os.getpid()}-def"
    mine.mkdir()
    assert clean_stale(tmp_path) == [dead]
    assert not dead.exists() and mine.exists()


def test_ssd_full_on_a_tiny_filesystem_fails_at_start(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        m = zoo.build("mlp-tiny", seed=0)
        opt = torch.optim.SGD(m.model.parameters(), lr=0.1)
        before = [p.detach().clone() for p in m.model.parameters()]
        with pytest.raises(SSDError, match="cannot pre-allocate 8.00 MiB"):
            with offload(m.model, opt, budget=None, ssd_dir=str(mnt), ssd_bytes="8MiB"):
                pass
        assert list(mnt.iterdir()) == []  # nothing left behind
        assert all(torch.equal(p, q) for p, q in zip(m.model.parameters(), before))
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_ssd_write_error_keeps_model_and_optimizer_intact(tmp_path, monkeypatch):
    """ENOSPC injected into the 40th SSD write, mid-training: a clear SSDError, and the
    model and optimizer equal those of plain PyTorch after the steps that completed."""
    calls = {"n": 0}
    real = SSDStore._pwrite

    def failing(self, buf, off):
        calls["n"] += 1
        if calls["n"] >= 40:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, buf, off)

    monkeypatch.setattr(SSDStore, "_pwrite", failing)
    m = zoo.build("mlp-tiny", seed=0)
    x, y = m.make_batch(8)
    opt = torch.optim.AdamW(m.model.parameters(), lr=1e-3)
    with pytest.raises(SSDError, match="No space left on device.*intact"):
        with offload(m.model, opt, policy=_roundtrip, ssd_dir=str(tmp_path)) as run:
            for _ in range(50):
                m.loss_fn(m.model(x), y).backward()
                opt.step()
                opt.zero_grad()
    done = run.stats.steps
    assert 1 <= done < 50
    ref = zoo.build("mlp-tiny", seed=0)
    ropt = torch.optim.AdamW(ref.model.parameters(), lr=1e-3)
    for _ in range(done):
        ref.loss_fn(ref.model(x), y).backward()
        ropt.step()
        ropt.zero_grad()
    for p, q in zip(m.model.parameters(), ref.model.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(m.model.parameters(), ref.model.parameters()):
        for k, v in ropt.state[q].items():
            assert torch.equal(opt.state[p][k], v), k
    assert list(tmp_path.iterdir()) == []


def test_plan_tier_missing_falls_back_to_host_and_counts():
    res = train("mlp-tiny", budget=None, steps=4, policy=lambda tr, hw, b: roundtrip_plan(tr, hw, tiers=("host",)),
                check_parity=True)
    assert res.parity and res.stats.tier_fallbacks == 0
    # a hardware with an SSD tier, but no ssd_dir: the SSD moves go to host
    res = train("mlp-tiny", budget=None, steps=4, policy=_roundtrip, check_parity=True,
                hardware="a100-40g-pcie4-nvme")
    assert res.parity and res.stats.tier_fallbacks > 0 and res.stats.moved_bytes["ssd"] == 0


# -- API and CLI --------------------------------------------------------------------------


def test_import_is_lazy_and_offload_is_an_attribute():
    code = "import sys, tierflow; assert 'tierflow.runtime' not in sys.modules; f = tierflow.offload; print(f.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "offload"


def test_cli_train_json(capsys, tmp_path):
    from tierflow.cli import main

    rc = main(["train", "--model", "mlp-tiny", "--batch", "8", "--budget", "60%", "--steps", "5",
               "--policy", "myelin", "--ssd-dir", str(tmp_path), "--check-parity", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    for key in ("steps", "step_time_s", "peak_device_bytes", "budget_bytes", "moved_bytes",
                "predicted_step_time_s", "parity"):
        assert key in data
    assert data["steps"] == 5 and data["parity"] is True
    assert data["peak_device_bytes"] <= data["budget_bytes"]
    assert set(data["moved_bytes"]) >= {"host", "ssd"}


@pytest.mark.parametrize("flag, stepped", [("auto", True), ("no", False)])
def test_cli_train_host_steps_flag(capsys, flag, stepped):
    """``--host-steps no`` refuses host updates even to ZeRO-Offload (which then falls
    back to the reactive pager, saying why); ``auto`` on CPU allows them."""
    from tierflow.cli import main

    rc = main(["train", "--model", "gpt-tiny", "--budget", "95%", "--steps", "4", "--policy", "zero_offload",
               "--set", "reduce_bucket_size=20000", "--host-steps", flag, "--check-parity", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["parity"] is True
    assert (data["stats"]["host_steps"] > 0) is stepped
    if not stepped:
        assert "fallback" in data["policy"] and data["stats"]["plan_error"]


def test_cli_train_budget_too_small_is_one_line_error(capsys):
    from tierflow.cli import main

    rc = main(["train", "--model", "mlp-tiny", "--budget", "1KiB", "--steps", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and "minimum working set" in err and "Traceback" not in err


def test_demo_run_prints_pipeline(tmp_path):
    from io import StringIO

    from rich.console import Console

    from tierflow.runtime import demo_run

    buf = StringIO()
    res = demo_run("mlp-tiny", steps=4, ssd_dir=str(tmp_path), console=Console(file=buf, width=160))
    text = buf.getvalue()
    assert res.parity is True
    assert "predicted" in text and "parity" in text
    assert Path(tmp_path).exists() and list(Path(tmp_path).iterdir()) == []


def test_offload_refuses_a_bad_policy_option_before_any_step():
    # checked when the run is made, not after the profiled iteration: nothing has moved
    from tierflow.errors import PolicyError
    from tierflow.runtime import Run

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(PolicyError, match="lookahead"):
        Run(model, opt, budget="50%", policy="deepum", policy_options={"lookahead": "many"})
    with pytest.raises(PolicyError, match="foo"):
        Run(model, opt, budget="50%", policy="deepum", policy_options={"foo": 1})
