"""Trace: one training iteration as ordered ops over tensors, and the views derived from it.

A trace is immutable once built. Tensor ids are dense (``0 .. n_tensors-1``) and ops are
referred to by their index in execution order, so every derived view is a numpy array
indexed by tensor id or op index.

Liveness follows G10: a non-persistent tensor is live from the first op that lists it to
the last op that lists it (inclusive); a persistent tensor (weights, optimizer state) is
live for the whole run, and its inactive gap after its last use wraps into the next
iteration's first use.

File format (``tierflow-trace`` version 2), JSON, gzipped when the name ends in ``.gz``::

    {"format": "tierflow-trace", "version": 2, "name": "...", "meta": {...},
     "tensors": [{"id": 0, "bytes": 4096, "kind": "parameter", "persistent": true,
                  "name": "fc.weight", "key": "param:fc.weight"}, ...],
     "ops": [{"name": "aten::mm", "phase": "forward", "duration_s": 1e-4,
              "inputs": [0, 3], "outputs": [4],
              "scope": "blocks.3.mlp", "rng": false, "pure": true}, ...]}

Version 2 added the three op fields recompute needs (``scope``, ``rng``, ``pure``); each
is optional and written only when it differs from its default. Version 1 files still
load: their ops have no scope, draw no random numbers and are pure.

Where the fields come from: :func:`tierflow.capture.capture` records all three
(:mod:`tierflow.capture.scope`, :mod:`tierflow.capture.opflags`), and so does the
runtime's profiled iteration (:mod:`tierflow.runtime.opfacts`);
:func:`tierflow.synthetic.gpt_trace` gives its ops ``blocks.N.attn``/``blocks.N.mlp``
scopes; G10 workloads (:mod:`tierflow.formats.g10`) and version 1 files have none.

The contract for recompute policies on a trace without scopes (no op has one: a G10
workload, a version 1 file): they must not fail and must not guess module boundaries
from op names; a policy that segments the forward pass into blocks (activation
checkpointing) then falls back to Chen et al.'s ``sqrt(n)`` segmentation of the
forward ops in execution order ("Training Deep Nets with Sublinear Memory Cost",
2016), and a policy that needs scopes and has no such fallback plans no recompute
(moves only) and says so in its plan's ``meta``. ``rng`` and ``pure`` keep their
defaults there (draws nothing, pure) because G10's kernel lists say nothing of either,
not because they were checked: a policy recomputes only forward-phase ops on such a
trace (G10's ``Apply_Grad`` kernels, in the optimizer phase, do update the weights).
On a captured trace, ops with scope ``None`` (the loss outside the model, the
optimizer step) belong to no block.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .errors import TraceError

FORMAT_NAME = "tierflow-trace"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)

PHASES = ("forward", "backward", "optimizer")
KINDS = ("parameter", "gradient", "optimizer_state", "activation", "temporary", "input")


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor (one storage) of the iteration.

    Attributes:
        id: dense index, ``0 .. n_tensors-1``.
        bytes: storage size in bytes.
        kind: one of :data:`KINDS`.
        persistent: lives across iterations (parameters, optimizer state); its gap after
            the last use wraps to the first use of the next iteration.
        name: human-readable label (parameter name, op that produced it).
        key: runtime identity an executor uses to find the same tensor in a later
            iteration (``param:NAME``, ``saved:SEQ``, ``opt:NAME:KEY``); ``None`` for
            imported traces.
        held_until: for a non-persistent tensor, the last op during which its memory
            was still held although no op used it any more, as the runtime observed
            (PyTorch frees a tensor when its last reference goes: a Python local, an
            autograd buffer, a ``.grad`` until ``zero_grad``, not at its last use).
            ``None``: freed at its last use (what a captured trace assumes).
        external: made before the iteration and held by the user's loop (the batch,
            its targets, as the runtime saw them): in memory from the iteration's
            start, and not an executor's to move, so it has no gaps (a plan that moves
            it fails :func:`tierflow.plan.validate`).
    """

    id: int
    bytes: int
    kind: str
    persistent: bool = False
    name: str = ""
    key: str | None = None
    held_until: int | None = None
    external: bool = False


