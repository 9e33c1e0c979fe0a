"""The runtime under torch.distributed: 2 gloo processes on the CPU.

DDP and FSDP2 (``fully_shard``) runs of gpt-tiny under ``tierflow.offload`` against the
same distributed runs without tierflow, 20 steps: losses, every gradient of every step
and the final parameters (under FSDP2 each rank's shards) bitwise equal, on both ranks,
with tensors really moved. Collectives in flight pin what they read and write; the ranks
plan from the same trace and refuse to go on with different plans; ``tierflow train
--nproc 2``.

All the distributed work runs once, in one pair of processes (torch's start-up is the
dear part on a loaded 2-core box); each test checks its part of what they wrote.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available in this torch build",
                allow_module_level=True)

WORLD = 2
STEPS = 20
BUDGET = "60%"


def _after_collectives(trace, hw, budget):
    """A plan that evicts every tensor a collective touches right after the collective
    op, while gloo may still be reading and writing it (an invalid plan: the runtime
    runs it anyway, and must refuse those moves)."""
    from tierflow.plan import Move, Plan

    moves = [Move("evict", t, k, "host") for k, op in enumerate(trace.ops) if op.name.startswith("c10d::")
             for t in dict.fromkeys(op.inputs + op.outputs)]
    return Plan("after-collectives", tuple(moves), budget_bytes=float("inf"))


def _bucket_views(rank: int) -> dict:
    """DDP with ``gradient_as_bucket_view``: every gradient lives in the all-reduce bucket.
    Evicting it right after ``allreduce_`` returns would free memory gloo's thread is
    still writing (without the pins this run dies of SIGSEGV)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tierflow.capture import zoo
    from tierflow.runtime import offload

    def run(with_tierflow: bool):
        m = zoo.build("gpt-tiny", seed=0)
        x, y = m.make_batch(4 * WORLD)
        x, y = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
        net = DDP(m.model, gradient_as_bucket_view=True, bucket_cap_mb=0.1)
        opt = torch.optim.SGD(net.parameters(), lr=1e-2, momentum=0.9)
        losses = []
        ctx = offload(net, opt, policy=_after_collectives) if with_tierflow else contextlib.nullcontext()
        with ctx:
            for _ in range(4):  # warm-up (momentum), warm-up (DDP's buckets), profiled, planned
                loss = m.loss_fn(net(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=False)  # the gradients stay bucket views
                losses.append(loss.detach().clone())
        return losses, [p.detach().clone() for p in net.parameters()], ctx

    l0, p0, _ = run(False)
    # Whether gloo's thread is still busy when the eviction comes is a race; make every
    # all-reduce report "not completed" (as a slow network would) so that the eviction
    # deterministically meets a collective in flight. The program's own use of a
    # gradient (the optimizer step) still releases the pins, after a real wait().
    work = torch._C._distributed_c10d.Work
    is_completed = work.is_completed
    work.is_completed = lambda self: False
    try:
        l1, p1, r = run(True)
    finally:
        work.is_completed = is_completed
    s = r.stats
    return {"equal": all(torch.equal(a, b) for a, b in zip(l0 + p0, l1 + p1)), "busy_refusals": s.busy_refusals,
            "collectives": s.collectives, "plan_error": s.plan_error}


def _mismatch(rank: int, kind: str) -> dict:
    """Ranks that plan differently (a rank-dependent policy), or that profile different
    iterations (a batch shape per rank): both ranks raise RankMismatchError."""
    from tierflow.capture import zoo
    from tierflow.plan import Plan
    from tierflow.runtime import offload, roundtrip_plan
    from tierflow.runtime.distributed import RankMismatchError

    m = zoo.build("mlp-tiny", seed=0)
    x, y = m.make_batch(8 if kind == "plan" else 8 + 4 * rank)
    opt = torch.optim.SGD(m.model.parameters(), lr=0.1)

    def by_rank(trace, hw, budget):
        return roundtrip_plan(trace, hw) if rank == 0 else Plan("nothing", (), budget_bytes=budget)

    before = [p.detach().clone() for p in m.model.parameters()]
    try:
        with offload(m.model, opt, policy=by_rank if kind == "plan" else "lru") as run:
            for _ in range(4):
                m.loss_fn(m.model(x), y).backward()
                opt.step()
                opt.zero_grad()
    except RankMismatchError as e:
        # the error came out of the first step's optimizer.step(): that step's update is
        # done, the rest never ran; the model is whole again (the with block brought it home)
        whole = all(p.untyped_storage().nbytes() == q.untyped_storage().nbytes()
                    for p, q in zip(m.model.parameters(), before))
        return {"error": str(e), "steps": run.stats.steps, "whole": whole}
    return {"error": None, "steps": run.stats.steps}


def _ranks(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=90))
    from tierflow.runtime import train

    res: dict = {"cpu_s": {"start": time.process_time()}}
    try:
        for strategy in ("ddp", "fsdp"):
            r = train("gpt-tiny", budget=BUDGET, steps=STEPS, policy="tierflow", check_parity=True,
                      strategy=strategy)
            res[strategy] = r.to_dict()
            res["cpu_s"][strategy] = time.process_time()
        # ZeRO-Offload's plan: every parameter stepped on the host, once DDP has reduced
        # its gradient (updates start when the step does); its bucket at the tiny scale
        r = train("gpt-tiny", budget="80%", steps=12, policy="zero_offload", check_parity=True,
                  strategy="ddp", policy_options={"reduce_bucket_size": 1000})
        res["ddp_host_steps"] = r.to_dict()
        res["cpu_s"]["ddp_host_steps"] = time.process_time()
        res["bucket_views"] = _bucket_views(rank)
        res["cpu_s"]["bucket_views"] = time.process_time()
        res["plan_mismatch"] = _mismatch(rank, "plan")
        res["trace_mismatch"] = _mismatch(rank, "trace")
        res["cpu_s"]["mismatch"] = time.process_time()
    except BaseException:
        res["error"] = traceback.format_exc()
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(res, default=str))
        gc.collect()  # FSDP2's cycles and their gloo work go while the group is alive (see runtime/cli.py)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    from tierflow.runtime.distributed import free_port

    out = tmp_path_factory.mktemp("ranks")
    ctx = mp.start_processes(_ranks, args=(free_port(), str(out)), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the 2-process run did not finish in 240 s")
    got = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r, g in enumerate(got):
        assert "error" not in g, f"rank {r} failed:\n{g['error']}"
    return got


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_parity_with_the_same_distributed_run_without_tierflow(ranks, strategy):
    """20 steps of gpt-tiny on 2 ranks, AdamW, a budget of 60% of the profiled peak, the
    tierflow policy: every loss, every gradient of every step and the final parameters
    bitwise equal to the same DDP / FSDP2 run without tierflow, on each rank. FSDP2 is
    bitwise too, tolerance 0: tierflow only copies bytes out and back, and on the CPU
    the same reduce-scatters run in the same order on the same values."""
    for r, g in enumerate(ranks):
        d = g[strategy]
        assert d["world_size"] == WORLD and d["rank"] == r and d["strategy"] == strategy
        assert d["steps"] == STEPS
        assert d["parity"] is True, f"rank {r}: {d['parity_detail']}"
        s = d["stats"]
        assert sum(s["moved_bytes"].values()) > 0, s["moved_bytes"]  # the budget made tensors move
        assert s["peak_device_bytes"] <= s["budget_bytes"]
        assert s["planned_steps"] >= STEPS - 5 and s["stale_plans"] == 0, s["stale_reasons"]
        assert s["collectives"] > 0
    # the ranks hold different data (their slices of the batch), yet follow one plan
    assert ranks[0][strategy]["losses"] != ranks[1][strategy]["losses"]
    assert ranks[0][strategy]["stats"]["plan_digest"] == ranks[1][strategy]["stats"]["plan_digest"]


def test_ddp_with_host_steps_is_bitwise_equal(ranks):
    """DDP under ZeRO-Offload's plan: each rank steps every parameter on the host, from
    the gradient DDP has reduced, bitwise equal to the same DDP run without tierflow."""
    for r, g in enumerate(ranks):
        d = g["ddp_host_steps"]
        assert d["parity"] is True, f"rank {r}: {d['parity_detail']}"
        s = d["stats"]
        assert s["policy"] == "zero_offload" and s["plan_error"] is None
        assert s["host_stepped_params"] > 0 and s["host_steps"] >= s["host_stepped_params"] * s["planned_steps"] > 0
        assert s["peak_device_bytes"] <= s["budget_bytes"] and s["stale_plans"] == 0


def test_ddp_moves_every_kind_and_fsdp_moves_its_shards(ranks):
    """Under DDP the runtime moves replicated parameters, gradients (not the buckets:
    DDP copies into those), Adam moments and activations; under FSDP2 it moves the
    rank's parameter and optimizer-state shards and leaves FSDP's unsharded parameters
    (which FSDP frees and re-allocates itself) alone."""
    for g in ranks:
        ddp, fsdp = g["ddp"]["stats"], g["fsdp"]["stats"]
        kinds = {k.split("@")[0] for k in ddp["moves_by_kind"]}
        assert {"parameter", "optimizer_state"} <= kinds, ddp["moves_by_kind"]
        assert ddp["foreign_storages"] == 0
        kinds = {k.split("@")[0] for k in fsdp["moves_by_kind"]}
        assert {"parameter", "optimizer_state"} <= kinds, fsdp["moves_by_kind"]
        assert fsdp["foreign_storages"] > 0  # the unsharded parameters FSDP manages


def test_collectives_in_flight_pin_what_they_touch(ranks):
    """A plan that evicts DDP's gradient buckets right after their all-reduce starts:
    the runtime refuses those moves (the all-reduce is still running in gloo's thread)
    and training stays bitwise equal."""
    for g in ranks:
        b = g["bucket_views"]
        assert b["equal"] is True
        assert b["busy_refusals"] > 0 and b["collectives"] > 0


def test_ranks_that_plan_differently_raise_on_every_rank(ranks):
    for g in ranks:
        m = g["plan_mismatch"]
        assert m["error"] is not None and "made different plans" in m["error"], m
        assert "rank 0" in m["error"] and "rank 1" in m["error"]
        assert "sync_ranks=False" in m["error"]
        assert m["whole"] is True


def test_ranks_that_profile_different_iterations_raise_on_every_rank(ranks):
    for g in ranks:
        m = g["trace_mismatch"]
        assert m["error"] is not None and "profiled different iterations" in m["error"], m


def test_cli_train_nproc_2(capsys, tmp_path):
    """``tierflow train --nproc 2``: two local ranks (gloo), rank 0 prints every rank."""
    from tierflow.cli import main

    rc = main(["train", "--model", "mlp-tiny", "--steps", "4", "--budget", "60%", "--policy", "g10",
               "--optimizer", "sgd", "--nproc", "2", "--strategy", "fsdp", "--check-parity", "--json",
               "--ssd-dir", str(tmp_path)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    data = json.loads(out.out)
    assert data["world_size"] == 2 and data["strategy"] == "fsdp"
    assert data["parity"] is True and data["plans_agree"] is True
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    for r in data["ranks"]:
        assert r["steps"] == 4 and r["stats"]["planned_steps"] >= 2
        assert sum(r["moved_bytes"].values()) > 0
    assert list(tmp_path.iterdir()) == []  # each rank's SSD file is gone


def test_launch_ends_every_rank_when_one_fails():
    """A rank that fails ends the others (they would wait for it in a collective), and
    each rank gets torchrun's variables."""
    import sys

    from tierflow.runtime.distributed import launch

    code = ("import os, sys, time; r = int(os.environ['RANK']); "
            "print(r, os.environ['LOCAL_RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_ADDR'], "
            "os.environ['OMP_NUM_THREADS'], flush=True); "
            "sys.exit(3) if r == 1 else time.sleep(120)")
    t0 = time.monotonic()
    codes, outs, errs = launch(2, [sys.executable, "-c", code])
    assert time.monotonic() - t0 < 60
    assert codes[1] == 3 and codes[0] < 0  # rank 0 was killed
    assert outs[0].split()[:4] == ["0", "0", "2", "127.0.0.1"] and outs[1].split()[:3] == ["1", "1", "2"]


def test_cli_nproc_reports_a_failure_once(capsys, monkeypatch):
    """Ranks that fail alike (a budget below the working set raises on every rank) are
    reported once, with the failing rank's exit code."""
    from tierflow.cli import main
    from tierflow.runtime import distributed

    err = "error: budget 1.00 KiB (1024 bytes) is below the minimum working set: op 3 (aten::addmm) alone needs ..."
    monkeypatch.setattr(distributed, "launch", lambda n, cmd, timeout_s=None: ([2, 2], ["", ""], [err, err]))
    rc = main(["train", "--model", "mlp-tiny", "--budget", "1KiB", "--steps", "3", "--nproc", "2"])
    out = capsys.readouterr()
    assert rc == 2 and out.err.count("minimum working set") == 1
    monkeypatch.setattr(distributed, "launch", lambda n, cmd, timeout_s=None: ([-9, 2], ["", ""], ["", err]))
    rc = main(["train", "--model", "mlp-tiny", "--budget", "1KiB", "--steps", "3", "--nproc", "2"])
    assert rc == 2 and capsys.readouterr().err.count("minimum working set") == 1


def test_a_storage_its_owner_regrows_while_away_stays_the_owners():
    """FSDP frees and re-allocates storages itself (``untyped_storage().resize_``). One the
    runtime moved away and its owner grew again and filled is the owner's: the runtime
    does not copy its old bytes over the new ones, and never moves it again."""
    from torch.utils._python_dispatch import _disable_current_modes

    from tierflow.runtime import offload

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    with offload(lin, opt, policy="lru") as run:
        st = lin.weight.untyped_storage()
        e = run._entries[st._cdata]
        assert run._evict(e, "host") and st.nbytes() == 0
        st.resize_(e.nbytes)  # as FSDP's alloc_storage
        with _disable_current_modes():
            lin.weight.data.fill_(7.0)  # filled by its owner, unseen by the runtime
        out = lin(torch.ones(1, 4))
        assert e.foreign and not run._evict(e, "host")
    assert torch.all(lin.weight == 7.0) and torch.allclose(out, 28.0 + lin.bias)
