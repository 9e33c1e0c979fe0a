"""What a training loop does outside its training iterations, inside one ``offload`` block.

Two kinds of work run between one ``optimizer.step()`` and the next training forward,
or beside them: forwards that train nothing (validation under ``torch.no_grad()`` or
``torch.inference_mode()``, with or without ``model.eval()``; generation; a metric),
and the loop's own bookkeeping (logging, ``state_dict()``, ``torch.save``). Neither is
an iteration of the plan: the plan's trace is one training iteration.

:class:`OutsideWork` decides which forwards are *outside*: a forward that begins while
no iteration is open and grad mode is off (``no_grad``, ``inference_mode``) makes no
graph to train, so it opens no iteration; its ops run through the runtime's general
path, which makes room for each op within the budget (least recently used first) and
fetches on demand, as between iterations. The plan stays in force: the next training
forward begins an iteration that follows it from its first op (the plan's start state,
the parameters and optimizer state it wants on the device or away, is restored there).

:class:`CheckpointGuard` keeps checkpoints whole. ``torch.save`` reads a storage's
bytes directly, with no aten op the runtime could see; a parameter or optimizer state
that is away at that moment (its storage shrunk to zero bytes by an eviction) would be
written as an empty record, and loading it back fails (``Trying to resize storage that
is not resizable``: the loaded storage has no bytes for the tensor). So the state dicts
of the model and the optimizer (post hooks on both) never hold an away tensor: each
one is replaced by a copy of its bytes (on CUDA, in host memory), read back from its
tier and sent back there, so the device budget holds and the rest of the state dict
still aliases the model. And
optimizer state loaded inside the block (``load_state_dict`` keeps the loaded tensors,
whose storages ``torch.load`` made and nobody may resize) is replaced by copies the
runtime made, so the plan moves it as before rather than departing at every move of it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .storages import RESIDENT, _Entry, _storage_id


class OutsideWork:
    """Which forwards open no training iteration, and how many ran.

    A forward is *outside* when no iteration is open and autograd records nothing
    (``torch.is_grad_enabled()`` is False: ``no_grad``, ``inference_mode``), or inside
    ``run.untracked()``. Owned by a :class:`~tierflow.runtime.executor.Run`.

    Example:
        >>> w = OutsideWork()
        >>> with torch.no_grad():
        ...     w.is_outside(in_iteration=False, untracked=False)
        True
    """

    def __init__(self) -> None:
        self.forwards = 0  # outside forwards seen (counted at their root module's call)

    def is_outside(self, in_iteration: bool, untracked: bool) -> bool:
        """Whether a root forward starting now is outside training.

        Args:
            in_iteration: a training iteration is open (gradient accumulation's second
                forward, say, even under ``no_grad``, belongs to it).
            untracked: inside ``run.untracked()``.
        """
        if untracked:
            return True
        return not in_iteration and not torch.is_grad_enabled()

    def note(self) -> None:
        self.forwards += 1


class CheckpointGuard:
    """State dict post hooks that replace every away tensor by a copy of its bytes.

    Args:
        run: the :class:`~tierflow.runtime.executor.Run` whose storages are looked up.

    The hooks are installed on every module of the model (each handles its own
    parameters and buffers, so a submodule's ``state_dict()`` is covered too) and on
    the optimizer; :meth:`remove` takes them off.
    """

    def __init__(self, run: Any) -> None:
        self._run = run
        self._handles: list[Any] = []
        self.copies = 0  # away tensors a state dict received as copies
        self.adopted = 0  # loaded optimizer state tensors replaced by copies the runtime made

    def install(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        # (a plain function: torch marks a public hook with an attribute, which a bound
        # method cannot take)
        hook = functools.partial(CheckpointGuard._module_hook, self)
        for m in model.modules():
            self._handles.append(m.register_state_dict_post_hook(hook))
        if optimizer is not None:
            self._handles.append(optimizer.register_state_dict_post_hook(self._optimizer_hook))
            self._handles.append(optimizer.register_load_state_dict_post_hook(self._adopt_loaded))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _module_hook(self, module: torch.nn.Module, state: dict, prefix: str, _meta: Any) -> None:
        for name, t in list(module._parameters.items()) + list(module._buffers.items()):
            key = prefix + name
            v = state.get(key)
            if isinstance(v, torch.Tensor) and t is not None:
                state[key] = self._safe(v)

    def _optimizer_hook(self, _opt: torch.optim.Optimizer, state: dict) -> dict:
        # NOTE: torch's state dict shares each parameter's state dict with the optimizer
        # itself: a copy goes into a new dict, never into the optimizer's own state
        packed = state.get("state", {})
        for pid, per_param in list(packed.items()):
            safe = {k: self._safe(v) if isinstance(v, torch.Tensor) else v for k, v in per_param.items()}
            if any(safe[k] is not v for k, v in per_param.items()):
                packed[pid] = safe
        return state

    def _adopt_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.load_state_dict()`` inside the block: state tensors whose
        storage cannot be resized (what ``torch.load`` or ``safetensors`` built, shared
        with the loaded dict as ``load_state_dict`` leaves them) are replaced by copies
        the runtime made, so that the plan can move them as before. The values are the
        same; only the loaded dict no longer shares them."""
        run = self._run
        if not run._open:
            return
        with run._own_ops():
            for state in optimizer.state.values():
                for k, v in list(state.items()):
                    if (isinstance(v, torch.Tensor) and getattr(v, run._dev_attr) is True
                            and not v.untyped_storage().resizable()):
                        state[k] = v.clone()
                        self.adopted += 1
            run._label_opt_state()  # (the copies take the state's keys: the plan finds them)

    def _away(self, t: torch.Tensor) -> _Entry | None:
        run = self._run
        if not run._open or getattr(t, run._dev_attr) is not True:
            return None
        e = run._entries.get(_storage_id(t))
        if e is None or e.ref() is None or (e.state is RESIDENT and e.arrival is None):
            return None
        return e

    def _safe(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself if its storage is on the device; else a copy of its bytes."""
        e = self._away(t)
        if e is None:
            return t
        run = self._run
        tier = e.tier if e.state is not RESIDENT else None
        with run._own_ops():
            # NOTE: no room is made for it: that would evict tensors this state dict
            # already holds (aliases, read by torch.save later). The bytes pass through
            # the device for one copy and go back to their tier.
            run._ensure_resident(e)
            # (on CUDA the copy goes to host memory: a device copy would hold device bytes
            # no budget counts for as long as the user keeps the state dict; torch.save
            # copies to the host anyway, and load_state_dict copies back to the device)
            copy = t.detach().to("cpu", copy=True) if run._cuda else t.detach().clone()
            if tier is not None and tier != "home":
                run._evict(e, tier)
        self.copies += 1
        return copy


__all__ = ["CheckpointGuard", "OutsideWork"]
