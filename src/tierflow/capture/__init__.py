"""Capture: record one training iteration of a PyTorch model as a Trace.

``tierflow.capture(model, batch, ...)`` (this module is callable) records forward,
backward and optimizer step op by op; :func:`zoo_trace` does the same for a built-in
model by name; :mod:`tierflow.capture.cost` is the roofline cost model used on ``meta``;
:mod:`tierflow.capture.zoo` holds the built-in models.

Example:
    >>> import torch, tierflow
    >>> net = torch.nn.Linear(16, 4)
    >>> trace = tierflow.capture(net, torch.randn(8, 16), device="meta")
    >>> trace.meta["param_count"]
    68
"""

from __future__ import annotations

import sys
import types

from .recorder import DEFAULT_HARDWARE, capture
from .summary import summarize
from .zoo_trace import zoo_trace

__all__ = ["DEFAULT_HARDWARE", "capture", "summarize", "zoo_trace"]


class _CallableModule(types.ModuleType):
    """Lets ``tierflow.capture(model, batch)`` call :func:`capture` while
    ``tierflow.capture.zoo_trace`` and friends stay reachable as module attributes."""

    def __call__(self, *args, **kwargs):
        return capture(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
