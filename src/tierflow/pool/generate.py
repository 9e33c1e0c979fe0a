"""Pool problems with a perfect packing by construction: the optimum is the lower bound.

Cut a full rectangle of time x bytes into buffers and every instant is full, so the
busiest instant holds exactly the rectangle's height and the rectangle itself is a
placement at that peak. Two constructions:

* :func:`guillotine`: cut a piece in two, across time or across bytes, until there
  are ``n`` pieces (the piece cut is drawn by area).
* :func:`strips`: stack horizontal strips of random heights, cut each strip across
  time at random instants, and cut some of the resulting pieces once more across bytes.

:func:`with_free_space` removes some buffers while keeping one instant full, so the
optimum still equals the bound but the packing has holes (real pools have free space).

Sizes are multiples of ``unit`` bytes (1 KiB by default). Every function is seeded and
deterministic; each returns the problem and the constructed offsets (a witness).

Example::

    problem, witness = guillotine(300, steps=1000, seed=1)
    assert pool.validate(problem, witness).peak == problem.lower_bound
"""

from __future__ import annotations

import numpy as np

from .problem import Buffer, PoolError, Problem

# (lower, upper, offset, size) in steps and units
_Piece = tuple[int, int, int, int]


def guillotine(n: int, steps: int = 1000, height: int = 1024, unit: int = 1024, seed: int = 0,
               name: str = "") -> tuple[Problem, np.ndarray]:
    """``n`` buffers cut from a full ``steps`` x ``height``-unit rectangle by guillotine cuts.

    Args:
        n: buffers (at least 1).
        steps: time steps of the rectangle.
        height: its height in units.
        unit: bytes per unit.
        seed: the random seed.
        name: the problem's name (default ``guillotine-<n>-<seed>``).

    Raises:
        PoolError: ``n`` cannot be cut from the rectangle (more pieces than cells).
    """
    _check(n, steps, height)
    rng = np.random.default_rng(seed)
    pieces: list[_Piece] = [(0, steps, 0, height)]
    while len(pieces) < n:
        area = np.array([(p[1] - p[0]) * p[3] for p in pieces], dtype=np.float64)
        cuttable = area > 1
        k = int(rng.choice(len(pieces), p=area * cuttable / (area * cuttable).sum()))
        lo, hi, off, size = pieces[k]
        # cut across the longer side more often, so pieces stay varied but not slivers
        across_time = (hi - lo > 1) and (size == 1 or rng.random() < (hi - lo) / (hi - lo + size * steps / height))
        if across_time:
            t = int(rng.integers(lo + 1, hi))
            pieces[k:k + 1] = [(lo, t, off, size), (t, hi, off, size)]
        else:
            s = int(rng.integers(1, size))
            pieces[k:k + 1] = [(lo, hi, off, s), (lo, hi, off + s, size - s)]
    return _build(pieces, unit, name or f"guillotine-{n}-{seed}")


def strips(n: int, steps: int = 1000, height: int = 1024, unit: int = 1024, seed: int = 0,
           name: str = "") -> tuple[Problem, np.ndarray]:
    """About ``n`` buffers from horizontal strips cut across time (module docstring).

    Args:
        n: buffers wanted (the result has exactly ``n``).
        steps, height, unit, seed: as :func:`guillotine`.
        name: default ``strips-<n>-<seed>``.

    Raises:
        PoolError: as :func:`guillotine`.
    """
    _check(n, steps, height)
    rng = np.random.default_rng(seed)
    n_strips = int(max(1, min(height, round(np.sqrt(n) / 2))))
    cuts = np.sort(rng.choice(np.arange(1, height), size=n_strips - 1, replace=False)) if n_strips > 1 else []
    edges = [0, *[int(c) for c in cuts], height]
    pieces: list[_Piece] = [(0, steps, a, b - a) for a, b in zip(edges[:-1], edges[1:])]
    # a quarter of the pieces come from cuts across bytes, the rest across time
    while len(pieces) < n:
        k = int(rng.integers(len(pieces)))
        lo, hi, off, size = pieces[k]
        if rng.random() < 0.75 and hi - lo > 1:
            t = int(rng.integers(lo + 1, hi))
            pieces[k:k + 1] = [(lo, t, off, size), (t, hi, off, size)]
        elif size > 1:
            s = int(rng.integers(1, size))
            pieces[k:k + 1] = [(lo, hi, off, s), (lo, hi, off + s, size - s)]
    return _build(pieces, unit, name or f"strips-{n}-{seed}")


def with_free_space(problem: Problem, witness: np.ndarray, fraction: float = 0.1, seed: int = 0,
                    name: str = "") -> tuple[Problem, np.ndarray]:
    """``problem`` less about ``fraction`` of its buffers, none of those live at one
    busiest instant: the bound stays, the witness (less the same buffers) still meets it.

    Raises:
        PoolError: ``fraction`` outside [0, 1).
    """
    if not 0 <= fraction < 1:
        raise PoolError(f"with_free_space: fraction must be in [0, 1), got {fraction}")
    rng = np.random.default_rng(seed)
    times = np.unique(problem.lower)
    live = np.array([problem.size[(problem.lower <= t) & (problem.upper > t)].sum() for t in times])
    full = int(times[int(np.argmax(live))])
    held = (problem.lower <= full) & (problem.upper > full)
    candidates = np.flatnonzero(~held)
    drop = rng.choice(candidates, size=min(len(candidates), int(round(fraction * len(problem)))), replace=False)
    keep = np.setdiff1d(np.arange(len(problem)), drop)
    out = Problem(tuple(problem.buffers[i] for i in keep.tolist()), name=name or f"{problem.name}-free")
    return out, np.asarray(witness)[keep]


def _check(n: int, steps: int, height: int) -> None:
    if n < 1 or steps < 1 or height < 1:
        raise PoolError(f"generate: n, steps and height must be positive, got {n}, {steps}, {height}")
    if n > steps * height:
        raise PoolError(f"generate: {n} buffers cannot be cut from {steps} x {height} cells")


def _build(pieces: list[_Piece], unit: int, name: str) -> tuple[Problem, np.ndarray]:
    # listed by lifetime and size, not by the witness's offset: a solver that follows
    # the input order must not be handed the answer's stacking (buffers equal in
    # lifetime and size are interchangeable, so the offset among them tells nothing)
    pieces = sorted(pieces, key=lambda p: (p[0], p[1], -p[3], p[2]))
    buffers = tuple(Buffer(str(i), lo, hi, size * unit) for i, (lo, hi, _, size) in enumerate(pieces))
    return Problem(buffers, name=name), np.array([off * unit for _, _, off, _ in pieces], dtype=np.int64)
