"""The ``nn.Module`` an aten op ran under, in forward and in backward.

:class:`ScopeTracker` gives every op dispatched while it is active the path of the
innermost module of the model it belongs to (``blocks.3.mlp``, ``""`` for the model
itself; the paths of ``model.named_modules()``), or ``None`` for an op that ran under
no module of the model (a loss function outside the model, the optimizer step).

* **Forward**: global module forward pre- and post-hooks
  (``torch.nn.modules.module.register_module_forward_pre_hook``) keep a stack of the
  modules being run; an op's scope is the top of the stack.
* **Backward**: no module runs, so the op is tied to the forward op it differentiates.
  The autograd engine exposes the node it is executing
  (``torch._C._current_autograd_node()``); every node carries the sequence number it
  was created with in forward (``Node._sequence_nr()``), drawn from the per-thread
  counter ``torch._C._autograd._get_sequence_nr()``. The tracker reads that counter at
  every forward op: the numbers handed out since the previous op belong to the nodes
  the current op's autograd kernel just created (autograd creates the node before it
  redispatches the op below), so they get the current scope. A backward op's scope is
  then its node's forward scope, and an ``AccumulateGrad`` node's (the gradient
  written into ``param.grad``) the scope of the module that owns the parameter.
  Ops the engine runs outside any node (the ``ones_like`` seeding ``loss.backward()``)
  have scope ``None``.

Why not ``torch.utils.module_tracker.ModuleTracker``: it keeps a *set* of module names
(no innermost one), names them by class (``GPT.blocks.0``, not the state-dict path)
and, in backward, leaves a module "entered" until the end of the pass when its inputs
need no gradient (the first layer fed by the batch), so backward scopes drift. The
sequence-number link is exact: each backward op runs inside exactly one node, and
that node was made by exactly one forward op.

A module that runs again in backward (``torch.utils.checkpoint`` recomputing it)
pushes itself on the stack, so recomputed forward ops get their module's scope too.

Example:
    >>> import torch
    >>> from torch.utils._python_dispatch import TorchDispatchMode
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> seen = []
    >>> class Spy(TorchDispatchMode):
    ...     def __torch_dispatch__(self, func, types, args=(), kwargs=None):
    ...         seen.append(tracker.scope())
    ...         return func(*args, **(kwargs or {}))
    >>> x = torch.randn(2, 4)
    >>> with ScopeTracker(net) as tracker, Spy():
    ...     net(x).sum().backward()
    >>> seen[:3], seen[-1]
    (['0', '0', '1'], '0')
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

# The per-thread counter autograd numbers its nodes from. A build without it (not seen in
# the supported versions) still gets forward scopes; backward ops then get ``None``.
_seq_now = getattr(torch._C._autograd, "_get_sequence_nr", lambda: 0)


class ScopeTracker:
    """Context manager: while active, :meth:`scope` answers for the op being dispatched.

    Call :meth:`scope` once per dispatched op (from ``__torch_dispatch__``), forward
    and backward: the forward calls are what link autograd nodes to scopes.

    Args:
        model: the module whose ``named_modules()`` paths name the scopes. Modules
            outside it (a loss ``nn.Module`` passed separately) are transparent.
    """

    def __init__(self, model: torch.nn.Module):
        self._path: dict[int, str] = {}
        for name, mod in model.named_modules():
            self._path.setdefault(id(mod), name)
        self._param_scope: dict[int, str] = {}
        for name, p in model.named_parameters():
            self._param_scope.setdefault(id(p), name.rpartition(".")[0])
        self._modules = list(model.modules())  # keep ids valid while tracking
        self._stack: list[str | None] = []
        self._node_scope: dict[int, str | None] = {}
        self._next_seq = 0
        self._handles: list[Any] = []

    def __enter__(self) -> ScopeTracker:
        self._next_seq = _seq_now()
        self._handles = [
            register_module_forward_pre_hook(self._enter_module),
            register_module_forward_hook(self._leave_module, always_call=True),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._stack.clear()

    def push(self, module: torch.nn.Module) -> None:
        """Count ``module`` as entered, for a tracker made active from inside that
        module's own forward pre-hook: ``nn.Module.__call__`` has already read the
        global hooks for that call, so only its forward post-hook (which pops) will
        run. The runtime does this for the model whose forward begins an iteration."""
        self._enter_module(module, ())

    def _enter_module(self, mod: torch.nn.Module, args: Any) -> None:
        top = self._stack[-1] if self._stack else None
        self._stack.append(self._path.get(id(mod), top))

    def _leave_module(self, mod: torch.nn.Module, args: Any, out: Any) -> None:
        if self._stack:
            self._stack.pop()

    def scope(self) -> str | None:
        """The module path of the op being dispatched now (see the module docstring)."""
        if self._stack:
            current = self._stack[-1]
        else:
            node = torch._C._current_autograd_node()
            current = self._of_node(node) if node is not None else None
        if torch._C._current_graph_task_id() == -1:  # forward: claim the nodes just made
            seq = _seq_now()
            for k in range(self._next_seq, seq):
                self._node_scope[k] = current
            self._next_seq = max(self._next_seq, seq)
        return current

    def _of_node(self, node: Any) -> str | None:
        seq = node._sequence_nr()
        if seq in self._node_scope:
            return self._node_scope[seq]
        var = getattr(node, "variable", None)  # AccumulateGrad: the leaf it writes .grad of
        if isinstance(var, torch.Tensor):
            return self._param_scope.get(id(var))
        return None
