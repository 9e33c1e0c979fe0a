"""Compiled inner loops of the pool solvers: numba when it is importable, else the same
code run by the interpreter (correct, but about two hundred times slower: 1.8 against
330 thousand search nodes per CPU second on MiniMalloc's case G).

Only :mod:`.best` and :mod:`.search` import this module, and only when they run, so
``import tierflow`` and the CLI never load numba. The functions take flat integer
arrays and no Python objects, which is what lets numba compile them; compiled code is
cached on disk (``cache=True``), so only the first run on a machine pays the JIT.
Set ``TIERFLOW_NO_NUMBA=1`` to force the interpreted path (the tests do, to check it).
Nothing here reads the clock: the search runs in node budgets and returns, so the
caller checks its deadline between calls and results depend on node counts only.

Time inside the search is measured in *sections*: the elementary intervals between
consecutive lifetime boundaries. A buffer covers sections ``[s0, s1)``.
"""

from __future__ import annotations

import os

import numpy as np

try:
    if os.environ.get("TIERFLOW_NO_NUMBA"):
        raise ImportError("TIERFLOW_NO_NUMBA is set")
    import numba

    HAVE_NUMBA = True
    # nogil: the search may run in one thread while CP-SAT (the ladder) runs in another
    jit = numba.njit(cache=True, nogil=True)
except ImportError:
    HAVE_NUMBA = False

    def jit(f):
        return f


_INF = np.int64(2**62)

# run() return codes
FOUND, EXHAUSTED, PAUSED, GROW = 1, 0, 2, 3
# ctl fields (the search state between calls of run())
C_DEPTH, C_PTOP, C_STOP, C_CTOP, C_NODES, C_PAUSE, C_ACTION, C_A, C_Z, C_CUR, C_RANK, C_R, C_POOL = range(13)
CTL_SIZE = 13
# actions
_ENTER, _NEXT, _RETURN = 0, 1, 2
# frame fields
F_KIND, F_RA, F_RZ, F_CUR, F_RANK, F_P0, F_PN, F_S0, F_C0, F_CN, F_J, F_PLACED, F_HATLESS = range(13)
FRAME_SIZE = 13


