"""What recompute needs to know of each op of the profiled iteration: the ``nn.Module``
it ran under (:attr:`tierflow.trace.Op.scope`), whether it draws random numbers
(:attr:`~tierflow.trace.Op.rng`) and whether re-running it is safe
(:attr:`~tierflow.trace.Op.pure`), decided as :mod:`tierflow.capture.recorder` decides
them, so that a policy plans the same from the runtime's own trace as from a captured
one (the ``checkpoint`` and ``selective`` policies find the model's blocks,
``transformer.h.3``, instead of falling back to sqrt(n) segments).

* **scope** — a :class:`~tierflow.capture.scope.ScopeTracker` is active during the
  profiled iteration only: it is installed when the iteration begins (from the model's
  forward pre-hook, where the tracker's global module hooks have already been passed
  over for the model itself, so the model's own scope is pushed by hand) and removed
  when the iteration ends, and in every other way out (``offload``'s exit, an error in
  the loop). Its module hooks are global and cost a Python call per module call, so a
  followed iteration never has them. Ops the runtime issues itself (fetches,
  evictions, labelling) run quietly and are neither recorded nor asked for a scope;
  the optimizer step and a loss outside the model get ``None``, as in capture.
* **rng** — :func:`tierflow.capture.opflags.draws_random` on the op's arguments.
* **pure** — False for a collective or ``aten::_print``
  (:func:`~tierflow.capture.opflags.has_side_effects`), or when the op writes in place
  (:func:`~tierflow.capture.opflags.writes`, which includes a training BatchNorm's
  running statistics that its schema does not declare) a tensor off the device, or
  one that is state at the end of the iteration: a parameter, buffer, optimizer state,
  gradient or batch tensor (its final kind), or a tensor the iteration did not make
  (first seen as an op's input). Writes into a tensor an earlier op of the iteration
  made keep the op pure. Kinds are final only when the iteration ends (gradients are
  labelled by their hook after the op that wrote them), so the written tensors are
  kept per op and purity is decided when the trace is built.

The runtime's recompute (:mod:`tierflow.runtime.recompute`) does not rely on these
flags: it saves the random state of any op tagged ``nondeterministic_seeded`` and
restores what an op writes in place, whatever the trace says. They serve the planners.
"""

from __future__ import annotations

from typing import Any

from ..capture.opflags import draws_random, has_side_effects, writes
from ..capture.scope import ScopeTracker
from .segments import TickLog

# the final kinds of what a re-run must not write (see capture.recorder._STATE_KINDS)
_STATE_KINDS = frozenset({"parameter", "optimizer_state", "gradient", "input"})


class OpFacts:
    """Scopes, flags and ticks of the profiled iteration's ops: a component that
    :class:`~tierflow.runtime.executor.Run` holds (``_opfacts``) and the only writer of
    its state.

    Example:
        >>> f = OpFacts()
        >>> f.scope() is None, f.ops_facts([("add", "forward", 0.0, [0], [1])], ["temporary"] * 2)
        (True, [(None, False, False)])
    """

    def __init__(self) -> None:
        self._scopes: ScopeTracker | None = None
        self._tick_log: TickLog | None = None
        # by recorded op: (scope, draws random numbers, has side effects, trace ids it wrote)
        self._facts: dict[int, tuple[str | None, bool, bool, tuple[int, ...]]] = {}
        self.ticks: list[tuple[int, str, str]] = []  # the last profiled iteration's (segments.TickLog)

    def begin_scopes(self, model: Any) -> None:
        """A profiled iteration begins (in the model's forward pre-hook): track scopes
        from here."""
        self._facts = {}
        self.end_scopes()
        tracker = ScopeTracker(model)
        tracker.__enter__()
        self._scopes = tracker
        tracker.push(model)  # (its global pre-hook was not called for this forward)

    def end_scopes(self) -> None:
        """Remove the scope tracker's module hooks (idempotent)."""
        tracker, self._scopes = self._scopes, None
        if tracker is not None:
            tracker.__exit__(None, None, None)

    def scope(self) -> str | None:
        """The scope of the op being dispatched (None when no profiled iteration runs)."""
        return self._scopes.scope() if self._scopes is not None else None

    def begin_ticks(self, model: Any, recording: bool, recorded: Any) -> None:
        """An iteration begins: a profiled one (``recording``) logs its ticks
        (runtime/segments.py) until it ends; ``recorded()``: the ops recorded so far."""
        self.end_ticks()
        self.ticks = []
        if not recording:
            return
        paths: dict[int, str] = {}
        for name, mod in model.named_modules():
            paths.setdefault(id(mod), name)
        log = TickLog(recorded, paths)
        log.start()
        self._tick_log = log

    def end_ticks(self) -> None:
        """Stop logging ticks (idempotent); the ticks stay for the trace."""
        log, self._tick_log = self._tick_log, None
        if log is not None:
            log.stop()
            self.ticks = log.ticks

    @property
    def logging_ticks(self) -> bool:
        return self._tick_log is not None

    def tick(self, kind: str, ident: str) -> None:
        """A saved-tensor or gradient hook fired (noted while profiling only)."""
        if self._tick_log is not None:
            self._tick_log.note(kind, ident)

    def note(self, op: int, scope: str | None, func: Any, args: tuple, kwargs: dict, written_tid: Any) -> None:
        """Keep what recorded op ``op`` needs for its flags (called after the op ran:
        every tensor it wrote has an entry and an id; ``written_tid(t)``: the trace id
        of a tensor it wrote, None for one off the device or without a storage)."""
        side_effects = has_side_effects(func)
        written: list[int] = []
        for t in writes(func, args, kwargs):
            tid = written_tid(t)
            if tid is None:  # off the device, or no storage: state the trace cannot see
                side_effects = True
            else:
                written.append(tid)
        self._facts[op] = (scope, draws_random(func, args, kwargs), side_effects, tuple(written))

    def keep_only(self, keep: list[int]) -> None:
        """Of the recorded ops, only those at ``keep`` stay (renumbered in that order)."""
        self._facts = {new: self._facts[old] for new, old in enumerate(keep) if old in self._facts}

    def ops_facts(self, ops: list, kinds: list[str]) -> list[tuple[str | None, bool, bool]]:
        """``(scope, rng, pure)`` of each recorded op; ``ops``: ``(name, phase, dur, ins,
        outs)`` as recorded, ``kinds``: each tensor's final kind."""
        made: set[int] = set()  # tensors first seen as an op's output: the iteration made them
        seen: set[int] = set()
        for _n, _p, _d, ins, outs in ops:
            seen.update(ins)
            made.update(t for t in outs if t not in seen)
            seen.update(outs)
        facts = self._facts
        out = []
        for j in range(len(ops)):
            if j not in facts:  # (an op recorded without its facts: unknown, so not safe to re-run)
                out.append((None, False, False))
                continue
            scope, rng, side_effects, written = facts[j]
            state = any(kinds[t] in _STATE_KINDS or t not in made for t in written)
            out.append((scope, rng, not side_effects and not state))
        return out


__all__ = ["OpFacts"]
