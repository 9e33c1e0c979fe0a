"""Capture a built-in model by name: what ``--model NAME --batch B`` resolves to."""

from __future__ import annotations

from typing import Any

from ..errors import TraceError
from ..hardware import Hardware
from .recorder import DEFAULT_HARDWARE, capture


def zoo_trace(
    name: str,
    batch: int | None = None,
    seq: int | None = None,
    dtype: str = "fp32",
    hardware: str | Hardware | None = None,
    device: str = "meta",
    optimizer: str = "adamw",
    autocast: str | None = None,
    accumulation_steps: int = 1,
    progress: Any = None,
) -> Any:
    """The trace of one training iteration of zoo model ``name``.

    On ``meta`` (the default) nothing is allocated and durations come from the roofline
    cost model for ``hardware`` (default ``h100-80g-pcie5-nvme``); on ``cpu``/``cuda``
    the model is built, run and timed.

    Args:
        name: a name from :func:`tierflow.capture.zoo.names`.
        batch: batch size (default: the model's benchmark batch, :attr:`Spec.batch`).
        seq: sequence length for language models (default :attr:`Spec.seq`).
        dtype: ``"fp32"`` or ``"bf16"`` parameters and compute.
        hardware: preset name or :class:`Hardware` for the cost model.
        device: ``"meta"``, ``"cpu"`` or ``"cuda"``.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"`` or ``"none"``.
        autocast: ``"bf16"`` for mixed precision (fp32 parameters, bf16 compute).
        accumulation_steps: micro-batches per optimizer step.
        progress: called with a few words as each phase of the capture starts.

    Raises:
        TraceError: unknown model, dtype or device; a bad batch or sequence length.

    Example:
        >>> t = zoo_trace("mlp-tiny", batch=8)
        >>> t.meta["model"], t.meta["batch"]
        ('mlp-tiny', 8)
    """
    from . import zoo

    s = zoo.spec(name)
    if device not in ("meta", "cpu", "cuda"):
        raise TraceError(f"device must be meta, cpu or cuda, got {device!r}")
    batch = s.batch if batch is None else batch
    if s.seq is not None and seq is None:
        seq = s.seq
    if progress is not None:
        progress(f"building the model on {device}")
    m = zoo.build(name, dtype=dtype, device=device)
    inputs, target = m.make_batch(batch, seq)
    hw = hardware or (DEFAULT_HARDWARE if device == "meta" else None)
    return capture(
        m.model, inputs, m.loss_fn, optimizer, device, target=target, hardware=hw,
        autocast=autocast, accumulation_steps=accumulation_steps, progress=progress,
        name=f"{name}-b{batch}" + (f"-s{seq}" if seq is not None else "") + f"-{dtype}",
        meta={"model": name, "batch": batch, "seq": seq, "dtype": dtype},
    )
