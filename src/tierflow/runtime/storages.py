"""Tracking storages under the dispatch mode: which device storages exist, what each
one is (parameter, gradient, optimizer state, saved activation, input), and how many
bytes of the budget they hold.

The unit the runtime moves is a *storage*, never a tensor: every view of it (a
parameter, the transposed weight autograd saved, an Adam moment) stays a valid Python
object while its bytes are away. :class:`_Entry` is the record of one storage, keyed
by the storage's ``_cdata`` address and holding only a weak reference to it (the
weakref's callback reports its death). :class:`StorageTable` owns the records (the
only writer of them; the executor, the follower and the mover read its containers and
call its methods). :class:`StorageTracking` is the part of
:class:`~tierflow.runtime.executor.Run` that labels them from PyTorch's hooks:
post-accumulate-grad hooks (gradients), the saved-tensor pack hook (activations), and
collectives in flight (pinned until their ``Work`` completes); the module's and
optimizer's state are labelled when the block opens. The helpers above them find the
plain tensors and the storages in an op's arguments, cheaply: they run for every op.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

RESIDENT, AWAY, INCOMING = "resident", "away", "incoming"
OWNED = ("parameter", "gradient", "optimizer_state", "activation")
# kinds of a storage the user's loop made and holds, when an iteration first sees it as an
# op's input (the batch, its targets): external to the iteration (TensorInfo.external)
LOOP_KINDS = ("input", "temporary", "activation")
_RANK = {"parameter": 0, "optimizer_state": 1, "gradient": 2, "input": 3, "activation": 4, "temporary": 5}


@dataclass(eq=False, slots=True)
class _Entry:
    """One storage the runtime has seen (never a strong reference to it)."""

    cdata: int
    nbytes: int
    ref: Any  # weakref.ref to the UntypedStorage; its callback reports the death
    kind: str = "temporary"
    key: str | None = None
    name: str = ""
    resizable: bool = True
    state: str = RESIDENT
    tier: str | None = None
    slot: int = -1  # offset in the host pool or the SSD file while away
    bounce: int = -1  # SSD: bounce slot holding the bytes (write in flight, or read landed)
    io: Any = None  # SSD: the Future of the write or read in flight
    arrival: Any = None  # CUDA: event of the copy that brought it back
    departure: Any = None  # CUDA: event of the copy that took it to the host pool
    pins: int = 0  # collectives in flight that read or write it: not to be moved
    touched: bool = False  # an op used it after the collective that pinned it
    foreign: bool = False  # resized by someone else (FSDP's unsharded parameters): never moved
    top: int = 0  # largest size seen (a foreign storage's size changes under us)
    external: bool = False  # made before an iteration, held by the user's loop: never moved
    unplanned: bool = False  # away because the budget forced an eviction the plan did not make
    # counted against the budget: False for a storage made before the block opened and
    # first seen as an op's input (the user's data; never moved, see StorageTable.entry)
    counted: bool = True
    # host steps (runtime/host_step.py): the host buffer that is this storage's home off
    # the device (a host-stepped parameter's master copy, its gradient's buffer): while
    # away in it the tier is "home"; synced: the device bytes equal the home's
    home: Any = None
    synced: bool = True

    @property
    def persistent(self) -> bool:
        return self.kind in ("parameter", "optimizer_state")

    @property
    def label(self) -> str:
        return self.key or self.name or f"storage {self.cdata:#x}"

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_COMM_NS = ("c10d::", "_c10d_functional::", "c10d_functional::")
_MANAGED_NS = ("fsdp::",)  # FSDP2's copy-in/copy-out ops: what they write, FSDP resizes


def _storage_id_slow(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


# ``t.untyped_storage()._cdata`` without making the storage's Python object (about half
# the cost; the same number: the StorageImpl's address)
_storage_id = getattr(torch._C, "_storage_id", None) or _storage_id_slow


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds ``t``'s bytes: ``t`` itself, or for a wrapper subclass
    with one inner tensor (a DTensor: its local shard) that tensor."""
    while type(t) not in _PLAIN and is_traceable_wrapper_subclass(t):
        inner = _inner(t)
        if len(inner) != 1:
            break
        t = inner[0]
    return t


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a wrapper subclass flattens to (a DTensor also names its mesh)."""
    attrs, _ = t.__tensor_flatten__()
    return [x for x in (getattr(t, a) for a in attrs) if isinstance(x, torch.Tensor)]


def _unwrap(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensor subclasses replaced by the plain tensors inside them (all of them)."""
    out: list[torch.Tensor] = []
    stack = list(reversed(ts))
    while stack:
        t = stack.pop()
        if type(t) not in _PLAIN and is_traceable_wrapper_subclass(t):
            stack += reversed(_inner(t))
        else:
            out.append(t)
    return out