@dataclass(frozen=True, slots=True)
class Op:
    """One operator (kernel) of the iteration, in execution order.

    Attributes:
        name: the operator (``aten::mm``) or kernel name.
        phase: one of :data:`PHASES`.
        duration_s: its time on the compute stream.
        inputs, outputs: tensor ids it reads and writes (an in-place update lists the
            tensor in both).
        scope: the path (as in ``model.named_modules()``) of the innermost
            ``nn.Module`` it ran under (``blocks.3.mlp``; ``""`` for the model itself);
            a backward op has the scope of the forward op it differentiates. ``None``
            where it ran under no module of the model (a loss computed outside it, the
            optimizer step) or the trace does not know (G10 workloads). Recompute
            policies group ops into blocks by it.
        rng: it draws random numbers (dropout, ``rand``): re-running it gives the same
            values only with the RNG state it first ran with restored.
        pure: re-running it has no effect beyond re-creating its outputs (no in-place
            update of state that outlives the iteration: parameters, buffers such as
            batch-norm running statistics, optimizer state, gradients, the batch; no
            collective): safe to recompute. An in-place op on a tensor an earlier op of
            the iteration made (dropout's ``bernoulli_`` into its ``empty_like``, an
            in-place ReLU) is pure, but lists that tensor as input and output, so a
            chain that re-runs it must re-run the op that made the tensor first.
    """

    name: str
    phase: str
    duration_s: float
    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    scope: str | None = None
    rng: bool = False
    pure: bool = True

    @property
    def tensors(self) -> tuple[int, ...]:
        """Inputs then outputs, each tensor once (an in-place update lists it in both)."""
        return tuple(dict.fromkeys(self.inputs + self.outputs))


class Gap(NamedTuple):
    """An inactive period of one tensor: between its use at ``after_op`` and its next use
    at ``before_op`` (in the next iteration when ``wraps``). ``length_s`` is the compute
    time strictly between the two uses, the window a transfer can hide behind."""

    tensor: int
    after_op: int
    before_op: int
    wraps: bool
    length_s: float


