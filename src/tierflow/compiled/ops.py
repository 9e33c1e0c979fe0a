"""The custom ops a compiled graph calls to move a saved activation: ``tierflow::offload``
(in the forward graph, after the tensor's last forward use) and, in the backward graph,
``tierflow::prefetch`` (where the plan starts the copy back, ahead of the first backward
use) with ``tierflow::wait`` (at the first backward use), or ``tierflow::reload`` (both
at once, before the use: a gradient brought back as the graph returns).

``offload`` hands the tensor to the back-end (:mod:`tierflow.runtime.backend`) and
returns a *token*: an int64 CPU tensor of shape ``(0, *shape)`` (the saved tensor's
shape behind a leading 0, so it has no elements), all strides 0, over one element of
storage that holds the back-end's ticket. The token is what the
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
    # A leading dimension of 0: no elements, so inductor's memory planning (which counts
    # a buffer as numel * itemsize and reorders nodes by it) sees the token as free, as
    # it is; the ticket sits in the one-element storage under the view.
    store = torch.empty(1, dtype=torch.int64, device="cpu")
    if ticket is not None:
        store.fill_(ticket)
    return store.as_strided((0, *shape), (0,) * (len(shape) + 1))


def _ticket(token: torch.Tensor) -> int:
    return int(token.as_strided((), ()).item())


def _shape(token: torch.Tensor) -> list:
    """The saved tensor's shape a token carries (symbolic under dynamic shapes)."""
    return list(token.shape[1:])


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
    ticket = _ticket(token)
    return backend_for(device).take(ticket)


@reload.register_fake
def _reload_fake(
    token: torch.Tensor, after: torch.Tensor, order: list[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    shape = [_shape(token)[d] for d in order]
    return torch.empty(shape, dtype=dtype, device=device).permute(_inverse(order))


@torch.library.custom_op("tierflow::prefetch", mutates_args=())
def prefetch(token: torch.Tensor, after: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Start the copy back of :func:`offload`'s ``token`` to ``device`` (a side-stream
    copy on CUDA, done at once on the CPU); a token for :func:`wait`.

    ``after`` is not read: the tensor the backward graph computes just before the point
    the plan chose for the copy to start (``None``: the graph's start), so the compiler
    does not issue the copy earlier than the budget allows."""
    ticket = _ticket(token)
    return _token(_shape(token), backend_for(device).start(ticket))


@prefetch.register_fake
def _prefetch_fake(token: torch.Tensor, after: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    return _token(_shape(token), None)


@torch.library.custom_op("tierflow::wait", mutates_args=())
def wait(
    token: torch.Tensor, after: torch.Tensor, order: list[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The tensor whose copy back :func:`prefetch` started, once the compute stream waits
    for it, with its original strides. ``after`` is not read, as for :func:`reload`: it
    keeps the wait at the first use (waiting earlier would stall on a copy still
    running)."""
    ticket = _ticket(token)
    return backend_for(device).finish(ticket)


@wait.register_fake
def _wait_fake(
    token: torch.Tensor, after: torch.Tensor, order: list[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return _reload_fake(token, after, order, dtype, device)