@jit
def run(s0, s1, sz, wide, area, keys3, cap, strong_limit,
        rank, minoff, placed, offsets, total, floor, fr, pbuf, mbuf, rbuf, sbuf_t, sbuf_f, cbuf, ctl):  # fmt: skip
    """Run the canonical branch and bound (rules in :mod:`.search`) until it decides
    or ``ctl[C_NODES]`` reaches ``ctl[C_PAUSE]``. Start it with every buffer in
    ``pbuf[:n]``, sorted by first section, ``ctl[C_PTOP] = ctl[C_Z] = n`` and
    ``ctl[C_CUR] = ctl[C_RANK] = -1`` (the root node's source slice and position).

    The search is a depth-first walk with an explicit stack, so it can stop and resume:
    every bit of its state lives in the arrays passed in. ``fr`` holds one row per open
    node; the other pools are stacks that nodes take slices of: ``pbuf`` the node's
    unplaced buffers and ``mbuf`` their floors on entry, ``sbuf_t``/``sbuf_f`` the
    section totals and placed tops on entry, ``rbuf`` their preorder ranks on entry,
    ``cbuf`` its candidates (or, for a node that split into independent groups, the
    groups' section ranges).

    A group split off is a problem of its own, so it gets a fresh preorder, as at the
    root: by the keys ``keys3`` (most significant first; 0 the most units live in any
    of the buffer's sections *now*, 1 ``wide`` sections spanned, 2 ``area``, all
    descending), which puts the buffers of the group's current bottleneck first.

    Returns FOUND (``offsets`` holds the placement), EXHAUSTED (no placement within
    ``cap``: the canonical space is empty), PAUSED (the node budget ran out; call again
    with a larger ``ctl[C_PAUSE]`` to go on) or GROW (the pool ``ctl[C_POOL]`` is full:
    enlarge it, keeping its contents, and call again).
    """
    big = np.int64(len(sz) + 1)
    while True:
        act = ctl[C_ACTION]
        if act == _ENTER:
            # the node's buffers: the unplaced ones of a slice of the pool (the parent's
            # part, or one group of it), which is sorted by first section
            i0 = ctl[C_A]
            i1 = ctl[C_Z]
            cur = ctl[C_CUR]
            ptop = ctl[C_PTOP]
            if ptop + (i1 - i0) > len(pbuf):
                ctl[C_POOL] = 1
                return GROW
            cnt = 0
            for k in range(i0, i1):
                b = pbuf[k]
                if not placed[b]:
                    pbuf[ptop + cnt] = b
                    cnt += 1
            if cnt == 0:
                ctl[C_R] = 1
                ctl[C_ACTION] = _RETURN
                continue
            ra = s0[pbuf[ptop]]
            rz = 0
            width = 0
            for k in range(ptop, ptop + cnt):
                b = pbuf[k]
                if s1[b] > rz:
                    rz = s1[b]
                width += s1[b] - s0[b]
            stop = ctl[C_STOP]
            ctop = ctl[C_CTOP]
            if stop + (rz - ra) > len(sbuf_t):
                ctl[C_POOL] = 2
                return GROW
            if ctop + 2 * cnt > len(cbuf):
                ctl[C_POOL] = 3
                return GROW
            d = ctl[C_DEPTH]
            for k in range(ptop, ptop + cnt):
                mbuf[k] = minoff[pbuf[k]]
            sbuf_t[stop : stop + rz - ra] = total[ra:rz]
            sbuf_f[stop : stop + rz - ra] = floor[ra:rz]
            fr[d, F_RA] = ra
            fr[d, F_RZ] = rz
            fr[d, F_CUR] = cur
            fr[d, F_RANK] = ctl[C_RANK]
            fr[d, F_P0] = ptop
            fr[d, F_PN] = cnt
            fr[d, F_S0] = stop
            fr[d, F_C0] = ctop
            fr[d, F_J] = 0
            fr[d, F_PLACED] = -1
            # split into groups with disjoint lifetimes (the part is sorted by start)
            ng = 0
            reach = s1[pbuf[ptop]]
            gstart = ptop
            for k in range(ptop + 1, ptop + cnt + 1):
                if k == ptop + cnt or s0[pbuf[k]] >= reach:
                    gz = reach
                    # crowding of the group: its fullest section, placed tops included
                    worst = 0
                    for s in range(s0[pbuf[gstart]], gz):
                        if floor[s] + total[s] > worst:
                            worst = floor[s] + total[s]
                    cbuf[ctop + 2 * ng] = gstart
                    cbuf[ctop + 2 * ng + 1] = worst
                    ng += 1
                    gstart = k
                    if k < ptop + cnt:
                        reach = s1[pbuf[k]]
                elif s1[pbuf[k]] > reach:
                    reach = s1[pbuf[k]]
            if ng > 1:
                # each group is solved on its own, the most crowded first (the likeliest
                # to fail); one that fails fails this node without retrying the others
                keys = np.empty(ng, np.int64)
                starts = np.empty(ng + 1, np.int64)
                for g in range(ng):
                    starts[g] = cbuf[ctop + 2 * g]
                    keys[g] = -cbuf[ctop + 2 * g + 1]
                starts[ng] = ptop + cnt
                for k in range(ptop, ptop + cnt):
                    rbuf[k] = rank[pbuf[k]]
                for g in range(ng):
                    _rerank(pbuf[starts[g] : starts[g + 1]], s0, s1, wide, area, keys3, total, rank)
                srt = np.argsort(keys, kind="mergesort")
                for g in range(ng):
                    cbuf[ctop + 2 * g] = starts[srt[g]]
                    cbuf[ctop + 2 * g + 1] = starts[srt[g] + 1]
                fr[d, F_KIND] = 1
                fr[d, F_CN] = ng
                ctl[C_DEPTH] = d + 1
                ctl[C_PTOP] = ptop + cnt
                ctl[C_STOP] = stop + rz - ra
                ctl[C_CTOP] = ctop + 2 * ng
                fr[d, F_J] = 1
                ctl[C_A] = cbuf[ctop]
                ctl[C_Z] = cbuf[ctop + 1]
                ctl[C_CUR] = -1
                ctl[C_RANK] = -1
                ctl[C_ACTION] = _ENTER
                continue
            # section inference: a section's unplaced buffers stack above the lowest
            # floor among them (and above cur: offsets never decrease), so that plus
            # their total must fit. The floor is the lowest minimum offset of the
            # section's unplaced buffers when that is cheap to gather, else the top of
            # the placed ones (weaker, O(sections)).
            ok = True
            most = 0
            if width <= strong_limit:
                base = np.full(rz - ra, _INF, np.int64)
                if width <= 12 * (cnt + rz - ra):
                    for k in range(ptop, ptop + cnt):
                        b = pbuf[k]
                        m = minoff[b]
                        for s in range(s0[b], s1[b]):
                            if m < base[s - ra]:
                                base[s - ra] = m
                else:
                    # long lifetimes: paint sections lowest floor first, each section
                    # once (a union-find skips painted runs): O(p log p + sections)
                    vals = np.empty(cnt, np.int64)
                    for k in range(cnt):
                        vals[k] = minoff[pbuf[ptop + k]]
                    nxt = np.arange(rz - ra + 1)
                    for k in np.argsort(vals):
                        b = pbuf[ptop + k]
                        x = _find(nxt, s0[b] - ra)
                        while x < s1[b] - ra:
                            base[x] = vals[k]
                            nxt[x] = x + 1
                            x = _find(nxt, x + 1)
                for s in range(ra, rz):
                    t = total[s]
                    if t > 0:
                        f = max(base[s - ra], cur)
                        if f + t > cap:
                            ok = False
                            break
                        most = max(most, t)
            else:
                for s in range(ra, rz):
                    t = total[s]
                    if t > 0:
                        if max(floor[s], cur) + t > cap:
                            ok = False
                            break
                        most = max(most, t)
            nc = 0
            if ok:
                # candidates: canonical (offsets never decrease; preorder on ties),
                # dominance (a buffer at or above the lowest top any unplaced buffer
                # can reach would leave a hole that buffer fits in), and room for the
                # most crowded section above the offset
                minh = _INF
                for k in range(ptop, ptop + cnt):
                    b = pbuf[k]
                    minh = min(minh, minoff[b] + sz[b])
                keys = np.empty(cnt, np.int64)
                for k in range(ptop, ptop + cnt):
                    b = pbuf[k]
                    m = minoff[b]
                    if m >= minh or m + most > cap:
                        continue
                    if m > cur or (m == cur and rank[b] > ctl[C_RANK]):
                        cbuf[ctop + nc] = b
                        keys[nc] = m * big + rank[b]
                        nc += 1
            if nc == 0:
                ctl[C_R] = 0
                ctl[C_ACTION] = _RETURN
                continue
            # sort by (floor, rank): insertion sort for the usual few candidates
            if nc <= 32:
                for k in range(1, nc):
                    kk = keys[k]
                    kb = cbuf[ctop + k]
                    i = k - 1
                    while i >= 0 and keys[i] > kk:
                        keys[i + 1] = keys[i]
                        cbuf[ctop + i + 1] = cbuf[ctop + i]
                        i -= 1
                    keys[i + 1] = kk
                    cbuf[ctop + i + 1] = kb
            else:
                srt = np.argsort(keys[:nc])
                tmp = cbuf[ctop : ctop + nc].copy()
                for k in range(nc):
                    cbuf[ctop + k] = tmp[srt[k]]
            fr[d, F_KIND] = 0
            fr[d, F_CN] = nc
            ctl[C_DEPTH] = d + 1
            ctl[C_PTOP] = ptop + cnt
            ctl[C_STOP] = stop + rz - ra
            ctl[C_CTOP] = ctop + nc
            ctl[C_ACTION] = _NEXT
            continue

        d = ctl[C_DEPTH] - 1
        if act == _NEXT:
            # try the frame's next candidate, undoing the previous one first
            p0 = fr[d, F_P0]
            pn = fr[d, F_PN]
            ra = fr[d, F_RA]
            rz = fr[d, F_RZ]
            st = fr[d, F_S0]
            c = fr[d, F_PLACED]
            if c >= 0:
                placed[c] = False
                for k in range(p0, p0 + pn):
                    minoff[pbuf[k]] = mbuf[k]
                total[ra:rz] = sbuf_t[st : st + rz - ra]
                floor[ra:rz] = sbuf_f[st : st + rz - ra]
                fr[d, F_PLACED] = -1
            j = fr[d, F_J]
            if j == fr[d, F_CN]:
                _pop(fr, d, ctl)
                ctl[C_R] = 0
                ctl[C_ACTION] = _RETURN
                continue
            if ctl[C_NODES] >= ctl[C_PAUSE]:
                return PAUSED
            ctl[C_NODES] += 1
            c = cbuf[fr[d, F_C0] + j]
            fr[d, F_J] = j + 1
            o = minoff[c]
            h = o + sz[c]
            offsets[c] = o
            placed[c] = True
            fr[d, F_PLACED] = c
            for s in range(s0[c], s1[c]):
                total[s] -= sz[c]
                if floor[s] < h:
                    floor[s] = h
            # the unplaced buffers alive with c all lie in this node's part
            raised = 0
            for k in range(p0, p0 + pn):
                b = pbuf[k]
                if s0[b] >= s1[c]:
                    break
                if s1[b] > s0[c] and minoff[b] < h and not placed[b]:
                    minoff[b] = h
                    raised += 1
            fr[d, F_HATLESS] = raised == 0
            ctl[C_A] = p0
            ctl[C_Z] = p0 + pn
            ctl[C_CUR] = o
            ctl[C_RANK] = rank[c]
            ctl[C_ACTION] = _ENTER
            continue

        # _RETURN: hand the result ctl[C_R] to the frame below
        r = ctl[C_R]
        if d < 0:
            return FOUND if r == 1 else EXHAUSTED
        if fr[d, F_KIND] == 0:
            if r == 1:
                _pop(fr, d, ctl)  # keep the placement; the frames below succeed too
            else:
                if fr[d, F_HATLESS]:
                    # MiniMalloc's hatless pruning: the candidate just tried raised no
                    # other floor, so it fits under any completion; the rest failed with
                    # it, and would fail after any other first choice too
                    fr[d, F_J] = fr[d, F_CN]
                ctl[C_ACTION] = _NEXT
            continue
        if r == 1:
            j = fr[d, F_J]
            if j == fr[d, F_CN]:
                _pop(fr, d, ctl)
                continue
            c0 = fr[d, F_C0]
            fr[d, F_J] = j + 1
            ctl[C_A] = cbuf[c0 + 2 * j]
            ctl[C_Z] = cbuf[c0 + 2 * j + 1]
            ctl[C_CUR] = -1
            ctl[C_RANK] = -1
            ctl[C_ACTION] = _ENTER
            continue
        # a group failed: undo the groups placed before it and fail the node
        p0 = fr[d, F_P0]
        ra = fr[d, F_RA]
        rz = fr[d, F_RZ]
        st = fr[d, F_S0]
        for k in range(p0, p0 + fr[d, F_PN]):
            placed[pbuf[k]] = False
            minoff[pbuf[k]] = mbuf[k]
            rank[pbuf[k]] = rbuf[k]
        total[ra:rz] = sbuf_t[st : st + rz - ra]
        floor[ra:rz] = sbuf_f[st : st + rz - ra]
        _pop(fr, d, ctl)
        continue