@dataclass(frozen=True)
class Trace:
    """One training iteration. Build it with ``Trace(ops, tensors, name, meta)``; it is
    validated on construction (ids, kinds, phases, durations, references)."""

    ops: tuple[Op, ...]
    tensors: tuple[TensorInfo, ...]
    name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        object.__setattr__(self, "tensors", tuple(self.tensors))
        _validate(self)

    # -- sizes and times ------------------------------------------------------------
    @property
    def n_ops(self) -> int:
        return len(self.ops)

    @property
    def n_tensors(self) -> int:
        return len(self.tensors)

    @cached_property
    def sizes(self) -> np.ndarray:
        """Bytes per tensor id (int64)."""
        return np.fromiter((t.bytes for t in self.tensors), dtype=np.int64, count=self.n_tensors)

    @cached_property
    def persistent(self) -> np.ndarray:
        """Boolean per tensor id."""
        return np.fromiter(
            (t.persistent for t in self.tensors), dtype=bool, count=self.n_tensors
        )

    @cached_property
    def durations(self) -> np.ndarray:
        """Seconds per op (float64)."""
        return np.fromiter((o.duration_s for o in self.ops), dtype=np.float64, count=self.n_ops)

    @cached_property
    def op_start_s(self) -> np.ndarray:
        """Ideal start time of each op, plus one trailing entry: the iteration's end."""
        out = np.zeros(self.n_ops + 1)
        np.cumsum(self.durations, out=out[1:])
        return out

    @property
    def ideal_s(self) -> float:
        """Sum of op durations: the step time with unlimited device memory."""
        return float(math.fsum(o.duration_s for o in self.ops))

    @cached_property
    def op_tensors(self) -> tuple[tuple[int, ...], ...]:
        """Per op, the tensors it touches (inputs then outputs, deduplicated)."""
        return tuple(o.tensors for o in self.ops)

    def op_groups(self, ops: Iterable[int], links: Iterable[tuple[int, int]] = ()) -> list[list[int]]:
        """``ops`` in groups connected by the tensors they share, and by ``links`` (pairs
        of ops in ``ops`` that belong together for another reason): each group sorted,
        the groups in order of their first op. The optimizer's units of work are such
        groups (a ``foreach`` step shares one op between all its parameters)."""
        from scipy.sparse import coo_matrix
        from scipy.sparse.csgraph import connected_components

        ops = sorted(set(ops))
        if not ops:
            return []
        index = {op: k for k, op in enumerate(ops)}
        first: dict[int, int] = {}
        rows, cols = [], []
        for op in ops:
            for t in self.op_tensors[op]:
                j = first.setdefault(t, op)
                if j != op:
                    rows.append(index[j])
                    cols.append(index[op])
        for a, b in links:
            rows.append(index[a])
            cols.append(index[b])
        n = len(ops)
        graph = coo_matrix((np.ones(len(rows)), (rows, cols)), shape=(n, n))
        _, label = connected_components(graph, directed=False)
        groups: dict[int, list[int]] = {}
        for op, g in zip(ops, label.tolist()):
            groups.setdefault(g, []).append(op)
        return sorted(groups.values(), key=lambda g: g[0])

    # -- uses, birth, death ------------------------------------------------------------
    @cached_property
    def _use_csr(self) -> tuple[np.ndarray, np.ndarray]:
        counts = np.fromiter((len(ts) for ts in self.op_tensors), dtype=np.int64, count=self.n_ops)
        flat_t = np.fromiter(
            (t for ts in self.op_tensors for t in ts), dtype=np.int64, count=int(counts.sum())
        )
        flat_op = np.repeat(np.arange(self.n_ops, dtype=np.int64), counts)
        order = np.lexsort((flat_op, flat_t))
        ptr = np.zeros(self.n_tensors + 1, dtype=np.int64)
        np.cumsum(np.bincount(flat_t, minlength=self.n_tensors), out=ptr[1:])
        return ptr, flat_op[order]

    def uses(self, tensor: int) -> np.ndarray:
        """Sorted op indices that use ``tensor`` (each op once)."""
        ptr, ops = self._use_csr
        return ops[ptr[tensor] : ptr[tensor + 1]]

    @cached_property
    def first_use(self) -> np.ndarray:
        ptr, ops = self._use_csr
        return ops[ptr[:-1]]

    @cached_property
    def last_use(self) -> np.ndarray:
        ptr, ops = self._use_csr
        return ops[ptr[1:] - 1]

    @cached_property
    def external(self) -> np.ndarray:
        """Boolean per tensor id: :attr:`TensorInfo.external`."""
        return np.fromiter((t.external for t in self.tensors), dtype=bool, count=self.n_tensors)

    @cached_property
    def birth(self) -> np.ndarray:
        """First op during which the tensor occupies memory (0 for persistent and
        external tensors)."""
        return np.where(self.persistent | self.external, 0, self.first_use)

    @cached_property
    def death(self) -> np.ndarray:
        """Last op during which the tensor occupies memory (inclusive; the last op for
        persistent tensors): its last use, or later where the trace says its memory was
        held longer (:attr:`TensorInfo.held_until`)."""
        held = np.fromiter((-1 if t.held_until is None else t.held_until for t in self.tensors),
                           dtype=np.int64, count=self.n_tensors)
        return np.where(self.persistent, self.n_ops - 1, np.maximum(self.last_use, held))

    # -- gaps and the memory curve -------------------------------------------------------
    @cached_property
    def gaps(self) -> tuple[Gap, ...]:
        """Every inactive period of every tensor, by tensor then time. Persistent tensors
        get a wrapping gap from their last use to their first use of the next iteration
        (also when they are used by one op only). External tensors have none: they
        are not the executor's to move."""
        start = self.op_start_s
        total = start[-1]
        ptr, ops = self._use_csr
        out: list[Gap] = []
        for t in range(self.n_tensors):
            if self.tensors[t].external:
                continue
            u = ops[ptr[t] : ptr[t + 1]]
            for a, b in zip(u[:-1].tolist(), u[1:].tolist()):
                if b > a + 1:
                    out.append(Gap(t, a, b, False, float(start[b] - start[a + 1])))
            if self.tensors[t].persistent:
                a, b = int(u[-1]), int(u[0])
                if not (a == self.n_ops - 1 and b == 0):  # used across the boundary: no gap
                    out.append(Gap(t, a, b, True, float(total - start[a + 1] + start[b])))
        return tuple(out)

    @cached_property
    def live_bytes(self) -> np.ndarray:
        """Bytes live during each op (persistent tensors always count)."""
        delta = np.zeros(self.n_ops + 1, dtype=np.int64)
        np.add.at(delta, self.birth, self.sizes)
        np.add.at(delta, self.death + 1, -self.sizes)
        return np.cumsum(delta[:-1])

    @property
    def peak_live_bytes(self) -> int:
        return int(self.live_bytes.max()) if self.n_ops else 0

    @property
    def peak_op(self) -> int:
        """Index of the op at which live bytes peak."""
        return int(self.live_bytes.argmax()) if self.n_ops else 0

    @cached_property
    def working_set_bytes(self) -> np.ndarray:
        """Bytes each op needs on the device while it runs (all its tensors)."""
        sizes = self.sizes
        return np.fromiter(
            (int(sizes[list(ts)].sum()) if ts else 0 for ts in self.op_tensors),
            dtype=np.int64,
            count=self.n_ops,
        )

    def bytes_by_kind(self) -> dict[str, int]:
        out = {k: 0 for k in KINDS}
        for t in self.tensors:
            out[t.kind] += t.bytes
        return out

    # -- (de)serialisation --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "name": self.name,
            "meta": self.meta,
            "tensors": [
                {
                    "id": t.id,
                    "bytes": t.bytes,
                    "kind": t.kind,
                    "persistent": t.persistent,
                    "name": t.name,
                    "key": t.key,
                    **({"held_until": t.held_until} if t.held_until is not None else {}),
                    **({"external": True} if t.external else {}),
                }
                for t in self.tensors
            ],
            "ops": [_op_to(o) for o in self.ops],
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "<trace>") -> Trace:
        """Build a trace from its JSON form, raising :class:`TraceError` naming the record
        and field of the first problem."""
        if not isinstance(data, dict):
            raise TraceError(f"{source}: expected a JSON object at the top level")
        if data.get("format") != FORMAT_NAME:
            raise TraceError(
                f"{source}: field 'format' is {data.get('format')!r}, expected {FORMAT_NAME!r}"
            )
        if data.get("version") not in READABLE_VERSIONS:
            raise TraceError(
                f"{source}: unsupported trace version {data.get('version')!r} "
                f"(this tierflow reads versions {', '.join(map(str, READABLE_VERSIONS))})"
            )
        for key in ("tensors", "ops"):
            if not isinstance(data.get(key), list):
                raise TraceError(f"{source}: field '{key}' must be a list")
        tensors = [_tensor_from(rec, i, source) for i, rec in enumerate(data["tensors"])]
        ops = [_op_from(rec, i, source) for i, rec in enumerate(data["ops"])]
        meta = data.get("meta") or {}
        if not isinstance(meta, dict):
            raise TraceError(f"{source}: field 'meta' must be an object")
        try:
            return cls(ops, tensors, str(data.get("name", "")), meta)
        except TraceError as e:
            raise TraceError(f"{source}: {e}") from None

    def save(self, path: str | Path) -> Path:
        """Write the trace as JSON (gzipped if the name ends in ``.gz``)."""
        path = Path(path)
        text = json.dumps(self.to_dict(), separators=(",", ":"))
        if path.suffix == ".gz":
            with gzip.open(path, "wt", encoding="utf-8") as f:
                f.write(text)
        else:
            path.write_text(text, encoding="utf-8")
        return path

    def summary(self) -> dict[str, Any]:
        """A few headline numbers, for tables and ``inspect``."""
        kinds = self.bytes_by_kind()
        return {
            "name": self.name,
            "ops": self.n_ops,
            "tensors": self.n_tensors,
            "param_bytes": kinds["parameter"],
            "grad_bytes": kinds["gradient"],
            "optimizer_bytes": kinds["optimizer_state"],
            "peak_live_bytes": self.peak_live_bytes,
            "peak_op": self.peak_op,
            "ideal_s": self.ideal_s,
        }


