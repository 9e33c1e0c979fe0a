"""The host pool: power-of-two chunks that a slot never straddles, grown on demand up to
the host's available memory (less a margin), grown to the plan's host need at planning,
and a clean error at planning where the host cannot hold what the plan needs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from helpers import assert_training_equal, load_benchmark
from tierflow.runtime import OffloadError, offload, tiers
from tierflow.runtime.tiers import CHUNK_BYTES, PAGE, Arena, HostPool

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]


def _outside_models():
    return load_benchmark("outside_models")


# -- the chunked arena ---------------------------------------------------------------------


def _in_one_chunk(arena: Arena, bases: list[int], off: int, n: int) -> bool:
    ends = bases[1:] + [arena.capacity]
    return any(b <= off and off + n <= e for b, e in zip(bases, ends))


def test_a_slot_never_straddles_two_chunks():
    a = Arena(0, align=64)
    bases = [a.add_chunk(256), a.add_chunk(256)]
    assert bases == [0, 256] and a.capacity == 512
    assert a.alloc(192) == 0
    # 64 free at the end of the first chunk and 256 in the second: 128 goes to the second
    assert a.alloc(128) == 256
    assert a.alloc_at(192, 128) is None  # would straddle the chunks' boundary
    assert a.alloc(64) == 192  # the first chunk's tail still serves what fits
    assert a.alloc(256) is None  # 128 free in one piece only
    assert a.largest_free() == 128


def test_release_coalesces_within_a_chunk_but_not_across():
    a = Arena(0, align=64)
    a.add_chunk(256)
    a.add_chunk(256)
    offs = [a.alloc(128) for _ in range(4)]
    assert offs == [0, 128, 256, 384]
    for off in (128, 256, 0, 384):
        a.release(off, 128)
    assert a.used == 0 and a.free == 512
    assert a.largest_free() == 256  # two chunks, two free blocks: never merged into 512
    assert a.alloc(512) is None
    assert a.alloc(256) == 0 and a.alloc(256) == 256


def test_random_allocations_stay_inside_chunks_and_disjoint():
    rng = random.Random(0)
    a = Arena(0, align=64)
    bases = [a.add_chunk(rng.choice([256, 512, 1024])) for _ in range(6)]
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.45:
            off = rng.choice(sorted(live))
            a.release(off, live.pop(off))
            continue
        n = rng.randrange(1, 700)
        want = rng.randrange(0, a.capacity // 64) * 64 if rng.random() < 0.3 else None
        off = a.alloc_at(want, n) if want is not None else a.alloc(n)
        if off is None:
            continue
        n = (n + 63) // 64 * 64
        assert _in_one_chunk(a, bases, off, n), (off, n)
        assert all(off + n <= o or o + m <= off for o, m in live.items()), (off, n)
        live[off] = n
        assert a.used == sum(live.values())
    for off, n in list(live.items()):
        a.release(off, n)
    assert a.used == 0 and a.largest_free() == 1024


def test_add_chunk_refuses_an_unaligned_size():
    with pytest.raises(ValueError, match="multiple of 4096"):
        Arena(0, align=PAGE).add_chunk(5000)


# -- the host pool -------------------------------------------------------------------------


def test_pool_grows_by_power_of_two_chunks_up_to_its_limit():
    pool = HostPool(200 * MiB, pin=False)
    assert pool.capacity == 0 and pool.chunk_sizes == []
    assert pool.grow(10)
    assert pool.chunk_sizes == [MiB]  # small need, small first chunk
    for _ in range(8):
        assert pool.grow(PAGE)
    # doubling while small, then whole chunks
    assert pool.chunk_sizes == [MiB, MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB, 64 * MiB, 64 * MiB]
    assert pool.capacity == sum(pool.chunk_sizes) == 192 * MiB
    # a whole chunk would pass the limit: one just big enough for the slot still fits
    assert pool.grow(PAGE) and pool.chunk_sizes[-1] == PAGE
    assert not pool.grow(16 * MiB)  # nor does that
    assert pool.capacity == 192 * MiB + PAGE <= pool.limit
    assert all(c & (c - 1) == 0 for c in pool.chunk_sizes)
    pool.close()


def test_a_tensor_larger_than_a_chunk_gets_its_own_chunk():
    pool = HostPool(1 << 40, pin=False)
    n = CHUNK_BYTES + 5 * PAGE
    assert pool.grow(n)
    assert pool.chunk_sizes == [2 * CHUNK_BYTES]
    off = pool.arena.alloc(n)
    assert off == 0
    pool.close()


def test_reserve_grows_to_a_need_and_a_chunk_for_the_largest_slot():
    pool = HostPool(1 << 40, pin=False)
    assert pool.reserve(100 * MiB, largest=3 * MiB)
    assert pool.capacity >= 100 * MiB and max(pool.chunk_sizes) >= 3 * MiB
    assert pool.capacity - 100 * MiB < CHUNK_BYTES  # no more than a chunk over the need
    small = HostPool(8 * MiB, pin=False)
    assert not small.reserve(9 * MiB) and small.capacity <= 8 * MiB
    pool.close()
    small.close()


def test_addresses_and_views_come_from_the_slot_s_chunk():
    pool = HostPool(1 << 30, pin=False)
    pool.grow(PAGE)
    pool.grow(PAGE)
    assert len(pool.chunk_sizes) == 2
    for off in (0, PAGE, MiB, MiB + 3 * PAGE):
        v = pool.view(off, 16)
        assert v.data_ptr() == pool.address(off)
        assert v.data_ptr() % PAGE == 0
        v.copy_(torch.arange(16, dtype=torch.uint8) + off % 251)
    for off in (0, PAGE, MiB, MiB + 3 * PAGE):
        assert torch.equal(pool.view(off, 16), torch.arange(16, dtype=torch.uint8) + off % 251)
    pool.close()


def test_fixed_pool_is_its_size_in_powers_of_two_and_never_grows():
    size = CHUNK_BYTES + 36 * MiB + 3 * PAGE + 100  # (the odd 100 bytes are rounded off)
    pool = HostPool(size, pin=False, fixed=True)
    assert pool.chunk_sizes == [CHUNK_BYTES, 32 * MiB, 4 * MiB, 2 * PAGE, PAGE]
    assert pool.capacity == pool.limit == size // PAGE * PAGE
    assert not pool.grow(PAGE)
    pool.close()


def test_pinned_bytes_are_the_chunks_exactly(monkeypatch):
    # NOTE: CUDA's pinned-host caching allocator rounds a request up to a power of two;
    # every request the pool makes must already be one, and pinned_bytes their sum
    asked = []
    real_empty = torch.empty

    def fake_empty(n, dtype=None, pin_memory=False):
        if pin_memory:
            asked.append(n)
        return real_empty(n, dtype=dtype)  # (no CUDA here: plain memory stands in)

    monkeypatch.setattr(tiers.torch, "empty", fake_empty)
    pool = HostPool(1 << 40, pin=True)
    for n in (PAGE, 3 * MiB, 70 * MiB, PAGE):
        assert pool.grow(n)
    assert asked == pool.chunk_sizes and all(n & (n - 1) == 0 for n in asked)
    assert pool.pinned_bytes == sum(asked) == pool.capacity
    fixed = HostPool(100 * MiB, pin=True, fixed=True)
    assert asked[4:] == [64 * MiB, 32 * MiB, 4 * MiB] and fixed.pinned_bytes == 100 * MiB
    assert HostPool(100 * MiB, pin=False, fixed=True).pinned_bytes == 0


def test_a_host_that_refuses_memory_stops_the_pool_cleanly(monkeypatch):
    real_empty = torch.empty
    calls = []

    def refuse_after_two(n, dtype=None, pin_memory=False):
        calls.append(n)
        if len(calls) > 2:
            raise RuntimeError("out of memory (test)")
        return real_empty(n, dtype=dtype)

    monkeypatch.setattr(tiers.torch, "empty", refuse_after_two)
    pool = HostPool(1 << 30, pin=False)
    assert pool.grow(PAGE) and pool.grow(PAGE)
    assert not pool.grow(PAGE)  # refused: nothing added, and the pool stops growing
    assert pool.capacity == sum(pool.chunk_sizes) == 2 * MiB and pool.limit == pool.capacity
    assert not pool.grow(PAGE) and len(calls) == 3
    calls.clear()
    with pytest.raises(OffloadError, match=r"cannot allocate 200.00 MiB .* pass a smaller host_bytes"):
        HostPool(200 * MiB, pin=False, fixed=True)


def test_host_bound_is_available_memory_less_the_margin(monkeypatch):
    monkeypatch.setattr(tiers, "host_available_bytes", lambda: 1000 * MiB)
    assert tiers.host_memory_bound() == int(1000 * MiB * (1 - tiers.HOST_MARGIN)) // PAGE * PAGE


def test_host_available_bytes_reads_the_machine():
    n = tiers.host_available_bytes()
    total = tiers.os.sysconf("SC_PAGE_SIZE") * tiers.os.sysconf("SC_PHYS_PAGES")
    assert 0 < n <= total


# -- training with the default pool --------------------------------------------------------


def _mlp(batch: int = 4096, width: int = 128, layers: int = 8):
    """An MLP whose activations (batch x width per layer) dwarf its parameters."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(layers)]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1))

    def make_batch(i: int):
        g = torch.Generator().manual_seed(i)
        return torch.randn(batch, width, generator=g), torch.randn(batch, 1, generator=g)

    return model, make_batch, torch.nn.functional.mse_loss


