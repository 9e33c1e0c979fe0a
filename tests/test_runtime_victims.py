"""The pager's victims while a plan is followed: every resident tensor in the order of
the trace's next use, furthest first (Belady), ties in least recently used order, found
with a bisect on each tensor's uses as a Python list (``follow._next_uses``) instead of
a numpy search per tensor."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tierflow.runtime import follow, train
from tierflow.runtime.executor import Run

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def _reference(uses: list[list[int]], tid: int, persistent: bool, now: int, n: int) -> float:
    """The per-tensor search the pager used to run (a key function per candidate)."""
    if not 0 <= tid < len(uses):
        return math.inf
    u = np.asarray(uses[tid], dtype=np.int64)
    j = int(np.searchsorted(u, now, side="right"))
    if j < len(u):
        return float(u[j])
    return float(u[0] + n) if persistent and len(u) else math.inf


def test_next_uses_match_a_search_per_tensor():
    """Random traces: for every tensor, persistent or not, unknown (-1, or past the
    trace's tensors) or unused, at every op, the lookup gives the per-tensor search's answer exactly."""
    rng = np.random.default_rng(7)
    for _ in range(30):
        n = int(rng.integers(1, 40))
        uses = [sorted(set(rng.integers(0, n, size=int(rng.integers(0, 6))).tolist())) for _t in range(25)]
        tids = list(range(len(uses))) + [-1, -1, len(uses)]
        persistent = (rng.random(len(tids)) < 0.5).tolist()
        for now in range(n):
            got = follow._next_uses(uses, n, tids, persistent, now)
            want = [_reference(uses, t, p, now, n) for t, p in zip(tids, persistent)]
            assert got == want, (uses, now)


def test_victims_are_belady_order_with_ties_least_recently_used(monkeypatch):
    """In a planned run that makes room beyond its plan (gpt-tiny at 30%), every call
    to ``_victims`` returns the order the per-tensor key sort gives: the trace's next use
    furthest first, equal next uses in the pager's least recently used order."""
    calls = []
    real = Run._victims

    def checked(self, pinned):
        got = real(self, pinned)
        if self._in_iter and self._planned and not self._stale:
            cands = [e for c, e in self._lru.items() if c not in pinned]
            trace, n = self.trace, self.trace.n_ops
            uses = [trace.uses(t).tolist() for t in range(trace.n_tensors)]

            def key(e):
                tid = self._key_tid.get(e.key) if e.persistent else self._iter_tid.get(e.cdata)
                return _reference(uses, -1 if tid is None else tid, e.persistent, self._op, n)

            want = sorted(cands, key=key, reverse=True)
            assert [e.cdata for e in got] == [e.cdata for e in want]
            calls.append(len(got))
        return got

    monkeypatch.setattr(Run, "_victims", checked)
    res = train("gpt-tiny", budget="30%", steps=4)
    assert res.stats.planned_steps >= 2
    assert calls and max(calls) > 10  # (it chose among many resident tensors)