# -- validation -------------------------------------------------------------------------


def _validate(trace: Trace) -> None:
    n = len(trace.tensors)
    for i, t in enumerate(trace.tensors):
        if not isinstance(t, TensorInfo):
            raise TraceError(f"tensor {i}: expected TensorInfo, got {type(t).__name__}")
        if t.id != i:
            raise TraceError(f"tensor {i}: field 'id' is {t.id}; ids must be 0..{n - 1} in order")
        if not isinstance(t.bytes, int) or t.bytes < 0:
            raise TraceError(f"tensor {i}: field 'bytes' must be a non-negative integer, got {t.bytes!r}")
        if t.kind not in KINDS:
            raise TraceError(f"tensor {i}: field 'kind' is {t.kind!r}, expected one of {', '.join(KINDS)}")
        if t.held_until is not None and (isinstance(t.held_until, bool) or not isinstance(t.held_until, int)
                                         or not 0 <= t.held_until < len(trace.ops)):
            raise TraceError(f"tensor {i}: field 'held_until' is {t.held_until!r}, expected an op index "
                             f"0..{len(trace.ops) - 1} or null")
    used = np.zeros(n, dtype=bool)
    for j, o in enumerate(trace.ops):
        if not isinstance(o, Op):
            raise TraceError(f"op {j}: expected Op, got {type(o).__name__}")
        if o.phase not in PHASES:
            raise TraceError(f"op {j} ({o.name}): field 'phase' is {o.phase!r}, expected one of {', '.join(PHASES)}")
        d = o.duration_s
        if not isinstance(d, (int, float)) or not math.isfinite(d) or d < 0:
            raise TraceError(f"op {j} ({o.name}): field 'duration_s' must be a finite number >= 0, got {d!r}")
        if o.scope is not None and not isinstance(o.scope, str):
            raise TraceError(f"op {j} ({o.name}): field 'scope' must be a string or None, got {o.scope!r}")
        for fld in ("rng", "pure"):
            if not isinstance(getattr(o, fld), bool):
                raise TraceError(f"op {j} ({o.name}): field '{fld}' must be a bool, got {getattr(o, fld)!r}")
        for fld in ("inputs", "outputs"):
            for t in getattr(o, fld):
                if not isinstance(t, (int, np.integer)) or not 0 <= t < n:
                    raise TraceError(f"op {j} ({o.name}): field '{fld}' names tensor {t!r}, which does not exist (tensors: {n})")
                used[t] = True
    if n and not used.all():
        t = int(np.flatnonzero(~used)[0])
        raise TraceError(f"tensor {t} ({trace.tensors[t].name or 'unnamed'}): no op uses it")


