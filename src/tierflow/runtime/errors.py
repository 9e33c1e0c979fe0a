"""Errors the runtime raises on purpose. All are :class:`~tierflow.errors.TierflowError`
subclasses, so the CLI prints them as one line and exits 2."""

from __future__ import annotations

from ..errors import TierflowError


class OffloadError(TierflowError):
    """The runtime cannot keep going (a tier is full, a tensor it must move cannot be
    moved). Model and optimizer state are brought back to the device before it
    propagates out of the ``with`` block."""


class BudgetError(OffloadError):
    """The device budget is below the minimum working set: no schedule can fit. Raised
    before the optimizer's first step, so the model and optimizer are untouched."""


class SSDError(OffloadError):
    """The SSD tier failed: the file could not be created or pre-allocated (the
    filesystem is full), or a read or write failed. A failed write loses nothing: the
    bytes are still in the bounce buffer and the tensor is restored to the device."""
