"""Capture: record one training iteration of a PyTorch model as a Trace.

``tierflow.capture(model, batch, ...)`` (this module is callable) records forward,
backward and optimizer step op by op; :func:`zoo_trace` does the same for a built-in
model by name; :mod:`tierflow.capture.cost` is the roofline cost model used on ``meta``;
:mod:`tierflow.capture.zoo` holds the built-in models; :mod:`tierflow.capture.scope` and
:mod:`tierflow.capture.opflags` say what each op ran under and whether it may be re-run;
:mod:`tierflow.capture.host` measures the host's optimizer throughput.

Example:
    >>> import torch, tierflow
    >>> net = torch.nn.Linear(16, 4)
    >>> trace = tierflow.capture(net, torch.randn(8, 16), device="meta")
    >>> trace.meta["param_count"]
    68
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

# Everything here imports torch; load it on first use so that the CLI (which registers
# this package's commands on every start) and ``import tierflow`` stay fast.
_LAZY = {
    "DEFAULT_HARDWARE": ".recorder",
    "capture": ".recorder",
    "summarize": ".summary",
    "zoo_trace": ".from_zoo",
}

__all__ = ["DEFAULT_HARDWARE", "capture", "summarize", "zoo_trace"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _CallableModule(types.ModuleType):
    """Lets ``tierflow.capture(model, batch)`` call :func:`capture` while
    ``tierflow.capture.zoo_trace`` and friends stay reachable as module attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return importlib.import_module(".recorder", __name__).capture(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
