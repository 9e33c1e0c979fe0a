"""The compiled front-end: ``torch.compile``'d models whose graphs carry tierflow's plan
for their saved activations (docs/compiled.md).

Example:
    >>> import tierflow.compiled
    >>> run = tierflow.compiled.compile(model, budget="50%")  # doctest: +SKIP
    >>> loss = loss_fn(run.model(x), y)                          # doctest: +SKIP
"""

from __future__ import annotations

from . import ops  # noqa: F401 - the custom ops cached compiled graphs call
from .frontend import BACKENDS, Budget, BudgetWarning, CallCounter, CompiledOffload, GraphReport, compile
from .hook import hook_support

__all__ = ["BACKENDS", "Budget", "BudgetWarning", "CallCounter", "CompiledOffload", "GraphReport", "compile", "hook_support"]