def _storage_bytes(t: torch.Tensor) -> int:
    return _plain(t).untyped_storage().nbytes()


def _works(out: Any) -> list[Any]:
    """The ``Work`` handles a c10d op returned (its completion frees what it pinned)."""
    found = []
    for x in pytree.tree_leaves(out):
        if isinstance(x, torch.ScriptObject):
            try:
                found.append(torch._C._distributed_c10d.Work.unbox(x))
            except (AttributeError, RuntimeError, TypeError):
                pass
    return found


_KIND: dict[Any, int] = {}  # op -> 0 plain, 1 collective, 2 FSDP-managed copy


def _op_kind(func, name: str) -> int:
    k = _KIND.get(func)
    if k is None:
        k = _KIND[func] = 1 if name.startswith(_COMM_NS) else 2 if name.startswith(_MANAGED_NS) else 0
    return k


_U8_PROTO: dict[Any, torch.Tensor] = {}  # device -> an empty uint8 tensor to make views from


def _u8(st: torch.UntypedStorage, n: int) -> torch.Tensor:
    """A flat byte view of a whole storage of ``n`` bytes (shares it; no autograd, own
    version counter). From a cached empty tensor: this runs twice per move."""
    dev = st.device
    proto = _U8_PROTO.get(dev)
    if proto is None:
        proto = _U8_PROTO[dev] = torch.empty(0, dtype=torch.uint8, device=dev)
    return proto.new_empty(0).set_(st, 0, (n,), (1,))


_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}
_NAMES: dict[Any, str] = {}


def _op_name(func) -> str:
    name = _NAMES.get(func)
    if name is None:
        name = _NAMES[func] = func._schema.name
    return name


