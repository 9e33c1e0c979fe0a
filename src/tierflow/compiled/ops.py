"""The two custom ops a compiled graph calls to move a saved activation: ``tierflow::offload``
(in the forward graph, after the tensor's last forward use) and ``tierflow::reload`` (in
the backward graph, before its first backward use).

``offload`` hands the tensor to the back-end (:mod:`tierflow.runtime.backend`) and
returns a *token*: an int64 CPU tensor of the saved tensor's shape whose strides are all
0 (one element of storage, holding the back-end's ticket). The token is what the
forward graph saves instead of the tensor, so autograd keeps 8 bytes alive, and because
it has the tensor's (possibly symbolic) shape, ``reload``'s fake kernel knows the shape
without reading a size that would specialize a dynamic graph. ``reload`` gives back a
tensor with the original strides (``order`` is the dimension order that made it dense).

Both ops are registered with fake kernels, so Dynamo, AOT autograd and inductor trace
through them; inductor calls them as extern kernels.
"""

from __future__ import annotations

import torch

from ..runtime.backend import backend_for


def _token(shape: torch.Size | list, ticket: int | None) -> torch.Tensor:
    tok = torch.empty_strided(tuple(shape), (0,) * len(shape), dtype=torch.int64, device="cpu")
    if ticket is not None:
        tok.fill_(ticket)
    return tok


@torch.library.custom_op("tierflow::offload", mutates_args=())
def offload(x: torch.Tensor, slot: int) -> torch.Tensor:
    """Copy ``x`` to the host tier of its device's back-end; a token for :func:`reload`."""
    return _token(x.shape, backend_for(x.device).put(slot, x))


@offload.register_fake
def _offload_fake(x: torch.Tensor, slot: int) -> torch.Tensor:
    return _token(x.shape, None)


def _inverse(order: list[int]) -> list[int]:
    inv = [0] * len(order)
    for i, d in enumerate(order):
        inv[d] = i
    return inv


@torch.library.custom_op("tierflow::reload", mutates_args=())
def reload(
    token: torch.Tensor, after: torch.Tensor, order: list[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The tensor :func:`offload` copied out, back on ``device`` with its strides.

    ``after`` is not read: it is the tensor the backward graph computes just before the
    reloaded tensor's first use, an input only so that the compiler cannot run the
    reload earlier (inductor schedules an op with no pending input as early as it can,
    which would bring every offloaded tensor back at the start of backward)."""
    ticket = int(token.as_strided((), ()).item())
    return backend_for(device).take(ticket)


@reload.register_fake
def _reload_fake(
    token: torch.Tensor, after: torch.Tensor, order: list[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    shape = [token.shape[d] for d in order]
    return torch.empty(shape, dtype=dtype, device=device).permute(_inverse(order))