def _tensor_from(rec: Any, i: int, source: str) -> TensorInfo:
    if not isinstance(rec, dict):
        raise TraceError(f"{source}: tensor {i}: expected an object")
    try:
        return TensorInfo(
            id=_field(rec, "id", int, i, "tensor", source),
            bytes=_field(rec, "bytes", int, i, "tensor", source),
            kind=_field(rec, "kind", str, i, "tensor", source),
            persistent=bool(rec.get("persistent", False)),
            name=str(rec.get("name", "")),
            key=rec.get("key"),
            held_until=_field(rec, "held_until", int, i, "tensor", source) if rec.get("held_until") is not None
            else None,
            external=bool(rec.get("external", False)),
        )
    except KeyError as e:
        raise TraceError(f"{source}: tensor {i}: missing field {e}") from None


def _op_to(o: Op) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "name": o.name,
        "phase": o.phase,
        "duration_s": o.duration_s,
        "inputs": list(o.inputs),
        "outputs": list(o.outputs),
    }
    # written only where they differ from the defaults: most ops are pure and draw no
    # random numbers, and a G10 workload has no scopes, so files stay small
    if o.scope is not None:
        rec["scope"] = o.scope
    if o.rng:
        rec["rng"] = True
    if not o.pure:
        rec["pure"] = False
    return rec