def _unet(batch: int = 96):
    return _outside_models().build("unet-mini", batch=batch)


def _old_default_pool(model: torch.nn.Module) -> int:
    """The host pool's size before issue 23 for a share budget (the budget unknown when
    the block opens): four times the model state, twice, plus 16 MiB."""
    state = sum(t.untyped_storage().nbytes() for t in list(model.parameters()) + list(model.buffers()))
    return 8 * state + (16 << 20)


def _train(build, steps: int, budget=None, **options):
    """(model, optimizer, losses, grads, stats) of ``steps`` AdamW steps, under
    :func:`offload` with ``options`` where ``budget`` is given, else plain PyTorch."""
    model, make_batch, loss_fn = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], []

    def loop(aside):
        for i in range(steps):
            x, y = make_batch(i)
            loss = loss_fn(model(x), y)
            loss.backward()
            with aside():
                grads.append([p.grad.clone() for p in model.parameters()])
                losses.append(loss.item())
            opt.step()
            opt.zero_grad(set_to_none=True)

    if budget is None:
        import contextlib

        loop(contextlib.nullcontext)
        return model, opt, losses, grads, None
    with offload(model, opt, budget=budget, **options) as run:
        loop(run.untracked)
    return model, opt, losses, grads, run.stats


CASES = {"mlp": _mlp, "unet-mini": _unet}


