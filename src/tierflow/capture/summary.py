"""Headline numbers of a trace, for ``tierflow inspect`` and the benchmark tables."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..trace import KINDS, PHASES, Trace


def kind_live_bytes(trace: Trace, kind: str) -> np.ndarray:
    """Bytes of tensors of ``kind`` live during each op (same liveness as
    :attr:`Trace.live_bytes`)."""
    mask = np.fromiter((t.kind == kind for t in trace.tensors), dtype=bool, count=trace.n_tensors)
    delta = np.zeros(trace.n_ops + 1, dtype=np.int64)
    np.add.at(delta, trace.birth[mask], trace.sizes[mask])
    np.add.at(delta, trace.death[mask] + 1, -trace.sizes[mask])
    return np.cumsum(delta[:-1])


def summarize(trace: Trace) -> dict[str, Any]:
    """Ops, tensors, bytes per kind, peak live bytes and where it occurs, ideal time.

    Returns:
        A dict with at least ``ops, tensors, param_bytes, grad_bytes, optimizer_bytes,
        activation_peak_bytes, peak_live_bytes, ideal_s``, plus ``name``,
        ``input_bytes``, ``temporary_peak_bytes``, ``peak_op`` (index), ``peak_op_name``,
        ``peak_phase``, ``bytes_by_kind``, ``phase_s`` (seconds per phase) and ``meta``.

    Example:
        >>> import torch
        >>> from tierflow.capture import capture
        >>> s = summarize(capture(torch.nn.Linear(4, 4), torch.randn(2, 4), device="meta"))
        >>> s["param_bytes"], s["optimizer_bytes"]
        (80, 160)
    """
    kinds = trace.bytes_by_kind()
    peak_op = trace.peak_op
    phase_s = {p: 0.0 for p in PHASES}
    for o in trace.ops:
        phase_s[o.phase] += o.duration_s
    empty = trace.n_ops == 0
    return {
        "name": trace.name,
        "ops": trace.n_ops,
        "tensors": trace.n_tensors,
        "param_bytes": kinds["parameter"],
        "grad_bytes": kinds["gradient"],
        "optimizer_bytes": kinds["optimizer_state"],
        "input_bytes": kinds["input"],
        "activation_peak_bytes": 0 if empty else int(kind_live_bytes(trace, "activation").max()),
        "temporary_peak_bytes": 0 if empty else int(kind_live_bytes(trace, "temporary").max()),
        "peak_live_bytes": trace.peak_live_bytes,
        "peak_op": peak_op,
        "peak_op_name": None if empty else trace.ops[peak_op].name,
        "peak_phase": None if empty else trace.ops[peak_op].phase,
        "ideal_s": trace.ideal_s,
        "phase_s": phase_s,
        "bytes_by_kind": {k: kinds[k] for k in KINDS},
        "meta": dict(trace.meta),
    }