def _op_from(rec: Any, i: int, source: str) -> Op:
    if not isinstance(rec, dict):
        raise TraceError(f"{source}: op {i}: expected an object")
    try:
        dur = rec["duration_s"]
        if isinstance(dur, bool) or not isinstance(dur, (int, float)):
            raise TraceError(f"{source}: op {i}: field 'duration_s' must be a number, got {dur!r}")
        return Op(
            name=_field(rec, "name", str, i, "op", source),
            phase=_field(rec, "phase", str, i, "op", source),
            duration_s=float(dur),
            inputs=tuple(_id_list(rec.get("inputs", []), i, "inputs", source)),
            outputs=tuple(_id_list(rec.get("outputs", []), i, "outputs", source)),
            scope=_optional(rec, "scope", str, None, i, source),
            rng=_optional(rec, "rng", bool, False, i, source),
            pure=_optional(rec, "pure", bool, True, i, source),
        )
    except KeyError as e:
        raise TraceError(f"{source}: op {i}: missing field {e}") from None


def _optional(rec: dict, name: str, typ: type, default: Any, i: int, source: str) -> Any:
    v = rec.get(name, default)
    if v is not default and not isinstance(v, typ):
        raise TraceError(f"{source}: op {i}: field '{name}' must be a {typ.__name__}, got {v!r}")
    return v


def _field(rec: dict, name: str, typ: type, i: int, what: str, source: str) -> Any:
    v = rec[name]
    if typ is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise TraceError(f"{source}: {what} {i}: field '{name}' must be an integer, got {v!r}")
    if typ is str and not isinstance(v, str):
        raise TraceError(f"{source}: {what} {i}: field '{name}' must be a string, got {v!r}")
    return v


def _id_list(v: Any, i: int, name: str, source: str) -> Iterable[int]:
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise TraceError(f"{source}: op {i}: field '{name}' must be a list of tensor ids, got {v!r}")
    return v


# -- loading ----------------------------------------------------------------------------


def load_trace(path: str | Path) -> Trace:
    """Load a trace: a tierflow JSON file (``.json`` or ``.json.gz``) or a G10 case
    directory (``kernels.config`` + ``tensors.config``).

    Raises:
        TraceError: the path does not exist, is not a trace, or the trace is malformed
            (the message names the file, the record and the field).
    """
    path = Path(path)
    if path.is_dir():
        if (path / "kernels.config").exists():
            from .formats.g10 import load_g10_case

            return load_g10_case(path)
        raise TraceError(f"{path}: a directory, but not a G10 case (no kernels.config in it)")
    if not path.exists():
        raise TraceError(f"{path}: no such file or directory")
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as f:
                data = json.load(f)
        else:
            data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(f"{path}: not a readable JSON trace ({e})") from None
    return Trace.from_dict(data, source=str(path))
