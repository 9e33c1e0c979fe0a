"""tierflow: train models whose tensors do not fit in GPU memory.

Profile one iteration into a :class:`Trace`, plan where every tensor lives and when it
moves (:class:`Plan`, made by a policy), predict the step on a :class:`Hardware` model
with :func:`simulate`, then execute the plan in real training.

The core import is light: numpy and torch only; plotting, solvers and rich are imported
where they are used.
"""

from .errors import HardwareError, PlanError, PolicyError, SimulationError, TierflowError, TraceError
from .hardware import Hardware, Link, Tier, load_hardware, preset_names
from .plan import Move, Plan, validate
from .trace import Gap, Op, TensorInfo, Trace, load_trace

__version__ = "0.1.0"


def __getattr__(name: str):
    # ``tierflow.capture`` (callable: ``tierflow.capture(model, batch)``) is imported on
    # first use so that ``import tierflow`` stays light.
    if name == "capture":
        import importlib

        return importlib.import_module(".capture", __name__)
    if name == "offload":  # the runtime (``with tierflow.offload(model, opt, budget=...)``), lazily too
        from .runtime import offload

        return offload
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Gap",
    "Hardware",
    "HardwareError",
    "Link",
    "Move",
    "Op",
    "Plan",
    "PlanError",
    "PolicyError",
    "SimulationError",
    "TensorInfo",
    "Tier",
    "TierflowError",
    "Trace",
    "TraceError",
    "load_hardware",
    "load_trace",
    "preset_names",
    "validate",
]
