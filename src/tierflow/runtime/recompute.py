"""Executing the plan's recompute chains: drop an activation after its last forward use,
re-make it bitwise before backward needs it.

The mechanism, and why. A chain (:class:`tierflow.plan.Recompute`) names the tensors it
re-creates, the forward ops that make them, and the op before which they must be back.
The runtime works on storages, as it does for moves: after the tensor's last use before
``before_op`` its storage is shrunk to zero bytes (``untyped_storage().resize_(0)``,
like an eviction with no copy), so the saved tensor autograd holds stays a valid object
and the memory is gone; before ``before_op`` the chain's ops run again and the re-made
bytes go back into the same storage (its memory swapped in where torch can, else
copied), so autograd and every view of it see the values they saw in forward. No module
is wrapped and no graph changes: the user's model and loop are untouched, and nothing
has to be undone on exit. (PyTorch's
``torch.utils.checkpoint`` and its selective variant re-run a *module's* forward under
saved-tensor hooks; a plan's chain is a list of aten ops that need not match a module,
so the ops themselves are recorded and replayed.)

Recording. While a planned iteration runs forward, each op of a chain is recorded as it
runs: the op, its arguments with every tensor an earlier op of the chain made replaced
by a reference to that op's result (those are re-made, never held), the other tensors
(the chain's inputs: parameters, the block's input) held until the chain has run, and,
for an op that draws random numbers (``torch.Tag.nondeterministic_seeded``: dropout),
the CPU and CUDA generator states just before it. (Decided here, from the op itself,
not from the trace's ``Op.rng``/``Op.pure``, which the profiled iteration records for
the planners: a chain replays bitwise whatever a plan's trace says.) A tensor is dropped only if the op
that made it was recorded; a replay runs what was recorded, in order.

Replay. Under ``torch.no_grad()``, each op runs on the re-made values, with the random
state it first ran with; the generators' states are put back afterwards, so the
program's random stream is unchanged. An op that writes one of its arguments in place
(training-mode BatchNorm's running statistics) writes a copy: the argument is restored
after the op, so the statistics are updated once per step, as without tierflow (the
``checkpoint`` and ``selective`` policies model ``torch.utils.checkpoint``, which
updates them twice; the runtime keeps plain PyTorch's result). Replayed results that are
not re-made tensors are temporaries, let go after the last step that reads them.

Correctness first: an op (or autograd unpacking a saved tensor) that needs a dropped
tensor earlier than planned re-makes its chain on the spot, as a fetch would.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from ..capture.opflags import writes
from .errors import OffloadError
from .storages import RESIDENT, StorageTable, _Entry, _u8

if TYPE_CHECKING:
    from .ledger import DeviceLedger
    from .stats import RunStats
    from .streams import Copier

DROPPED = "dropped"


@dataclass
class _Made:
    """A reference, in a recorded op's arguments, to a result of an earlier op of the
    chain: result ``leaf`` of recorded op ``step``."""

    step: int
    leaf: int


@dataclass(slots=True)
class _Step:
    """One recorded op of a chain, laid out for its replay.

    NOTE: the arguments are kept flat, with the slots an earlier step's result goes in:
    walking a pytree per replayed op (map, then leaves) cost two thirds of a replay."""

    func: Any
    vals: list  # the arguments' leaves; a _Made where an earlier step's result goes
    spec: Any  # their pytree spec; None: ``vals`` are the positional arguments, no kwargs
    made_at: tuple[tuple[int, _Made], ...]  # (index in vals, reference)
    states: Any  # the random generators' states before it, if it draws
    out_bytes: int  # what it makes: new storages only


def _step(func: Any, args: tuple, kwargs: dict, ref: Any, states: Any, out_bytes: int) -> _Step:
    """A :class:`_Step` for ``func(*args, **kwargs)``; ``ref`` maps each tensor argument
    to itself or to a :class:`_Made`."""
    if not kwargs and not any(isinstance(a, (list, tuple, dict)) for a in args):
        vals, spec = [ref(a) if isinstance(a, torch.Tensor) else a for a in args], None
    else:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        vals = [ref(a) if isinstance(a, torch.Tensor) else a for a in leaves]
    made_at = tuple((j, v) for j, v in enumerate(vals) if isinstance(v, _Made))
    return _Step(func, vals, spec, made_at, states, out_bytes)


def _out_leaves(out: Any) -> list:
    """An op's results, in the order recording and replay both number them."""
    if out.__class__ is torch.Tensor:
        return [out]
    if out.__class__ in (tuple, list) and all(x.__class__ is torch.Tensor for x in out):
        return list(out)
    return pytree.tree_leaves(out)