@jit
def _find(nxt, x):
    """Root of ``x`` in the union-find ``nxt`` (the next unpainted section), with path
    compression."""
    r = x
    while nxt[r] != r:
        r = nxt[r]
    while nxt[x] != r:
        y = nxt[x]
        nxt[x] = r
        x = y
    return r


@jit
def _rerank(group, s0, s1, wide, area, keys3, total, rank):
    """Give ``group`` ranks 0.. in the preorder by ``keys3`` (see :func:`run`)."""
    m = len(group)
    tot = np.zeros(m, np.int64)
    for i in range(m):
        b = group[i]
        for s in range(s0[b], s1[b]):
            if total[s] > tot[i]:
                tot[i] = total[s]
    idx = np.arange(m)
    for q in range(len(keys3) - 1, -1, -1):  # least significant key first, stable sorts
        kq = keys3[q]
        key = np.empty(m, np.int64)
        for i in range(m):
            b = group[idx[i]]
            key[i] = -(tot[idx[i]] if kq == 0 else (wide[b] if kq == 1 else area[b]))
        idx = idx[np.argsort(key, kind="mergesort")]
    for i in range(m):
        rank[group[idx[i]]] = i


@jit
def _pop(fr, d, ctl):
    """Close frame ``d`` (the top one), releasing its slices of the pools."""
    ctl[C_DEPTH] = d
    ctl[C_PTOP] = fr[d, F_P0]
    ctl[C_STOP] = fr[d, F_S0]
    ctl[C_CTOP] = fr[d, F_C0]


