"""tierflow.pool.reduce and tierflow.pool.generate: reductions keep the problem, the
generated sets have the perfect packing they claim."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierflow import pool
from tierflow.pool import Buffer, PoolError, Problem, generate
from tierflow.pool.reduce import reduce


@st.composite
def problems(draw, max_n: int = 20):
    n = draw(st.integers(0, max_n))
    scale = draw(st.sampled_from([1, 3, 1024]))
    bufs = []
    for i in range(n):
        lo = draw(st.integers(0, 40)) * draw(st.sampled_from([1, 7]))
        bufs.append(Buffer(str(i), lo, lo + draw(st.integers(1, 15)), draw(st.integers(0, 20)) * scale))
    return Problem(tuple(bufs), alignment=draw(st.sampled_from([1, 1, 4])))


def overlaps(lo_a, hi_a, lo_b, hi_b) -> bool:
    return lo_a < hi_b and lo_b < hi_a


@given(problems())
def test_reduction_keeps_every_overlap(p):
    red = reduce(p)
    kept = set(red.keep.tolist())
    nonempty = [i for i in range(len(p)) if p.units[i] > 0]
    for x, i in enumerate(red.keep.tolist()):
        for y, j in enumerate(red.keep.tolist()):
            assert overlaps(p.lower[i], p.upper[i], p.lower[j], p.upper[j]) == overlaps(
                red.lower[x], red.upper[x], red.lower[y], red.upper[y])
    for i in set(nonempty) - kept:  # set aside: alone in time
        assert not any(overlaps(p.lower[i], p.upper[i], p.lower[j], p.upper[j]) for j in nonempty if j != i)


@given(problems())
def test_reduction_scales_sizes_and_bound(p):
    red = reduce(p)
    assert np.array_equal(red.size * red.gcd, p.units[red.keep])
    assert red.lower_bound * red.gcd <= pool.lower_bound(p, units=True)
    aside = np.setdiff1d(np.arange(len(p)), red.keep)
    assert max(red.lower_bound * red.gcd, int(p.units[aside].max(initial=0))) == pool.lower_bound(p, units=True)


@given(problems())
def test_expand_of_a_reduced_placement_is_valid(p):
    """Stacking the kept buffers in reduced units and expanding gives a valid placement
    of the whole problem, with the set-aside buffers at 0."""
    red = reduce(p)
    stacked = np.concatenate([[0], np.cumsum(red.size)[:-1]]).astype(np.int64) if len(red) else np.zeros(0, np.int64)
    offsets = red.expand(stacked)
    assert pool.validate(p, offsets).valid
    assert np.array_equal(red.restrict(offsets), stacked)


@given(problems())
def test_equal_buffers_are_chained(p):
    red = reduce(p)
    for chain in red.chains:
        assert len(chain) >= 2
        keys = {(int(red.lower[i]), int(red.upper[i]), int(red.size[i])) for i in chain}
        assert len(keys) == 1
    in_chains = [i for c in red.chains for i in c]
    assert len(in_chains) == len(set(in_chains))
    keys = [(int(a), int(b), int(c)) for a, b, c in zip(red.lower, red.upper, red.size)]
    for i, k in enumerate(keys):  # every buffer with a twin is in some chain
        if keys.count(k) > 1:
            assert i in in_chains


def test_restrict_refuses_offsets_off_the_grid():
    p = Problem((Buffer("a", 0, 2, 2048), Buffer("b", 1, 3, 1024)))
    red = reduce(p)
    assert red.gcd == 1024
    assert red.restrict(np.array([0, 2048])).tolist() == [0, 2]
    assert red.restrict(np.array([0, 2050])) is None


@pytest.mark.parametrize("make", [generate.guillotine, generate.strips])
@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 60), steps=st.integers(1, 50), seed=st.integers(0, 5))
def test_generated_sets_have_a_perfect_packing(make, n, steps, seed):
    n = min(n, steps * 16)
    p, witness = make(n, steps=steps, height=16, seed=seed)
    assert len(p) == n
    assert np.all(p.size % 1024 == 0)
    report = pool.validate(p, witness)
    assert report.valid and report.peak == p.lower_bound == 16 * 1024


@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 60), seed=st.integers(0, 5), fraction=st.floats(0, 0.5))
def test_free_space_keeps_the_bound_and_the_witness(n, seed, fraction):
    p, witness = generate.guillotine(n, steps=30, height=16, seed=seed)
    q, w = generate.with_free_space(p, witness, fraction, seed=seed)
    assert len(q) <= len(p)
    report = pool.validate(q, w)
    assert report.valid and report.peak == q.lower_bound == p.lower_bound


@pytest.mark.parametrize("make", [generate.guillotine, generate.strips])
def test_generated_sets_do_not_list_buffers_in_the_witness_order(make):
    # among buffers of one lifetime, larger first whatever their offsets in the witness
    p, _ = make(120, steps=40, height=64, seed=2)
    for a, b in zip(p.buffers, p.buffers[1:]):
        if (a.lower, a.upper) == (b.lower, b.upper):
            assert a.size >= b.size


def test_generate_rejects_impossible_requests():
    with pytest.raises(PoolError, match="cannot be cut"):
        generate.guillotine(100, steps=2, height=3)
    with pytest.raises(PoolError, match="fraction"):
        generate.with_free_space(*generate.strips(4, steps=4, height=4), fraction=1.0)
