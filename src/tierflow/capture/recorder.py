"""Record one training iteration of a PyTorch model as a :class:`~tierflow.trace.Trace`.

How it works. The iteration (forward, loss, backward, optimizer step, ``zero_grad``) runs
under a ``TorchDispatchMode``, which sees every aten op below autograd, in execution
order: forward ops, the backward ops the autograd engine runs, the optimizer's update
ops. Each tensor argument and result is mapped to its *storage* (the C++
``StorageImpl``), so views and in-place ops refer to the one tensor id they share and
no byte is counted twice. A weak reference to every storage seen is held until the
capture ends, so a freed storage's address cannot be reused for a new one: tensor ids
are never reused within a trace.

What each storage is comes from the places PyTorch keeps it:

* ``parameter`` — a ``model.named_parameters()`` storage (key ``param:NAME``; tied
  weights are one storage and one tensor) or a buffer (``buffer:NAME``), persistent;
* ``optimizer_state`` — a storage in ``optimizer.state`` (``opt:NAME:KEY``), persistent;
* ``gradient`` — ``param.grad`` after the last backward (``grad:NAME``); not persistent,
  since ``zero_grad(set_to_none=True)`` frees it every iteration: it is born at the
  backward op that produced it and dies after the optimizer's last read;
* ``input`` — the batch (``input:I``, in flattening order of batch then target);
* ``activation`` — a storage autograd saved for backward, seen through
  ``torch.autograd.graph.saved_tensors_hooks`` (``saved:SEQ``, SEQ the 0-based order of
  pack-hook calls within the iteration, the first that saved the storage);
* ``temporary`` — everything else (intermediate results, gradients in flight).

A tensor is live from the first op that lists it to the last; PyTorch frees a storage
when its last reference drops, which for a saved activation is the backward op that
consumes it and for a temporary its last reader.

``aten::detach`` is not recorded: it launches no kernel and allocates nothing, and
autograd issues it or not depending on whether saved-tensor hooks are installed, so
leaving it out keeps the op list equal to that of the same step run without tierflow.

What recompute needs, per op (:class:`tierflow.trace.Op`): ``scope``, the module path
it ran under, from :class:`tierflow.capture.scope.ScopeTracker` (forward: module hooks;
backward: the autograd node being executed, traced back to the forward op that made
it); ``rng``, from :func:`tierflow.capture.opflags.draws_random`; ``pure``, False when
the op writes in place (:func:`tierflow.capture.opflags.writes`) a parameter, buffer,
optimizer state, gradient, batch tensor, a tensor allocated outside any op or one off
the recorded device, or is a collective. Writes into tensors an earlier op of the
iteration made keep the op pure (see :attr:`tierflow.trace.Op.pure`).

Durations: on ``meta`` nothing runs, so every op is priced by the roofline cost model
(:mod:`tierflow.capture.cost`) for a hardware preset; on ``cpu`` each op is timed with
``time.perf_counter``, and on ``cuda`` by the GPU time of the kernels it launched (the
torch profiler's CUDA activity, matched to the op by
:mod:`tierflow.runtime.kernel_times`; ``meta["kernel_times"]`` has the check against the
profiler's totals), or by CUDA events around it where the profiler cannot run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import TraceError
from ..hardware import Hardware, load_hardware
from ..trace import Op, TensorInfo, Trace
from . import cost
from .opflags import draws_random, has_side_effects, writes
from .scope import ScopeTracker

DEFAULT_HARDWARE = "h100-80g-pcie5-nvme"

_PERSISTENT_KINDS = ("parameter", "optimizer_state")


@dataclass
class _Slot:
    """What the recorder knows about one storage."""

    nbytes: int
    name: str
    kind: str = "temporary"
    key: str | None = None
    persistent: bool = False
    tid: int = -1  # id in the trace, assigned on first use in the recorded iteration
    preexisting: bool = False  # first seen as an op's input: allocated before or outside an op
    ref: Any = None  # StorageWeakRef: tells whether it was freed; keeps its address from reuse


@dataclass
class _Rec:
    name: str
    phase: str
    duration_s: float
    inputs: list[int]
    outputs: list[int]
    events: tuple[Any, Any] | None = None
    scope: str | None = None
    rng: bool = False
    side_effects: bool = False
    written: list[_Slot] = field(default_factory=list)  # tensors it updates in place


@dataclass
class _State:
    device: torch.device
    timing: str  # "measured" | "roofline"
    compute: Any
    slots: dict[int, _Slot] = field(default_factory=dict)  # storage cdata -> slot
    order: list[_Slot] = field(default_factory=list)  # slots in order of first use
    ops: list[_Rec] = field(default_factory=list)
    phase: str = "forward"
    saved_seq: int = 0
    saved_device: int = 0
    quiet: bool = False
    probe_cuda: bool = False  # measure per-op workspace from the CUDA allocator's peak
    probe: list[str] | None = None  # op names of a profiled probe iteration (CPU workspace)
    workspace: list[int] = field(default_factory=list)  # per recorded op: transient bytes inside it
    scopes: ScopeTracker | None = None  # module scope of each op, while recording
    kernel_timer: Any = None  # CUDA: the torch profiler session timing ops by their kernels
    kernels: Any = None  # its KernelTimes, once stopped

    def slot(self, t: torch.Tensor, produced_by: str | None) -> _Slot | None:
        """The slot of ``t``'s storage (created on first sight), or None if ``t`` lives
        on another device or has no storage."""
        if not self._on_device(t):
            return None
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested, functional wrappers
            return None
        cdata = st._cdata
        s = self.slots.get(cdata)
        if s is None:
            s = _Slot(nbytes=int(st.nbytes()), name=produced_by or "<pre-existing>",
                      preexisting=produced_by is None, ref=StorageWeakRef(st))
            self.slots[cdata] = s
        return s

    def label(self, t: torch.Tensor, kind: str, key: str, name: str, persistent: bool) -> None:
        s = self.slot(t, produced_by=name)
        if s is None:
            return
        if s.key is None or _rank(kind) < _rank(s.kind):
            s.kind, s.key, s.name, s.persistent = kind, key, name, persistent

    def tid(self, s: _Slot) -> int:
        if s.tid < 0:
            s.tid = len(self.order)
            self.order.append(s)
        return s.tid

    def _on_device(self, t: torch.Tensor) -> bool:
        d = t.device
        if d.type != self.device.type:
            return False
        return self.device.index is None or d.index is None or d.index == self.device.index


_KIND_RANK = {"parameter": 0, "optimizer_state": 1, "gradient": 2, "input": 3, "activation": 4, "temporary": 5}


def _rank(kind: str) -> int:
    return _KIND_RANK[kind]


_DETACH = torch.ops.aten.detach.default


class _Mode(TorchDispatchMode):
    """Records every aten op with the storages it reads and writes."""

    def __init__(self, state: _State):
        super().__init__()
        self.s = state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        s = self.s
        if s.quiet:
            return func(*args, **kwargs)
        # every op the model dispatches, detach included, so autograd nodes made since
        # the previous one are tied to the module they were made in
        scope = s.scopes.scope() if s.scopes is not None else None
        if func is _DETACH:
            return func(*args, **kwargs)
        name = func._schema.name
        if s.probe is not None:
            with torch.autograd.profiler.record_function(f"tierflow#{len(s.probe)}"):
                s.probe.append(name)
                return func(*args, **kwargs)
        cuda_ws = s.timing == "measured" and s.device.type == "cuda" and s.probe_cuda
        if cuda_ws:
            torch.cuda.reset_peak_memory_stats(s.device)
        in_tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        ins = [s.slot(t, None) for t in in_tensors]
        written = writes(func, args, kwargs)
        events = None
        if s.timing == "measured" and s.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            with s.kernel_timer.mark(len(s.ops)) if s.kernel_timer is not None else contextlib.nullcontext():
                out = func(*args, **kwargs)
            end.record()
            events, dur = (start, end), 0.0
            if cuda_ws:
                s.workspace.append(max(0, torch.cuda.max_memory_allocated(s.device)
                                       - torch.cuda.memory_allocated(s.device)))
        elif s.timing == "measured":
            t0 = time.perf_counter()
            out = func(*args, **kwargs)
            dur = time.perf_counter() - t0
        else:
            out = func(*args, **kwargs)
            dur = _modelled(func, args, kwargs, out, s) if (in_tensors or _has_tensor(out)) else 0.0
        label = f"{name}#{len(s.ops)}"
        outs = [s.slot(t, label) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        written_slots = [s.slot(t, None) for t in written]
        outs += written_slots
        s.ops.append(
            _Rec(
                name=name,
                phase=s.phase,
                duration_s=dur,
                inputs=_ids(s, ins),
                outputs=_ids(s, outs),
                events=events,
                scope=scope,
                rng=draws_random(func, args, kwargs),
                # writing a tensor off the recorded device (the CPU step counter of a
                # GPU or meta model's optimizer) changes state the trace cannot see
                side_effects=has_side_effects(func) or any(w is None for w in written_slots),
                written=[w for w in written_slots if w is not None],
            )
        )
        return out


def _has_tensor(out: Any) -> bool:
    return any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(out))


def _modelled(func, args, kwargs, out, s: _State) -> float:
    dev = [x for x in pytree.tree_leaves((args, kwargs, out)) if isinstance(x, torch.Tensor) and s._on_device(x)]
    if not dev:  # host-side bookkeeping (an optimizer's step counter): no device kernel
        return 0.0
    return cost.op_time(func, args, kwargs, out, s.compute)


def _ids(s: _State, slots: list[_Slot | None]) -> list[int]:
    return list(dict.fromkeys(s.tid(x) for x in slots if x is not None))


# -- running one iteration ---------------------------------------------------------------


def _flat_tensors(obj: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(obj) if isinstance(x, torch.Tensor)]


def _to(obj: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, obj)


def _call(model: Callable, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _loss_of(out: Any, target: Any, loss_fn: Callable | None) -> torch.Tensor:
    if loss_fn is not None:
        loss = loss_fn(out) if target is None else loss_fn(out, target)
    elif isinstance(out, torch.Tensor) and out.dim() == 0:
        loss = out
    elif isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        loss = out["loss"]
    elif isinstance(getattr(out, "loss", None), torch.Tensor):
        loss = out.loss
    elif isinstance(out, torch.Tensor):
        loss = out.float().mean()
    else:
        raise TraceError(
            f"capture: the model returned {type(out).__name__}, which is neither a tensor nor has a "
            "'loss'; pass loss_fn="
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TraceError(f"capture: the loss must be a one-element tensor, got {getattr(loss, 'shape', loss)!r}")
    return loss


def _split(obj: Any, k: int) -> list[Any]:
    """``obj`` (a batch: tensors in a pytree) as ``k`` micro-batches along dim 0."""
    if k == 1:
        return [obj]
    leaves, spec = pytree.tree_flatten(obj)
    parts: list[list[Any]] = [[] for _ in range(k)]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if x.dim() == 0 or x.shape[0] % k:
                raise TraceError(
                    f"capture: accumulation_steps={k} does not divide a batch tensor of shape {tuple(x.shape)} along dim 0"
                )
            for i, c in enumerate(x.chunk(k)):
                parts[i].append(c)
        else:
            for p in parts:
                p.append(x)
    return [pytree.tree_unflatten(p, spec) for p in parts]


def _make_optimizer(optimizer: Any, model: torch.nn.Module) -> torch.optim.Optimizer | None:
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer is None or optimizer == "adamw":
        return torch.optim.AdamW(params, lr=1e-4)
    if optimizer is False or optimizer == "none":
        return None
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=1e-4)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    raise TraceError(f"capture: optimizer must be an Optimizer, 'adamw', 'adam', 'sgd' or 'none', got {optimizer!r}")


@contextlib.contextmanager
def _autocast(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
    elif device.type == "meta":
        from .amp import meta_autocast

        with meta_autocast(dtype):
            yield
    else:
        with torch.autocast(device.type, dtype=dtype):
            yield


@contextlib.contextmanager
def _fused_attention(device: torch.device) -> Iterator[None]:
    """On ``meta``, route scaled-dot-product attention to the fused kernels a GPU runs
    (flash for bf16/fp16, memory-efficient for fp32) instead of the math fallback that
    materialises the full attention matrix."""
    if device.type != "meta":
        yield
        return
    from .amp import fused_sdpa

    with fused_sdpa():
        yield


_AMP = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16, torch.bfloat16: torch.bfloat16,
        torch.float16: torch.float16}


def capture(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: Callable | None = None,
    optimizer: Any = None,
    device: str | torch.device | None = None,
    *,
    target: Any = None,
    hardware: str | Hardware | None = None,
    timing: str = "auto",
    autocast: str | torch.dtype | None = None,
    accumulation_steps: int = 1,
    warmup: int = 1,
    progress: Callable[[str], None] | None = None,
    workspace: bool = True,
    name: str = "",
    meta: dict[str, Any] | None = None,
) -> Trace:
    """Record one training iteration of ``model`` as a :class:`~tierflow.trace.Trace`.

    The iteration is ``accumulation_steps`` times (forward under ``autocast``, loss,
    ``backward``), then ``optimizer.step()`` and ``zero_grad(set_to_none=True)``. It is
    run ``warmup`` times first, unrecorded, so that the optimizer's state exists and the
    recorded iteration is a steady-state one. Both runs train: the model's parameters
    and the optimizer's state are updated as in real training.

    Args:
        model: any ``nn.Module``. It is moved to ``device`` in place (``model.to``).
        batch: the model's input: a tensor (``model(batch)``), a tuple or list
            (``model(*batch)``) or a dict (``model(**batch)``); moved to ``device``.
        loss_fn: ``loss_fn(output, target)`` (``loss_fn(output)`` if ``target`` is None)
            returning a scalar. Without it the output is the loss if it is a scalar, its
            ``loss`` field if it has one (Hugging Face models given labels), else the
            mean of the output.
        optimizer: an ``Optimizer`` over the model's parameters, or ``"adamw"`` (the
            default, lr 1e-4), ``"adam"``, ``"sgd"`` (momentum 0.9) or ``"none"``.
        device: ``"meta"``, ``"cpu"``, ``"cuda"`` (or a ``torch.device``); default the
            device of the model's first parameter.
        target: labels passed to ``loss_fn``; recorded as an input.
        hardware: preset name or :class:`Hardware` for the roofline cost model (used on
            ``meta`` or with ``timing="roofline"``); default ``h100-80g-pcie5-nvme``.
        timing: ``"measured"`` (per-op wall time; CUDA events on a GPU), ``"roofline"``
            (cost model) or ``"auto"`` (roofline on meta, measured otherwise).
        autocast: ``"bf16"``/``"fp16"`` to run forward and loss under mixed-precision
            autocast (on ``meta`` an emulation of CUDA autocast's cast policy).
        accumulation_steps: split the batch along dim 0 into this many micro-batches,
            each with its own forward and backward (loss scaled by ``1/k``), gradients
            accumulating before the one optimizer step.
        warmup: unrecorded iterations before the recorded one.
        workspace: also record the memory an op allocates and frees inside itself (a
            convolution's im2col buffer, a backward kernel's scratch) as a temporary
            tensor used by that op alone: on CUDA from the caching allocator's peak
            around each op; on CPU from one extra iteration run under
            ``torch.profiler`` (``profile_memory=True``), matched op by op. Not
            available on ``meta``, where nothing is allocated.
        name: the trace's name. meta: extra entries for ``trace.meta``.

    Returns:
        The trace; ``trace.meta`` records the device, timing, hardware, dtype,
        optimizer, accumulation, autocast and parameter count.

        progress: called with a few words as each phase starts (``"recording:
            backward (1,234 ops so far)"``); library code prints nothing, the CLI shows
            them on a spinner.

    Raises:
        TraceError: a bad argument (unknown optimizer, device, timing; a batch that
            ``accumulation_steps`` does not divide; a model output with no loss), or an
            iteration that runs no op.

    Example:
        >>> import torch
        >>> from tierflow.capture import capture
        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> tr = capture(net, torch.randn(4, 8), device="meta")
        >>> tr.bytes_by_kind()["parameter"] == 4 * sum(p.numel() for p in net.parameters())
        True
    """
    if accumulation_steps < 1:
        raise TraceError(f"capture: accumulation_steps must be >= 1, got {accumulation_steps}")
    if warmup < 0:
        raise TraceError(f"capture: warmup must be >= 0, got {warmup}")
    if autocast not in _AMP:
        raise TraceError(f"capture: autocast must be 'bf16', 'fp16' or None, got {autocast!r}")
    amp_dtype = _AMP[autocast]
    if device is None:
        p = next(model.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise TraceError(f"capture: bad device {device!r} ({e})") from None
    if dev.type not in ("meta", "cpu", "cuda"):
        raise TraceError(f"capture: device must be meta, cpu or cuda, got {dev}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TraceError("capture: device 'cuda' requested but CUDA is not available")
    if timing == "auto":
        timing = "roofline" if dev.type == "meta" else "measured"
    if timing not in ("measured", "roofline"):
        raise TraceError(f"capture: timing must be 'auto', 'measured' or 'roofline', got {timing!r}")
    if timing == "measured" and dev.type == "meta":
        raise TraceError("capture: nothing runs on meta, so durations cannot be measured; use timing='roofline'")
    hw = load_hardware(hardware or DEFAULT_HARDWARE) if timing == "roofline" else None

    model.to(dev)
    batch, target = _to(batch, dev), _to(target, dev)
    opt = _make_optimizer(optimizer, model)
    micro = list(zip(_split(batch, accumulation_steps), _split(target, accumulation_steps)))
    k = accumulation_steps
    state = _State(device=dev, timing=timing, compute=hw.compute if hw else None)

    def say(recording: bool, phase: str) -> None:
        if progress is not None:
            progress(f"recording: {phase} ({len(state.ops):,} ops so far)" if recording else f"warm-up: {phase}")

    def one_iteration(recording: bool) -> None:
        for mb, tg in micro:
            say(recording, "forward")
            state.phase = "forward"
            with _autocast(dev, amp_dtype), _fused_attention(dev):
                loss = _loss_of(_call(model, mb), tg, loss_fn)
                if k > 1:
                    loss = loss / k
            say(recording, "backward")
            state.phase = "backward"
            loss.backward()
            del loss
        if recording:
            _label_grads(state, model)
        say(recording, "optimizer step")
        state.phase = "optimizer"
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)

    model.train()
    model.zero_grad(set_to_none=True)
    for _ in range(warmup):
        one_iteration(False)

    # what exists before the recorded iteration: parameters, buffers, optimizer state, batch
    for n, p in model.named_parameters():
        state.label(p, "parameter", f"param:{n}", n, True)
    for n, b in model.named_buffers():
        state.label(b, "parameter", f"buffer:{n}", n, True)
    if opt is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for p, st in opt.state.items():
            for key, v in st.items():
                if isinstance(v, torch.Tensor):
                    pn = names.get(id(p), f"<param {id(p):x}>")
                    state.label(v, "optimizer_state", f"opt:{pn}:{key}", f"{pn}.{key}", True)
    for i, x in enumerate(_flat_tensors((batch, target))):
        state.label(x, "input", f"input:{i}", f"input{i}", False)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if state.probe is not None:
            state.quiet = True
            try:
                return t.detach()
            finally:
                state.quiet = False
        seq = state.saved_seq
        state.saved_seq += 1
        state.quiet = True
        try:
            sl = state.slot(t, f"saved{seq}")
            if sl is not None:
                state.saved_device += 1
                if sl.kind == "temporary":
                    sl.kind, sl.key = "activation", f"saved:{seq}"
            return t.detach()  # not t itself: that would tie the graph and its output in a cycle
        finally:
            state.quiet = False

    probe_names: list[str] | None = None
    probe_ws: list[int] = []
    if workspace and timing == "measured" and dev.type == "cpu":
        probe_names, probe_ws = _probe_cpu_workspace(state, lambda: one_iteration(False), pack)
    state.probe_cuda = workspace and timing == "measured" and dev.type == "cuda"
    if timing == "measured" and dev.type == "cuda":  # op times from their kernels (runtime.kernel_times)
        from ..runtime.kernel_times import KernelTimer

        state.kernel_timer = KernelTimer.start()
    try:
        with ScopeTracker(model) as state.scopes, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                _Mode(state):
            one_iteration(True)
        if state.kernel_timer is not None:
            torch.cuda.synchronize(dev)
            state.kernels = state.kernel_timer.stop(len(state.ops))
    finally:
        if state.kernel_timer is not None:
            state.kernel_timer.close()
            state.kernel_timer = None
    state.scopes = None
    if probe_names is not None:
        if probe_names == [r.name for r in state.ops]:
            state.workspace = probe_ws
        else:  # the model took a different path this iteration: no op-by-op match
            state.workspace = []
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    if not state.ops:
        raise TraceError("capture: the iteration ran no aten op")
    if progress is not None:
        progress(f"building the trace ({len(state.ops):,} ops)")
    return _build(state, model, dev, hw, name, {
        **(meta or {}),
        "optimizer": type(opt).__name__ if opt is not None else "none",
        "accumulation_steps": k,
        "autocast": str(amp_dtype).replace("torch.", "") if amp_dtype else None,
    })


def _probe_cpu_workspace(state: _State, iteration: Callable[[], None], pack: Callable) -> tuple[list[str], list[int]]:
    """Run one iteration under the profiler with every op marked; return the op names and
    the transient bytes inside each op: the peak of its allocations' running sum minus
    what it still holds at its end (its results)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    state.probe = []
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _Mode(state):
                iteration()
        names = state.probe
    finally:
        state.probe = None
    ws = [0] * len(names)
    stack = [(e, -1) for e in prof.profiler.kineto_results.experimental_event_tree()]
    allocs: dict[int, list[tuple[int, int]]] = {}
    while stack:
        e, owner = stack.pop()
        if e.name.startswith("tierflow#"):
            owner = int(e.name[len("tierflow#"):])
        elif owner >= 0 and e.tag == _EventType.Allocation:
            allocs.setdefault(owner, []).append((e.start_time_ns, int(e.extra_fields.alloc_size)))
        stack.extend((c, owner) for c in e.children)
    for i, evs in allocs.items():
        cur = peak = 0
        for _, d in sorted(evs):
            cur += d
            peak = max(peak, cur)
        if i < len(ws):
            ws[i] = max(0, peak - max(cur, 0))
    return names, ws


def _label_grads(state: _State, model: torch.nn.Module) -> None:
    state.quiet = True
    try:
        for n, p in model.named_parameters():
            if p.grad is not None:
                state.label(p.grad, "gradient", f"grad:{n}", f"{n}.grad", False)
    finally:
        state.quiet = False


# What a re-run must not write: state that outlives the iteration (weights, buffers,
# optimizer state), gradients (accumulated across micro-batches), the batch, and
# anything allocated outside an op. Writing a tensor an earlier op of the iteration made
# (dropout's ``bernoulli_`` into its ``empty_like``, an in-place ReLU) is safe when the
# op that made it is re-run too.
_STATE_KINDS = ("parameter", "optimizer_state", "gradient", "input")


def _is_state(s: _Slot) -> bool:
    return s.kind in _STATE_KINDS or s.persistent or s.preexisting


def _build(state: _State, model: torch.nn.Module, dev: torch.device, hw: Hardware | None, name: str,
           extra: dict[str, Any]) -> Trace:
    tensors = []
    for i, s in enumerate(state.order):
        if s.key is None and s.preexisting and s.ref.expired() is False:
            # allocated outside any op, still held after the iteration: model state the
            # module keeps in a plain attribute (a cached constant), persistent like a weight
            s.kind, s.persistent = "parameter", True
        persistent = s.persistent and s.kind in _PERSISTENT_KINDS
        tensors.append(TensorInfo(id=i, bytes=s.nbytes, kind=s.kind, persistent=persistent, name=s.name, key=s.key))
    ops = []
    ws = state.workspace if len(state.workspace) == len(state.ops) else []
    kernels = state.kernels if state.kernels is not None and state.kernels.usable else None
    for j, r in enumerate(state.ops):
        d = r.duration_s
        if kernels is not None and len(kernels.op_s) == len(state.ops):
            d = kernels.op_s[j]  # CUDA: its kernels' GPU time, without launch gaps
        elif r.events is not None:
            d = r.events[0].elapsed_time(r.events[1]) / 1e3
        outputs = tuple(r.outputs)
        if ws and ws[j] > 0:
            tid = len(tensors)
            tensors.append(TensorInfo(id=tid, bytes=int(ws[j]), kind="temporary", name=f"<workspace {r.name}#{j}>"))
            outputs += (tid,)
        ops.append(Op(name=r.name, phase=r.phase, duration_s=max(0.0, float(d)),
                      inputs=tuple(r.inputs), outputs=outputs, scope=r.scope, rng=r.rng,
                      pure=not r.side_effects and not any(_is_state(w) for w in r.written)))
    n_params = sum(p.numel() for p in model.parameters())
    meta = {
        "source": "tierflow.capture",
        "device": str(dev),
        "timing": state.timing if kernels is None else "measured: kernel time (torch profiler)",
        **({"kernel_times": state.kernels.summary()} if state.kernels is not None else {}),
        "hardware": hw.name if hw is not None else None,
        "torch": torch.__version__,
        "param_count": n_params,
        "saved_tensors": state.saved_seq,
        "workspace": "cuda-allocator" if state.probe_cuda else ("profiler" if ws else None),
        **extra,
    }
    for s in state.slots.values():
        s.ref = None
    return Trace(ops, tensors, name or type(model).__name__, meta)
