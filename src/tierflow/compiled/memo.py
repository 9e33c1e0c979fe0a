"""What a graph's plan asks of the front-end, kept for when torch's caches answer.

A plan has two halves: what is inside the compiled code (the offload and reload ops),
and what the front-end does around it (host buffers reserved before the first call,
gradient hooks, the graph's report). When torch's FX graph or AOT autograd cache has
the compiled code for a graph, the partitioner does not run, so the second half would
be lost: the graph would run its offloads with no gradients moved and report nothing.
:class:`PlanMemo` keeps that half by a key made of the graph's code, its inputs' shapes
and the partitioner's cache key (which holds the budget and this package's code), in
memory and in a JSON file beside torch's own cache, so a later process that hits
torch's cache finds it too.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch


def graph_key(gm: torch.fx.GraphModule, example_inputs: list[Any], partitioner_key: str) -> str:
    """A digest of what makes a graph's plan: its code, inputs and the partitioner's key."""
    parts = [partitioner_key, gm.code]
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            parts.append(f"T{tuple(x.shape)}:{x.dtype}:{x.requires_grad}:{x.is_leaf}")
        else:
            parts.append(f"{type(x).__name__}:{x}")
    return hashlib.sha256("\n".join(map(str, parts)).encode()).hexdigest()[:32]


def _directory() -> Path | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return Path(cache_dir()) / "tierflow_plans"
    except Exception:  # noqa: BLE001 - no inductor cache here: memory only
        return None


class PlanMemo:
    """Plans' front-end halves by :func:`graph_key`: in memory, and on disk when torch's
    cache directory is known (a failed write loses nothing but the reuse)."""

    _memory: dict[str, dict[str, Any]] = {}

    def save(self, key: str, data: dict[str, Any]) -> None:
        self._memory[key] = data
        d = _directory()
        if d is None:
            return
        try:
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f"{key}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(data))
            tmp.replace(d / f"{key}.json")
        except OSError:
            pass

    def load(self, key: str) -> dict[str, Any] | None:
        if key in self._memory:
            return self._memory[key]
        d = _directory()
        if d is None:
            return None
        try:
            data = json.loads((d / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None
        self._memory[key] = data
        return data


__all__ = ["PlanMemo", "graph_key"]