def _write_spots(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument the op writes (in-place ``self``, ``out=``),
    from its schema; cached per op."""
    spots = _WRITES.get(func)
    if spots is None:
        spots = _WRITES[func] = tuple(
            (i, a.name) for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        )
    return spots


def _flat_tensor_args(func) -> bool:
    """Whether every tensor the op can take is a positional argument of its own: no
    list of tensors (``cat``, ``index``, the ``_foreach`` ops) and no keyword-only
    tensor (``out=``). Then the dispatch mode finds the tensors in ``args`` alone."""
    for a in func._schema.arguments:
        t = a.type
        if isinstance(t, torch._C.ListType) and str(t.getElementType()) in ("Tensor", "Optional[Tensor]"):
            return False
        if a.kwarg_only and str(t) in ("Tensor", "Optional[Tensor]"):
            return False
    return True


#: Ops that only make new metadata over their argument's storage and never look at it,
#: not even at its size (``view`` and ``alias`` skip the bounds check other view ops make,
#: ``detach`` copies the tensor's header): they may run while that storage is away.
#: Autograd dispatches a ``detach`` for every saved tensor it unpacks under saved-tensor
#: hooks, so these are about a quarter of a transformer step's ops.
METADATA_ONLY = frozenset({torch.ops.aten.detach.default, torch.ops.aten.view.default, torch.ops.aten.alias.default})


def _returns_views(func) -> bool:
    """Whether every result of the op is a view of an argument (``Tensor(a)`` in its
    schema, not written): it makes no storage, so it has no bytes to account."""
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if type(x) not in _PLAIN:
            raise TypeError("a tensor subclass")
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
    return x


def _new_result_bytes(func, args: tuple, kwargs: dict) -> int | None:
    """Bytes of new storage the op's results will take, before it runs: its meta kernel
    on meta copies of its arguments (shapes only, no data, some tens of microseconds).
    Results the schema says are views or written arguments take none. None when the
    meta kernel cannot say (no meta kernel, a shape that depends on the data, a tensor
    subclass): the caller then guesses."""
    rets = func._schema.returns
    if rets and all(r.alias_info is not None for r in rets):
        return 0
    try:
        margs, mkwargs = pytree.tree_map(_to_meta, args), pytree.tree_map(_to_meta, kwargs)
        # NOTE: a factory (randn, empty, arange) takes its device from an argument, not
        # from a tensor: run on the CPU it would draw from the user's random stream
        if any(a.name == "device" and a.kwarg_only for a in func._schema.arguments):
            mkwargs["device"] = torch.device("meta")
        elif not any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves((margs, mkwargs))):
            return None  # (no tensor and no device: where it would run is not ours to say)
        out = func(*margs, **mkwargs)
    except Exception:  # noqa: BLE001 (any failure of a meta kernel only means "unknown")
        return None
    outs = out if isinstance(out, (tuple, list)) and len(out) == len(rets) else (out,) * len(rets)
    n = 0
    for r, o in zip(rets, outs):
        if r.alias_info is None:
            n += sum(_storage_bytes(t) for t in _leaves(o))
    return n


def _written_args(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensor arguments the op writes (in-place ``self``, ``out=``)."""
    spots = _write_spots(func)
    return _written_at(spots, args, kwargs) if spots else []


def _written_at(spots: tuple[tuple[int, str], ...], args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors at the argument positions ``spots`` (see :func:`_write_spots`)."""
    out: list[torch.Tensor] = []
    for i, name in spots:
        v = args[i] if i < len(args) else kwargs.get(name)
        out += _leaves(v)
    return out


def _leaves(obj: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or result (tensors, and lists/tuples of them: all
    that aten schemas allow), faster than a general pytree walk."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        out: list[torch.Tensor] = []
        for x in obj:
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif isinstance(x, (list, tuple)):
                out += [y for y in x if isinstance(y, torch.Tensor)]
        return out
    if isinstance(obj, dict):
        return _leaves(list(obj.values()))
    return []


class StorageTable:
    """The records of the device storages a run has seen, and the one writer of them.

    Owns: every record by address (``entries``), the persistent ones by runtime key
    (``by_key``), the owned resident ones in least-recently-used order (``lru``), the
    addresses whose storage died and is not yet forgotten (``dead``, filled by weak
    reference callbacks), storages someone else resizes (``foreign``); and, for the
    iteration under way, the trace ids of the storages it has seen (``iter_entries``,
    ``iter_tid``), the last op a profiled storage was alive at (``freed_at``), the
    saved-tensor sequence number, the storage the unpack hook just returned, and how
    much optimizer state has been labelled. Everyone else reads these containers (the
    executor's lean path loads ``entries`` into a local once per op) and changes them
    only through the methods below. The containers are never replaced, only changed
    in place: a reader may keep a reference to one for the run's life.

    Args:
        ledger: the run's device accounting: a record's bytes are added when it is first
            seen (where counted) and removed when it dies resident.
        dev_attr: ``"is_cpu"`` or ``"is_cuda"``: the device the run tracks.
        gone_away: called with the record of a storage that died while not resident
            (away in a tier, or dropped for recompute), after the record is forgotten:
            whoever holds its bytes there gives them back.
        op_now: the index of the op about to run in the iteration. NOTE: a callable, not
            a copy: the executor advances the op index on every op, and the table needs
            it only when a storage of a profiled iteration dies.

    Example:
        >>> import torch
        >>> from tierflow.runtime.ledger import DeviceLedger
        >>> ledger = DeviceLedger()
        >>> table = StorageTable(ledger, "is_cpu", gone_away=lambda e: None, op_now=lambda: 0)
        >>> w = torch.zeros(4)
        >>> e = table.entry(w, "w")
        >>> table.label(e, "parameter", "param:w", "w")
        >>> (e.kind, table.by_key["param:w"] is e, ledger.used)
        ('parameter', True, 16)
    """

    def __init__(self, ledger: Any, dev_attr: str, gone_away: Callable[[_Entry], None],
                 op_now: Callable[[], int]) -> None:
        self._ledger, self._dev_attr = ledger, dev_attr
        self._gone_away, self._op_now = gone_away, op_now
        self.entries: dict[int, _Entry] = {}
        self.lru: OrderedDict[int, _Entry] = OrderedDict()  # resident, owned, by last use
        self.by_key: dict[str, _Entry] = {}
        self.dead: deque[int] = deque()
        self.foreign: dict[int, _Entry] = {}
        # the iteration under way: following a plan, only the tensors the plan names are
        # identified (bound), their trace ids index iter_entries; profiling, every tensor
        # in order of first use
        self.iter_entries: list[_Entry | None] = []
        self.iter_tid: dict[int, int] = {}
        self.freed_at: dict[int, int] = {}  # profiling: trace id -> last op its storage was alive
        self.in_iter = False
        self.recording = False
        self.saved_seq = 0  # saved tensors packed so far in the iteration
        self.unpacked: int | None = None  # profiling: the storage the unpack hook just returned
        self.labelled_states = -1  # len(optimizer.state) when its tensors were last labelled

    # -- records ---------------------------------------------------------------------

    def entry(self, t: torch.Tensor, produced_by: str | None = None, counted: bool = True) -> _Entry | None:
        """The entry of ``t``'s storage (made on first sight), or None if it is not on the
        device or has no storage. ``counted=False`` where ``t`` is an op's input: a
        storage first seen so was not made by any op inside the block (every op there
        runs through the mode) but before it (the user's batches, made ahead): like
        what ``torch.cuda.max_memory_allocated`` held when the block opened, it is not
        the budget's (the model's state is, labelled when the block opens)."""
        if getattr(t, self._dev_attr) is not True:  # is_cpu / is_cuda: cheaper than t.device
            return None
        if type(t) not in _PLAIN:
            t = _plain(t)
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        cdata = st._cdata
        e = self.entries.get(cdata)
        if e is not None and e.ref() is None:  # a storage died and a new one took its address
            self.retire(e)
            e = None
        if e is None:
            e = self.new_entry(st, cdata, produced_by or "<pre-existing>", counted)
        return e

    def new_entry(self, st: torch.UntypedStorage, cdata: int, name: str, counted: bool = True) -> _Entry:
        """Start tracking storage ``st`` (at address ``cdata``): accounted on the device
        (where ``counted``), its death reported through a weak reference."""
        n = st.nbytes()
        e = _Entry(cdata, n, weakref.ref(st, lambda _r, c=cdata, dead=self.dead: dead.append(c)), name=name,
                   resizable=st.resizable(), counted=counted)
        self.entries[cdata] = e
        if counted:
            self._ledger.add(n)
        return e

    def make_counted(self, e: _Entry) -> None:
        """A storage made before the block that the block now changes (resizes): its
        bytes are the budget's from now on."""
        if not e.counted:
            e.counted = True
            if e.state is RESIDENT:
                self._ledger.add(e.nbytes)

    def label(self, e: _Entry | None, kind: str, key: str, name: str) -> None:
        """Say what ``e`` is (a label of a lower rank never replaces a higher one: a
        parameter stays a parameter when autograd saves it)."""
        if e is None or (e.key is not None and _RANK[kind] >= _RANK[e.kind]):
            return
        e.kind, e.key, e.name = kind, key, name
        if e.persistent:
            self.by_key[key] = e
        if kind in OWNED and e.state == RESIDENT and e.resizable and not e.external and e.counted:
            self.lru[e.cdata] = e

    def label_opt_state(self, optimizer: torch.optim.Optimizer | None, names: dict[int, str],
                        held: Any = ()) -> None:
        """Label the optimizer's state tensors (``opt:PARAM:KEY``), except those in
        ``held`` (ids of state host steps keep on the host: never device bytes)."""
        if optimizer is None:
            return
        self.labelled_states = len(optimizer.state)
        for p, state in optimizer.state.items():
            pn = names.get(id(p), f"<param {id(p):x}>")
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and id(v) not in held:
                    self.label(self.entry(v), "optimizer_state", f"opt:{pn}:{k}", f"{pn}.{k}")

    def mark_external(self, e: _Entry) -> None:
        """``e`` was made before the iteration and the user's loop holds it (the batch,
        its targets; see :attr:`tierflow.trace.TensorInfo.external`): no plan moves it,
        so neither does the pager (it would be fetched back on demand when the loop
        comes back to that batch)."""
        if e.kind in LOOP_KINDS and not e.foreign:
            e.external = True
            self.lru.pop(e.cdata, None)

    def touch(self, used: list[_Entry]) -> None:
        """The storages an op used move to the recent end of the LRU order."""
        lru = self.lru
        for e in used:
            if e.cdata in lru:
                lru.move_to_end(e.cdata)

    def left_device(self, e: _Entry) -> None:
        """``e``'s bytes left the device (evicted, dropped, moved to a host step's
        buffer): no longer a victim the pager can pick."""
        self.lru.pop(e.cdata, None)

    def back_on_device(self, e: _Entry) -> None:
        """``e``'s bytes are on the device again: an owned one joins the LRU order."""
        if e.kind in OWNED:
            self.lru[e.cdata] = e

    def rejoin_lru(self, e: _Entry) -> None:
        """``e`` (a labelled storage a recompute has just re-made) is a victim the pager
        can pick again, as the most recently used."""
        self.lru[e.cdata] = e

    def retire(self, e: _Entry) -> None:
        """Forget a storage that died (its device bytes, or its slots while away)."""
        c = e.cdata
        if self.entries.get(c) is not e:
            return
        del self.entries[c]
        if e.key is not None:  # (a temporary, the common case, is in none of these)
            self.lru.pop(c, None)
            if self.by_key.get(e.key) is e:
                del self.by_key[e.key]
        if self.in_iter:
            tid = self.iter_tid.pop(c, None)
            if tid is not None and self.recording:
                # (found dead before the op about to run: its memory was held through the op before)
                self.freed_at[tid] = self._op_now() - 1
        if e.foreign and self.foreign.get(c) is e:
            del self.foreign[c]
        if e.state is RESIDENT:
            if e.counted:
                self._ledger.remove(e.nbytes)
        else:  # died away, or dropped for recompute: whoever holds its bytes lets them go
            self._gone_away(e)

    def retire_dead(self) -> None:
        """Forget the storages that died since (their weak references said so)."""
        dead, entries = self.dead, self.entries
        while dead:
            e = entries.get(dead.popleft())
            if e is not None and e.ref() is None:  # (alive: the address holds a new storage)
                self.retire(e)

    # -- storages someone else resizes ------------------------------------------------

    def make_foreign(self, e: _Entry) -> None:
        """``e`` is resized by someone else (FSDP frees and re-allocates its unsharded
        parameters with ``untyped_storage().resize_``): never move it, keep its size."""
        if e.foreign:
            return
        self.make_counted(e)  # (its owner resizes it inside the block)
        e.foreign, e.resizable = True, False
        self.lru.pop(e.cdata, None)
        self.foreign[e.cdata] = e

    def sync_foreign(self) -> None:
        """Account foreign storages at the size their owner left them (looked at when
        the budget or the peak is in question: a storage FSDP grows again is then
        written by an op, which accounts it)."""
        for e in list(self.foreign.values()):
            st = e.ref()
            if st is None:
                continue
            n = st.nbytes()
            if n != e.nbytes and e.state == RESIDENT:
                self._ledger.add(n - e.nbytes)
                e.top = max(e.top, e.nbytes, n)
                e.nbytes = n

    def resized(self, e: _Entry) -> int:
        """Account a resident storage an op resized; the bytes it grew by."""
        n = e.ref().nbytes()
        self.make_counted(e)  # (resized inside the block)
        self._ledger.add(n - e.nbytes)
        grown = max(0, n - e.nbytes)
        e.top = max(e.top, e.nbytes)
        e.nbytes = n
        return grown

    def note_peak(self) -> None:
        """The ledger's peak, with foreign storages counted at their size now."""
        ledger = self._ledger
        if ledger.used > ledger.peak:
            if self.foreign:  # (FSDP may have freed some since: count them as they are)
                self.sync_foreign()
            ledger.note_peak()

    # -- the iteration ----------------------------------------------------------------

    def begin_iteration(self, recording: bool, n_tensors: int) -> None:
        """An iteration begins: profiled (``recording``: every storage gets the next
        trace id on first use) or following a trace of ``n_tensors`` tensors (ids bound
        where the plan names them)."""
        self.in_iter, self.recording = True, recording
        self.saved_seq = 0
        self.iter_tid.clear()
        self.freed_at.clear()
        self.iter_entries[:] = [] if recording else [None] * n_tensors

    def end_iteration(self) -> None:
        """The iteration's ops are over: a storage that dies from here on is not one of
        its tensors' deaths (the trace ids stay until :meth:`forget_iteration`: the trace
        is built from them)."""
        self.in_iter = False

    def forget_iteration(self) -> None:
        """The ended iteration's trace ids are forgotten (``freed_at`` stays until the
        next begins)."""
        self.iter_tid.clear()
        self.iter_entries.clear()

    @contextlib.contextmanager
    def borrowed_ids(self, entries: list[_Entry]) -> Iterator[None]:
        """For a probe that runs scratch storages through the follower's code: trace ids
        ``0..len(entries)-1`` name ``entries`` inside the block; the iteration's own ids
        are put back on the way out."""
        kept = list(self.iter_entries)
        self.iter_entries[:] = entries
        try:
            yield
        finally:
            self.iter_entries[:] = kept

    def tid(self, e: _Entry) -> int:
        """``e``'s trace id in the profiled iteration (the next one on first sight)."""
        tid = self.iter_tid.get(e.cdata)
        if tid is None:
            tid = self.iter_tid[e.cdata] = len(self.iter_entries)
            self.iter_entries.append(e)
        return tid

    def bind(self, tid: int, e: _Entry) -> None:
        """Following a plan: ``e`` is the trace's tensor ``tid`` in this iteration."""
        self.iter_entries[tid] = e
        self.iter_tid[e.cdata] = tid

    def next_saved_seq(self) -> int:
        """The sequence number of the next saved tensor of the iteration."""
        seq = self.saved_seq
        self.saved_seq = seq + 1
        return seq

    def note_unpacked(self, cdata: int | None) -> None:
        """The unpack hook returned the storage at ``cdata`` (None: forget it)."""
        self.unpacked = cdata

    def take_unpacked(self) -> int | None:
        """The storage the unpack hook returned last, forgotten as it is read."""
        c, self.unpacked = self.unpacked, None
        return c

    def clear(self) -> None:
        """The run ends: forget every record (no bytes are accounted or given back)."""
        self.entries.clear()
        self.lru.clear()
        self.by_key.clear()
        self.foreign.clear()


class StorageTracking:
    """The saved-tensor and gradient hooks that label storages (a mixin of
    :class:`~tierflow.runtime.executor.Run`; the records are :class:`StorageTable`'s,
    ``self._storages``)."""

    def _entry(self, t: torch.Tensor, produced_by: str | None = None, counted: bool = True) -> _Entry | None:
        """:meth:`StorageTable.entry` (for the mixins that still reach it through ``self``)."""
        return self._storages.entry(t, produced_by, counted)

    def _note_peak(self) -> None:
        """:meth:`StorageTable.note_peak`."""
        self._storages.note_peak()

    def _label_opt_state(self) -> None:
        """Label the optimizer's state (:meth:`StorageTable.label_opt_state`), less what
        host steps keep on the host."""
        self._storages.label_opt_state(self.optimizer, self._names, self._host_held)

    def _on_grad(self, name: str):
        def hook(p: torch.Tensor) -> None:
            if self._hook is not None and self._hook.active:  # (following at ticks: runtime/hook_follow.py)
                if p.grad is not None:
                    self._hook.grad(name, p.grad)
                return
            if p.grad is not None and not self._fast:  # (following a plan, _bind labels gradients)
                self._opfacts.tick("grad", name)
                with self._own_ops():
                    table = self._storages
                    table.label(table.entry(p.grad), "gradient", f"grad:{name}", f"{name}.grad")
        return hook

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._hook is not None and self._hook.active:  # (following at ticks: runtime/hook_follow.py)
            self._hook.pack(t)
        elif self._in_iter and not self._fast:  # (following a plan, _bind labels activations)
            table = self._storages
            seq = table.next_saved_seq()
            self._opfacts.tick("pack", str(seq))
            # (autograd saves before the op reaches the mode: a storage new here is an
            # input made before the block, the target a loss saves, say)
            e = table.entry(t, "saved", counted=False)
            if e is not None and e.kind == "temporary":
                table.label(e, "activation", f"saved:{seq}", f"saved{seq}")
        # not t: an output saved by its own grad_fn would tie graph and output in a cycle.
        # NOTE: a plain tensor's detach skips the dispatch mode (it is not the user's op,
        # and a trip through the Python mode costs tens of microseconds per saved tensor)
        if type(t) in _PLAIN:
            with torch._C._DisableTorchDispatch():
                return t.detach()
        with self._own_ops():
            return t.detach()  # a subclass (DTensor) detaches through its own dispatch

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        if self._hook is not None and self._hook.off_mode:  # (following at ticks: runtime/hook_follow.py)
            self._hook.unpack(_plain(t) if type(t) not in _PLAIN else t)
            return t
        if self._fast:  # following a plan, the op that reads it fetches it if it is away
            return t
        p = _plain(t) if type(t) not in _PLAIN else t
        if self._recording:  # autograd may detach what we return: that op is ours, not the model's
            self._storages.note_unpacked(_storage_id(p))
        e = self._entries.get(p.untyped_storage()._cdata) if getattr(p, self._dev_attr) is True else None
        if self._opfacts.logging_ticks:
            self._opfacts.tick("unpack", (e.key or "") if e is not None else "")
        if e is not None and (e.state != RESIDENT or e.arrival is not None):
            with self._own_ops():
                self._make_room(e.nbytes if e.state != RESIDENT else 0, [e])
                self._ensure_resident(e)
                self._storages.note_peak()
        return t

    def _hooks_off_for_iteration(self) -> None:
        """A followed iteration runs without our saved-tensor hooks (the trace left out
        the ops they cause: ``ProfileRecord._drop_hook_ops``). NOTE: in such an iteration the
        hooks do nothing (the follower labels what the plan needs by binding) but cost a
        Python call per saved tensor and, per unpack, an autograd ``detach`` through the
        dispatch mode (45 of the 543 ops of gpt-tiny's profiled step). Taken off only when they are the only hooks on
        the stack: hooks a user pushed before the block would otherwise take over."""
        if self._hooks_off:
            return
        hooks = torch._C._autograd
        if hooks._top_saved_tensors_default_hooks(False) != (self._pack, self._unpack):
            return
        hooks._pop_saved_tensors_default_hooks()
        if hooks._top_saved_tensors_default_hooks(False) is not None:
            hooks._push_saved_tensors_default_hooks(self._pack, self._unpack)
            return
        self._hooks_off = True

    def _hooks_on(self) -> None:
        """Our saved-tensor hooks back on the stack (end of a followed iteration, a
        departure from the trace, the end of the run)."""
        if self._hooks_off:
            torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)
            self._hooks_off = False

    def _on_special(self, kind: int, out: Any, ins: list[_Entry], outs: list[_Entry], wrote: list[_Entry]) -> None:
        """After a collective (``kind`` 1): every storage it reads or writes is pinned
        until its ``Work`` completes (a gloo thread or an NCCL kernel still uses the
        bytes after the op returns; no ``Work``: pinned for the storage's life). After
        one of FSDP2's copy ops (``kind`` 2): what it wrote is FSDP's to resize, never
        ours to move."""
        if kind == 1:
            self.stats.collectives += 1
            self._collectives.pin(_works(out), list({e.cdata: e for e in ins + outs}.values()), wrote)
        else:
            for e in wrote:
                self._storages.make_foreign(e)

    def _state_tensors(self) -> list[torch.Tensor]:
        out = list(self.model.parameters()) + list(self.model.buffers())
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return out
