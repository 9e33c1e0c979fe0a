"""Reader for G10's own migration plan, ``prefetch_guide.config`` (platformxlab/G10).

Each line is one hint G10's planner wrote for its simulator::

    Issued Time: 144 Tensor: 873 G:o From: Not_Known, To: In_ssd

How G10's simulator acts on a hint, and how it is expressed here:

* **When.** A hint with issued time ``k`` is acted on as kernel ``k`` begins, before
  that kernel checks its own pages. In tierflow's vocabulary that is "issued when op
  ``k - 1`` ends" (``after_op = k - 1``; ``k = 0`` wraps to the end of the previous
  iteration, which is the same moment in a repeated loop).
* **In_gpu** on a tensor that does not exist yet (at or before its birth) is a
  *pre-allocation*: G10 maps its pages ahead of the kernel to hide a 4-cycles-per-page
  allocation cost. tierflow's simulator allocates at birth for free, so these hints are
  dropped (counted in ``meta``). On a tensor that exists it is a *prefetch*: a reactive
  prefetch (``tier=None``: from wherever the tensor is) needed by the tensor's next use
  at or after ``k``. G10 lets a prefetch evict least recently used pages when the GPU
  is full; so does the simulator for a reactive plan's prefetch.
* **In_ssd / In_cpu** is a *pre-eviction* to the SSD or to host memory: an eviction to
  the machine's ``ssd``-kind or ``host``-kind tier. G10 skips it if the pages are not on
  the GPU; so does the simulator.
* **Not_present** is a *pre-deallocation* at the tensor's death (its last read + 1).
  The simulator frees every tensor after its last use (``frees_dead=True``), which is
  the same moment; the hints are checked against the trace's deaths and counted.
* Whatever the hints miss is faulted in on demand with LRU eviction: G10 runs on UVM,
  so the faithful translation is a **reactive** plan.

Semantic differences that remain (they explain the residual against G10's figure):
G10 is page-granular (a tensor can be partly resident), moves pages in 50-page batches,
and charges a fault with a model fitted to measured page-faulting kernel times, while
tierflow moves whole tensors and charges a fault its latency plus its bytes on the link.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import PlanError
from ..hardware import Hardware
from ..plan import Move, Plan
from ..trace import Trace

_HINT_RE = re.compile(
    r"^Issued Time:\s*(\d+)\s+Tensor:\s*(\d+)\s+G:([ox])\s+From:\s*(\w+),\s*To:\s*(\w+)\s*$"
)
_DESTS = ("In_gpu", "In_ssd", "In_cpu", "Not_present")

# Share of the budget the pager keeps free by background LRU eviction. G10's UVM model
# evicts in the same 50-page batch that brings pages in, so a fault never waits for a
# whole tensor to leave first; tierflow's pager moves whole tensors and would serialise
# "evict, then fetch" on every fault at a full device. A small background headroom is
# the tensor-granular stand-in for that overlap (the same default as ``lru``/``deepum``).
DEFAULT_HEADROOM = 0.0


def _tier_of_kind(hw: Hardware, kind: str) -> str | None:
    for t in hw.tiers:
        if t.kind == kind and t.name != hw.device:
            return t.name
    return None


def load_g10_plan(
    path: str | Path,
    trace: Trace,
    hardware: Hardware,
    budget: float,
    headroom: float = DEFAULT_HEADROOM,
) -> Plan:
    """Read G10's ``prefetch_guide.config`` as a reactive tierflow plan for ``trace``.

    Args:
        path: the ``prefetch_guide.config`` file (one hint per line).
        trace: the G10 case the plan was made for (its kernels are the trace's ops).
        hardware: the machine; pre-evictions go to its ``ssd``-kind and ``host``-kind
            tiers.
        budget: device bytes (``resolve_budget``); G10 planned for 40 GiB.
        headroom: share of the budget the pager keeps free in the background (see
            :data:`DEFAULT_HEADROOM`); 0 makes every fault at a full device wait for
            an eviction first.

    Returns:
        A reactive :class:`Plan` named ``g10-replay``; ``meta`` counts the hints by
        what they became (``prefetch``, ``evict``, ``prealloc_dropped``, ``free``,
        ``free_mismatch``, ``stale_dropped``).

    Raises:
        PlanError: the file is unreadable, a line is not a hint, or a hint names a
            tensor or kernel the trace does not have (file and line named).

    Example:
        >>> plan = load_g10_plan(case / "prefetch_guide.config", trace, hw, 40 * 2**30)
        >>> simulate(trace, hw, plan).ratio  # doctest: +SKIP
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PlanError(f"{path}: cannot read ({e})") from None
    n_ops, n_t = trace.n_ops, trace.n_tensors
    tiers = {"In_ssd": _tier_of_kind(hardware, "ssd"), "In_cpu": _tier_of_kind(hardware, "host")}
    persistent = trace.persistent
    birth, death = trace.birth, trace.death
    counts = dict.fromkeys(
        ("prefetch", "evict", "prealloc_dropped", "free", "free_mismatch", "stale_dropped"), 0
    )
    moves: list[Move] = []
    seen: set[tuple] = set()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        m = _HINT_RE.match(line)
        if not m:
            raise PlanError(f"{path}:{lineno}: not a G10 hint: {line[:80]!r}")
        k, t, glob, dest = int(m.group(1)), int(m.group(2)), m.group(3) == "o", m.group(5)
        if dest not in _DESTS:
            raise PlanError(f"{path}:{lineno}: field 'To' is {dest!r}, expected one of {', '.join(_DESTS)}")
        if not 0 <= t < n_t:
            raise PlanError(f"{path}:{lineno}: tensor {t} does not exist in {trace.name} ({n_t} tensors)")
        # a tensor last read by the last kernel dies "at kernel n": the iteration's end
        last_k = n_ops if dest == "Not_present" else n_ops - 1
        if not 0 <= k <= last_k:
            raise PlanError(f"{path}:{lineno}: issued time {k} is outside kernels 0..{last_k}")
        if glob != bool(persistent[t]):
            raise PlanError(
                f"{path}:{lineno}: tensor {t} is marked G:{m.group(3)} but the trace says "
                f"{'persistent' if persistent[t] else 'not persistent'}: plan and case differ"
            )
        after = (k - 1) % n_ops
        if dest == "Not_present":
            counts["free"] += 1
            if persistent[t] or k != int(death[t]) + 1:
                counts["free_mismatch"] += 1
            continue
        uses = trace.uses(t)
        if dest == "In_gpu":
            if not persistent[t] and k <= int(birth[t]):
                counts["prealloc_dropped"] += 1
                continue
            later = uses[uses >= k]
            if later.size:
                needed = int(later[0])
            elif persistent[t]:
                needed = int(uses[0])  # next iteration
            else:
                counts["stale_dropped"] += 1  # nothing uses it again in its life
                continue
            move = Move("prefetch", t, after, None, needed)
            counts["prefetch"] += 1
        else:
            tier = tiers[dest]
            if tier is None:
                raise PlanError(f"{path}:{lineno}: {dest} but {hardware.name} has no such tier")
            if not persistent[t] and not int(birth[t]) <= after < int(death[t]):
                counts["stale_dropped"] += 1
                continue
            move = Move("evict", t, after, tier)
            counts["evict"] += 1
        key = (move.kind, move.tensor, move.after_op)
        if key not in seen:  # G10 repeats a hint when two passes chose the same one
            seen.add(key)
            moves.append(move)
    return Plan(
        policy="g10-replay",
        moves=tuple(moves),
        budget_bytes=budget,
        reactive=True,
        frees_dead=True,
        headroom=headroom,
        meta={"source": str(path), "hints": counts},
    )