@pytest.mark.parametrize(("name", "share"), [("mlp", "30%"), ("mlp", "20%"), ("unet-mini", "45%")])
def test_old_default_pool_was_too_small(name, share):
    # the case the tests below train: with the pool fixed at its old default size, the
    # run stops with "host pool full" (host_bytes keeps its meaning: a fixed cap)
    model = CASES[name]()[0]
    with pytest.raises(OffloadError, match="host pool full|the host pool is fixed at"):
        _train(CASES[name], 4, budget=share, host_bytes=_old_default_pool(model))


@pytest.mark.parametrize(("name", "share"), [("mlp", "30%"), ("mlp", "20%"), ("unet-mini", "45%")])
def test_default_pool_grows_and_training_is_bitwise_plain(name, share, fixed_op_times):
    # (fixed op times and a given machine: the plan, and so the pool's peak, is the same
    # however loaded the machine is; with measured times a loaded run planned less host)
    steps = 4
    got = _train(CASES[name], steps, budget=share, hardware="h100-80g-pcie5-nvme")
    stats = got[4]
    assert stats.planned_steps >= 1 and stats.host_pool_peak > _old_default_pool(got[0])
    assert stats.host_pool_bytes >= stats.host_pool_peak and stats.pinned_bytes == 0  # (CPU pins nothing)
    assert_training_equal(got, _train(CASES[name], steps))


def test_pool_is_grown_to_the_plan_s_layout_at_planning():
    # save_on_cpu: a planned plan (every saved activation to the host), laid out ahead
    model, make_batch, loss_fn = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sizes = []
    with offload(model, opt, budget="30%", policy="save_on_cpu") as run:
        for i in range(5):
            x, y = make_batch(i)
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sizes.append((run.stats.replans, run.stats.planned_steps, run._tiers.host.chunk_sizes))
    planned_at = next(i for i, (replans, _, _) in enumerate(sizes) if replans)
    assert sizes[planned_at][1] == 0  # (the plan was made, not yet followed)
    span, largest = run._layout_need["host"]
    assert span > _old_default_pool(model) and sum(sizes[planned_at][2]) >= span
    assert max(sizes[planned_at][2]) >= largest
    # grown before the first planned iteration: the planned ones add no chunk
    assert all(c == sizes[planned_at][2] for _, _, c in sizes[planned_at:])
    assert run.stats.planned_steps >= 3 and run.stats.planned_slots > 0
    assert run.stats.host_pool_bytes == sum(sizes[-1][2])