@jit
def lowest_first(s0, s1, sz, rank, by_s0, first_at):
    """The first leaf of the canonical search without a capacity: repeatedly place the
    unplaced buffer with the lowest floor (lowest rank on ties). O(n^2) simple steps,
    no pair lists, so it scales to tens of thousands of buffers. Returns offsets."""
    n = len(sz)
    minoff = np.zeros(n, np.int64)
    offsets = np.zeros(n, np.int64)
    placed = np.zeros(n, np.bool_)
    for _ in range(n):
        best = -1
        for b in range(n):
            if placed[b]:
                continue
            if best < 0 or minoff[b] < minoff[best] or (minoff[b] == minoff[best] and rank[b] < rank[best]):
                best = b
        o = minoff[best]
        h = o + sz[best]
        offsets[best] = o
        placed[best] = True
        # buffers alive with best start before it ends
        for k in range(0, first_at[s1[best]]):
            b = by_s0[k]
            if s1[b] > s0[best] and not placed[b] and minoff[b] < h:
                minoff[b] = h
    return offsets



@jit
def min_conflicts(sz, ptr, adj, rev, cap, off, w, conf, tabu, iters, seed, tenure, prof):
    """Weighted min-conflicts moves at a fixed capacity (:mod:`.descent`), ``iters`` of
    them or until no two time neighbours overlap; returns the bytes (units) of overlap
    left, summed over overlapping pairs (0: ``off`` is a placement under ``cap``).

    ``off`` (every ``off[i] <= cap - sz[i]``), the edge weights ``w`` (CSR order, with
    ``rev[k]`` the edge back) and ``conf`` (per buffer, weighted overlap with its
    neighbours; recomputed here) carry the state between calls. A move picks a random
    buffer that overlaps a neighbour and is not tabu, and puts it at the offset where
    its weighted overlap is least (ties at random): the overlap as a function of the
    offset is piecewise linear, so one pass of second differences over ``prof`` (at
    least ``cap + 2 * max(sz) + 4`` long) gives it at every offset. When no offset is
    better than where the buffer is, the weights of its overlapping pairs grow by one:
    the overlaps that keep coming back get dearer, which walks the search out of its
    local minima (guided local search).
    """
    np.random.seed(seed)
    n = len(sz)
    smax = np.int64(0)
    for i in range(n):
        smax = max(smax, sz[i])
    base = smax + 1
    raw = np.int64(0)
    for i in range(n):
        conf[i] = 0
        tabu[i] = 0
    for i in range(n):
        for k in range(ptr[i], ptr[i + 1]):
            j = adj[k]
            ov = min(off[i] + sz[i], off[j] + sz[j]) - max(off[i], off[j])
            if ov > 0:
                conf[i] += w[k] * ov
                if i < j:
                    raw += ov
    cand = np.empty(n, dtype=np.int64)
    for it in range(iters):
        if raw == 0:
            return raw, it
        nc = 0
        for i in range(n):
            if conf[i] > 0 and tabu[i] <= it:
                cand[nc] = i
                nc += 1
        if nc == 0:  # every overlapping buffer is tabu: take any of them
            for i in range(n):
                if conf[i] > 0:
                    cand[nc] = i
                    nc += 1
        i = cand[np.random.randint(nc)]
        si = sz[i]
        cur = off[i]
        top = base + cap - si
        for p in range(top + 1):
            prof[p] = 0
        for k in range(ptr[i], ptr[i + 1]):
            j = adj[k]
            a = off[j]
            sj = sz[j]
            m = min(si, sj)
            # overlap of [o, o + si) with [a, a + sj): rises from o = a - si to a plateau
            # of m, falls to 0 at o = a + sj; second differences at its four bends
            for p, d in ((a - si + 1, w[k]), (a - si + m + 1, -w[k]), (a + sj - m + 1, -w[k]), (a + sj + 1, w[k])):
                if base + p <= top:
                    prof[base + p] += d
        slope = np.int64(0)
        val = np.int64(0)
        best = np.int64(1) << 62
        bo = cur
        ties = 0
        for p in range(top + 1):
            slope += prof[p]
            val += slope
            o = p - base
            if o >= 0 and o != cur:
                if val < best:
                    best, bo, ties = val, o, 1
                elif val == best:
                    ties += 1
                    if np.random.randint(ties) == 0:
                        bo = o
        if best >= conf[i]:
            for k in range(ptr[i], ptr[i + 1]):
                j = adj[k]
                ov = min(cur + si, off[j] + sz[j]) - max(cur, off[j])
                if ov > 0:
                    w[k] += 1
                    w[rev[k]] += 1
                    conf[i] += ov
                    conf[j] += ov
        if best <= conf[i]:
            for k in range(ptr[i], ptr[i + 1]):
                j = adj[k]
                a = off[j]
                sj = sz[j]
                ov0 = max(np.int64(0), min(cur + si, a + sj) - max(cur, a))
                ov1 = max(np.int64(0), min(bo + si, a + sj) - max(bo, a))
                if ov0 != ov1:
                    conf[i] += w[k] * (ov1 - ov0)
                    conf[j] += w[k] * (ov1 - ov0)
                    raw += ov1 - ov0
            off[i] = bo
            tabu[i] = it + tenure + np.random.randint(tenure + 1)
    return raw, iters