@dataclass
class _Chain:
    """One Recompute of the plan, and what this iteration recorded of it."""

    ops: tuple[int, ...]
    tensors: tuple[int, ...]
    before_op: int
    recipe: list[_Step] = field(default_factory=list)
    made: dict[int, tuple[int, int, Any]] = field(default_factory=dict)  # id(tensor) -> (step, leaf, weakref)
    source: dict[int, tuple[int, int]] = field(default_factory=dict)  # tensor id -> (step, leaf)
    dropped: list[tuple[_Entry, tuple[int, int]]] = field(default_factory=list)  # (entry, its source)

    @property
    def complete(self) -> bool:
        return len(self.recipe) == len(self.ops)

    def reset(self) -> None:
        self.recipe, self.made, self.source, self.dropped = [], {}, {}, []


def rng_states(device: torch.device) -> tuple[Any, Any]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_states(states: tuple[Any, Any], device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


class Recomputer:
    """The plan's recompute chains, executed: what each iteration records of them, the
    storages dropped now, and their replays. One per plan (the plan cache keeps each
    plan's, :mod:`.signatures`); it owns its tables and chains, and is the one writer of
    the ``RunStats`` recompute counters (``dropped_bytes``, ``skipped_drops``,
    ``early_recomputes``, ``recomputed_ops``, ``recompute_s``).

    Args:
        storages: the run's storage records (which entry a tensor is, the iteration's
            trace ids; a dropped storage leaves the LRU order, a re-made one rejoins it).
        ledger: the device bytes (a drop takes its bytes off, a replay puts them back).
        copier: the copy layer (a drop waits for a copy still writing the storage).
        stats: the run's stats.
        device: the run's device.
        make_room: ``make_room(bytes, keep)``: evict until that many more bytes fit,
            never what ``keep`` holds (the run's mover, ``Moves._make_room``).
        ensure_resident: bring an away or arriving storage back (the run's mover; a
            chain input that is itself away).

    Example:
        >>> # inside a run, each new plan gets its own (profiling.Profiling._make_plan):
        >>> # run._recomputer = run._recomputer.for_plan(trace, plan)
    """

    def __init__(self, storages: StorageTable, ledger: DeviceLedger, copier: Copier, stats: RunStats,
                 device: torch.device, *, make_room: Callable[[int, list[_Entry]], None],
                 ensure_resident: Callable[[_Entry], None]) -> None:
        self._storages, self._ledger, self._copier, self._stats = storages, ledger, copier, stats
        self._device = device
        self._dev_attr = "is_cuda" if device.type == "cuda" else "is_cpu"
        self._make_room, self._ensure_resident = make_room, ensure_resident
        self._chains: list[_Chain] = []
        # per op: the chains it records for, the tensors dropped after it, the chains
        # re-made before it, and whether any of those (the lean path reads them per op)
        self.chain_ops: list[tuple[int, ...]] = []
        self.drops: list[tuple[tuple[int, int], ...]] = []
        self.remakes: list[tuple[int, ...]] = []
        self.levers_at: list[bool] = []
        self._dropped_in: dict[int, int] = {}  # storage address -> chain, while dropped

    def _sibling(self) -> Recomputer:
        return Recomputer(self._storages, self._ledger, self._copier, self._stats, self._device,
                          make_room=self._make_room, ensure_resident=self._ensure_resident)

    def for_plan(self, trace: Any, plan: Any) -> Recomputer:
        """A recomputer for ``plan``'s chains over ``trace``, with the same collaborators."""
        rc = self._sibling()
        n = trace.n_ops
        rc._chains = [_Chain(tuple(sorted(r.ops)), tuple(r.tensors), r.before_op) for r in plan.recomputes]
        chain_ops: dict[int, list[int]] = {}
        drops: dict[int, list[tuple[int, int]]] = {}
        remakes: dict[int, list[int]] = {}
        for c, chain in enumerate(rc._chains):
            for op in chain.ops:
                chain_ops.setdefault(op, []).append(c)
            remakes.setdefault(chain.before_op, []).append(c)
            for tid in chain.tensors:
                before = [int(u) for u in trace.uses(tid) if u < chain.before_op]
                if before:
                    drops.setdefault(max(before), []).append((c, tid))
        rc.chain_ops = [tuple(chain_ops.get(op, ())) for op in range(n)]
        rc.drops = [tuple(drops.get(op, ())) for op in range(n)]
        rc.remakes = [tuple(remakes.get(op, ())) for op in range(n)]
        rc.levers_at = [bool(a or b or c) for a, b, c in zip(rc.chain_ops, rc.drops, rc.remakes)]
        return rc

    def with_chains(self, chains: list[_Chain]) -> Recomputer:
        """A recomputer holding ``chains`` as recorded, with no per-op tables (a probe
        that times replays, :mod:`.host_costs`)."""
        rc = self._sibling()
        rc._chains = chains
        return rc

    @property
    def chains(self) -> list[_Chain]:
        """The plan's chains (read only)."""
        return self._chains

    def reset(self) -> None:
        """The iteration ended: what the chains recorded is released."""
        for chain in self._chains:
            chain.reset()
        self._dropped_in = {}

    def forget(self, cdata: int) -> None:
        """A dropped storage died (its graph was freed): nothing to re-make into it."""
        self._dropped_in.pop(cdata, None)

    def record(self, i: int, func, args: tuple, kwargs: dict, out: Any, states: Any) -> None:
        """Op ``i`` ran forward and belongs to chains: keep what re-running it needs
        (``states``: the random generators' states just before it, if it draws)."""
        for c in self.chain_ops[i]:
            chain = self._chains[c]
            step = len(chain.recipe)
            if step >= len(chain.ops) or chain.ops[step] != i:
                continue  # (a departure: the chain stays incomplete and is not dropped)

            def ref(t: torch.Tensor, chain=chain):
                hit = chain.made.get(id(t))
                if hit is not None and hit[2]() is t:
                    return _Made(hit[0], hit[1])
                return t  # a chain input: held until the chain has run

            outs = _out_leaves(out)
            # the bytes its replay makes: new storages only (a view's result is its
            # argument's storage, which reserving for again cost an unplanned eviction)
            given = {t.untyped_storage()._cdata for t in pytree.tree_leaves((args, kwargs))
                     if isinstance(t, torch.Tensor)}
            made = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                    for t in outs if isinstance(t, torch.Tensor)}
            chain.recipe.append(_step(func, args, kwargs, ref, states,
                                      sum(n for c, n in made.items() if c not in given)))
            entries, tid_of = self._storages.entries, self._storages.iter_tid
            for k, t in enumerate(outs):
                if isinstance(t, torch.Tensor):
                    chain.made[id(t)] = (step, k, weakref.ref(t))
                    e = entries.get(t.untyped_storage()._cdata)
                    tid = tid_of.get(e.cdata) if e is not None else None
                    if tid is not None and tid in chain.tensors and tid not in chain.source:
                        chain.source[tid] = (step, k)

    def drop(self, i: int) -> None:
        """After op ``i``: free the storages of the chains' tensors whose last forward use
        it was (only for chains recorded whole)."""
        for c, tid in self.drops[i]:
            chain = self._chains[c]
            entries = self._storages.iter_entries
            e = entries[tid] if tid < len(entries) else None
            if e is None or tid not in chain.source:  # (its op was not recorded: keep it)
                self._stats.skipped_drops += 1
                continue
            st = e.ref()
            if st is None or e.state is not RESIDENT or not e.resizable or e.pins or e.foreign:
                self._stats.skipped_drops += 1
                continue
            if e.arrival is not None:
                self._copier.wait(e.arrival)
                e.arrival = None
            st.resize_(0)
            e.state = DROPPED
            self._ledger.remove(e.nbytes)
            self._storages.left_device(e)
            self._dropped_in[e.cdata] = c
            chain.dropped.append((e, chain.source[tid]))
            self._stats.dropped_bytes += e.nbytes

    def remake_before(self, i: int) -> None:
        """Re-make the chains due before op ``i`` that dropped something."""
        for c in self.remakes[i]:
            if self._chains[c].dropped:
                self.remake(c)

    def remake_entry(self, e: _Entry) -> None:
        """A dropped tensor is needed now (earlier than planned, or unexpectedly)."""
        c = self._dropped_in.get(e.cdata)
        if c is None:
            raise OffloadError(f"{e.label} was dropped for recompute and its chain is gone")
        self._stats.early_recomputes += 1
        self.remake(c)

    def remake(self, c: int) -> None:
        """Re-run chain ``c`` and put the re-made bytes back in the dropped storages.

        Each re-made tensor is copied into its own storage as soon as the op that makes
        it has run, and the rest of the chain reads it from there, so the replay holds a
        second copy of one tensor at a time, and its temporaries only as long as the
        chain needs them."""
        chain = self._chains[c]
        t0 = time.perf_counter()
        dev = self._device
        inputs: list[_Entry] = []
        for x in (v for st in chain.recipe for v in st.vals):
            # a chain input that is itself away or dropped (another chain's tensor) first
            if isinstance(x, torch.Tensor) and getattr(x, self._dev_attr) is True:
                e = self._storages.entries.get(x.untyped_storage()._cdata)
                if e is not None:
                    inputs.append(e)
                    if e.state is not RESIDENT or e.arrival is not None:
                        self._ensure_resident(e)
        # (a dropped storage that died since, its graph freed, needs nothing)
        targets = {src: e for e, src in chain.dropped if e.ref() is not None and e.state is DROPPED}
        # the last step that reads each step's results: they are let go after it
        last_read = list(range(len(chain.recipe)))
        for step, st in enumerate(chain.recipe):
            for _j, m in st.made_at:
                last_read[m.step] = max(last_read[m.step], step)
        keep = rng_states(dev)
        results: list[list[Any] | None] = []
        temp: dict[int, int] = {}  # the replay's own storages alive now (tracked ones are counted)
        restored: list[_Entry] = []  # re-made so far: later steps may read them, not to be evicted
        try:
            with torch.no_grad():
                for step, st in enumerate(chain.recipe):
                    func, states, out_bytes = st.func, st.states, st.out_bytes
                    # room for what this op makes, beside the replay's live temporaries
                    # (a re-made tensor's bytes become its storage's: see _restore)
                    self._make_room(sum(temp.values()) + out_bytes, inputs + restored)
                    vals = st.vals
                    if st.made_at:
                        vals = list(vals)
                        for j, m in st.made_at:
                            vals[j] = results[m.step][m.leaf]
                    args, kwargs = (vals, {}) if st.spec is None else pytree.tree_unflatten(vals, st.spec)
                    if states is not None:
                        _set_rng_states(states, dev)
                    # what the op writes in place that the chain did not make (a training
                    # BatchNorm's running statistics, per its schema or opflags): restored
                    # after, so that update happens once, in forward
                    written = [w for w in writes(func, args, kwargs)
                               if not any(w is r for rs in results for r in rs or ())]
                    saved = [w.clone() for w in written]
                    leaves = _out_leaves(func(*args, **kwargs))
                    for w, old in zip(written, saved):
                        w.copy_(old)
                    del saved, args, kwargs
                    temp = self._replay_temps(results + [leaves])
                    self._ledger.note_peak(sum(temp.values()))
                    for k, x in enumerate(leaves):
                        e = targets.get((step, k))
                        if e is not None:
                            leaves[k] = self._restore(e, x, inputs + restored)
                            restored.append(e)
                    del x
                    results.append(leaves)
                    for j in range(step + 1):
                        if last_read[j] == step:
                            results[j] = None  # (no later step reads them)
                    # NOTE: what the next step makes room beside: the temporaries still to
                    # be read, not those just let go (counting them over-reserved by a
                    # block's widest activation, an unplanned eviction per chain)
                    temp = self._replay_temps(results)
                    self._stats.recomputed_ops += 1
        finally:
            _set_rng_states(keep, dev)
        chain.dropped = []
        chain.recipe, chain.made = [], {}  # (the chain's inputs are released here)
        self._stats.recompute_s += time.perf_counter() - t0

    def _replay_temps(self, results: list) -> dict[int, int]:
        """The replay's own storages among ``results`` (what no entry tracks), by address:
        their bytes."""
        temp: dict[int, int] = {}
        tracked = self._storages.entries
        for rs in results:
            for x in rs or ():
                if isinstance(x, torch.Tensor):
                    st = x.untyped_storage()
                    if st._cdata not in tracked:
                        temp[st._cdata] = st.nbytes()
        return temp

    def _restore(self, e: _Entry, new: torch.Tensor, keep: list[_Entry]) -> torch.Tensor:
        """Put re-made ``new``'s bytes in dropped ``e``'s storage; return ``new`` as a view
        of that storage, for the rest of the chain (``keep``: what making room for a
        copy must not evict).

        NOTE: where torch can swap two storages' memory (``_swap_data_ptr_``) and nothing
        else holds ``new``'s storage, the re-made bytes become ``e``'s as they are: no
        second copy of the tensor is ever on the device, so a chain holds what
        ``torch.utils.checkpoint``'s re-run forward holds (what plans count). Else they
        are copied, and for that moment the tensor is there twice: room is made for it."""
        st = e.ref()
        src = new.untyped_storage()
        if st is None:
            return new
        if src.nbytes() != e.nbytes:
            raise OffloadError(f"recompute of {e.label}: re-made {src.nbytes()} bytes, it had {e.nbytes}")
        if _can_swap(st, src):
            st._swap_data_ptr_(src)  # (src keeps st's empty memory, freed with new)
        else:
            self._make_room(e.nbytes, keep)
            st.resize_(e.nbytes)
            _u8(st, e.nbytes).copy_(_u8(src, e.nbytes))
        e.state = RESIDENT
        self._ledger.add(e.nbytes)
        self._dropped_in.pop(e.cdata, None)
        if e.key is not None:
            self._storages.rejoin_lru(e)
        view = torch.empty(0, dtype=new.dtype, device=new.device)
        return view.set_(st, new.storage_offset(), new.size(), new.stride())


def _can_swap(st: torch.UntypedStorage, src: torch.UntypedStorage) -> bool:
    """Whether ``src``'s memory can be handed to dropped (empty) ``st`` as it is: torch
    can swap them, and only the re-made tensor (and the handle here) holds ``src``."""
    return (_SWAP and st.nbytes() == 0 and st.device == src.device
            and torch._C._storage_Use_Count(src._cdata) <= 2)


_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_") and hasattr(torch._C, "_storage_Use_Count")

__all__ = ["DROPPED", "Recomputer", "rng_states"]
