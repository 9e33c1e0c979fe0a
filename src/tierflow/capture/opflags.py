"""What an aten op does besides computing its results: the tensors it writes in place,
whether it draws random numbers, whether it has effects outside the tensors it touches.

These are the facts a recompute policy needs (:attr:`tierflow.trace.Op.rng`,
:attr:`tierflow.trace.Op.pure`); :mod:`tierflow.capture.recorder` calls them for every
op it records, and the runtime's profiler (:mod:`tierflow.runtime.opfacts`) calls the
same functions on the ``func, args, kwargs`` its ``__torch_dispatch__`` receives.

Where the facts come from:

* **writes** — the op schema's alias annotations (``Tensor(a!) self``: the argument's
  ``alias_info.is_write``), plus :data:`UNANNOTATED_WRITES`, the batch-norm kernels
  whose schemas do not declare that training updates ``running_mean``/``running_var``
  in place (``native_batch_norm``, ``cudnn_batch_norm``, ``miopen_batch_norm``; their
  in-place siblings ``_native_batch_norm_legit`` and ``_batch_norm_with_update`` are
  annotated).
* **random numbers** — PyTorch's ``torch.Tag.nondeterministic_seeded`` operator tag,
  which marks exactly the ops that read the generator (``bernoulli_``,
  ``native_dropout``, ``rand*``, ``normal_``, ``uniform_``, ``multinomial``,
  ``randperm``, the fused attention kernels...). The attention kernels and RNNs carry
  the tag because they *can* apply dropout; they draw only with a non-zero
  ``dropout_p``/``dropout`` argument, so those are read.
* **side effects** — collectives (the ``c10d`` and ``_c10d_functional`` namespaces:
  every rank must issue the same calls in the same order, so one rank re-running one
  breaks the group) and ``aten::_print``. Assertions and ``record_stream`` are safe to
  repeat and count as pure.

Whether a write makes an op unsafe to re-run depends on *what* it writes, which only
the recorder knows (a parameter, a buffer, optimizer state, a gradient, a batch tensor:
state that outlives the iteration), so :func:`writes` returns the tensors and the
recorder decides (see :func:`tierflow.capture.recorder.capture`; the runtime decides
the same way, in :mod:`tierflow.runtime.opfacts`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

#: Ops whose schema does not declare the in-place update they make: name -> (the
#: arguments written, the boolean argument that turns the update on).
UNANNOTATED_WRITES: dict[str, tuple[tuple[str, ...], str]] = {
    "aten::native_batch_norm": (("running_mean", "running_var"), "training"),
    "aten::cudnn_batch_norm": (("running_mean", "running_var"), "training"),
    "aten::miopen_batch_norm": (("running_mean", "running_var"), "training"),
}

#: Namespaces whose ops talk to other processes.
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor"})

#: Ops outside those namespaces whose effect a re-run would repeat.
SIDE_EFFECT_OPS = frozenset({"aten::_print"})

# arguments that switch a seeded op's random draw off when zero / False
_DROPOUT_ARGS = ("dropout_p", "dropout")
_TRAIN_ARGS = ("train", "training")


def _arg(func: Any, args: tuple, kwargs: dict, name: str) -> tuple[bool, Any]:
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            if i < len(args):
                return True, args[i]
            if name in kwargs:
                return True, kwargs[name]
            return True, a.default_value if a.has_default_value() else None
    return False, None


def writes(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments ``func`` writes in place (``self`` of ``add_``, ``out=``,
    a training batch norm's running statistics).

    Args:
        func: the ``OpOverload`` a dispatch mode received; args, kwargs: its arguments.

    Example:
        >>> import torch
        >>> x = torch.zeros(2)
        >>> writes(torch.ops.aten.add_.Tensor, (x, torch.ones(2)), {})[0] is x
        True
    """
    out: list[torch.Tensor] = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        out += [x for x in pytree.tree_leaves(v) if isinstance(x, torch.Tensor)]
    extra = UNANNOTATED_WRITES.get(func._schema.name)
    if extra is not None:
        names, switch = extra
        _, on = _arg(func, args, kwargs, switch)
        if on:
            for n in names:
                _, v = _arg(func, args, kwargs, n)
                if isinstance(v, torch.Tensor) and not any(v is x for x in out):
                    out.append(v)
    return out


def draws_random(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` reads the random-number generator: tagged
    ``nondeterministic_seeded``, and not switched off by a zero dropout probability or
    ``train=False``.

    Example:
        >>> import torch
        >>> draws_random(torch.ops.aten.bernoulli_.float, (torch.empty(2), 0.5), {})
        True
        >>> draws_random(torch.ops.aten.mm.default, (torch.eye(2), torch.eye(2)), {})
        False
    """
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    for name in _DROPOUT_ARGS:
        found, v = _arg(func, args, kwargs, name)
        if found and isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0:
            return False
    for name in _TRAIN_ARGS:
        found, v = _arg(func, args, kwargs, name)
        if found and v is False:
            return False
    return True


def has_side_effects(func: Any) -> bool:
    """Whether running ``func`` again is not the same as running it once for a reason
    other than the tensors it writes: a collective, a print."""
    name = func._schema.name
    return name.split("::", 1)[0] in COLLECTIVE_NAMESPACES or name in SIDE_EFFECT_OPS
