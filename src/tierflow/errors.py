"""One exception type per layer, each naming the file, record and field at fault.

The CLI catches :class:`TierflowError` and prints its message as one line (exit 2);
library users can catch the layer-specific subclass they care about.
"""

from __future__ import annotations


class TierflowError(Exception):
    """Base of every error tierflow raises on purpose (bad input, impossible request)."""


class TraceError(TierflowError):
    """A trace file or in-memory trace is malformed."""


class HardwareError(TierflowError):
    """A hardware description is malformed or names an unknown preset."""


class PlanError(TierflowError):
    """A plan is inconsistent with its trace or hardware, or no plan can fit."""


class SimulationError(TierflowError):
    """The simulator cannot run a plan (for example one op needs more than the device)."""


class PolicyError(TierflowError):
    """An unknown policy name or a bad policy option."""