def test_explicit_host_bytes_is_a_fixed_pool_and_the_ssd_file_grows(tmp_path):
    got = _train(_mlp, 4, budget="30%", host_bytes="2MiB", ssd_dir=str(tmp_path))
    stats = got[4]
    assert stats.host_pool_bytes == 2 * MiB and stats.host_pool_peak <= 2 * MiB
    # the file starts at its old default size (too small here) and grows
    assert stats.ssd_file_bytes > _old_default_pool(got[0]) and stats.planned_steps >= 1
    assert_training_equal(got, _train(_mlp, 4))


def test_fixed_tiers_too_small_fail_at_planning_naming_both(tmp_path):
    with pytest.raises(OffloadError) as err:
        _train(_mlp, 4, budget="30%", host_bytes="2MiB", ssd_dir=str(tmp_path), ssd_bytes="8MiB")
    msg = str(err.value)
    assert "\n" not in msg and "fixed at 2.00 MiB" in msg and "SSD file may grow to 8.00 MiB" in msg
    assert "a larger ssd_bytes, a larger host_bytes, or a larger budget" in msg


# -- the host cannot hold the plan ---------------------------------------------------------


def test_host_too_small_fails_at_planning_with_state_intact(monkeypatch):
    monkeypatch.setattr(tiers, "host_memory_bound", lambda: 4 * MiB)
    model, make_batch, loss_fn = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    done = 0
    with pytest.raises(OffloadError) as err:
        with offload(model, opt, budget="30%") as run:
            for i in range(4):
                x, y = make_batch(i)
                loss_fn(model(x), y).backward()
                opt.step()  # (planning runs at the end of the profiled step)
                opt.zero_grad(set_to_none=True)
                done += 1
    msg = str(err.value)
    assert "\n" not in msg
    assert "needs at least" in msg and "off the device" in msg
    assert f"the host has 4.00 MiB ({4 * MiB} bytes)" in msg  # what the host has for it
    assert msg.endswith("pass ssd_dir= for an SSD tier, or a larger budget")
    assert run.stats.planned_steps == 0
    # the failing step (the profiled one: AdamW's first step is a warm-up) had finished
    # its update when planning failed; nothing else was touched, nothing left off-device
    plain = _train(_mlp, done + 1)
    for p, q in zip(model.parameters(), plain[0].parameters()):
        assert p.untyped_storage().nbytes() == q.untyped_storage().nbytes()
        assert torch.equal(p, q)
        for k, v in plain[1].state[q].items():
            assert torch.equal(opt.state[p][k], v), k


def test_host_too_small_trains_with_an_ssd(monkeypatch, tmp_path):
    monkeypatch.setattr(tiers, "host_memory_bound", lambda: 4 * MiB)
    got = _train(_mlp, 4, budget="30%", ssd_dir=str(tmp_path))
    assert got[4].host_pool_bytes <= 4 * MiB and got[4].planned_steps >= 1
    assert_training_equal(got, _train(_mlp, 4))


def test_planned_plan_over_the_host_fails_at_planning(monkeypatch):
    # a plan made for a bigger host than this one (a callable policy may plan for any
    # machine): its layout does not fit the pool, found before it is followed
    from tierflow.policies import make_plan

    monkeypatch.setattr(tiers, "host_memory_bound", lambda: 4 * MiB)

    def for_a_big_host(trace, hw, budget):
        return make_plan("save_on_cpu", trace, hw.with_tier("host", capacity=float(1 << 40)), budget=budget)

    model, make_batch, loss_fn = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(OffloadError, match=r"^offload: save_on_cpu's plan needs to keep .* \(\d+ bytes\) in the host "
                       r"pool, but the host has 4.00 MiB .*: pass ssd_dir= for an SSD tier, or a larger budget$"):
        with offload(model, opt, budget="30%", policy=for_a_big_host) as run:
            for i in range(4):
                x, y = make_batch(i)
                loss_fn(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    assert run.stats.planned_steps == 0 and run.stats.steps == 2
    plain = _train(_mlp, 2)
    for p, q in zip(model.parameters(), plain[0].parameters()):
        assert torch.equal(p, q)
        for k, v in plain[1].state[q].items():
            assert torch.equal(opt.state[p][k], v), k
