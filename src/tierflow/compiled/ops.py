"""The custom ops a compiled graph calls to move a saved activation: ``tierflow::offload``
(in the forward graph, after the tensor's last forward use) and, in the backward graph,
``tierflow::prefetch`` (where the plan starts the copy back, ahead of the first backward
use) with ``tierflow::wait`` (at the first backward use) on CUDA, or ``tierflow::reload``
(both at once, right before the use: on the CPU, and for a gradient brought back as the
graph returns).

``offload`` hands the tensor to the back-end (:mod:`tierflow.runtime.backend`) and
returns a *token*: an int64 CPU tensor of the saved tensor's shape whose strides are all
0 (one element of storage, holding the back-end's ticket). The token is what the
forward graph saves instead of the tensor, so autograd keeps 8 bytes alive, and because
it has the tensor's (possibly symbolic) shape, ``reload``'s fake kernel knows the shape
without reading a size that would specialize a dynamic graph. ``reload`` gives back a
tensor with the original strides (``order`` is the dimension order that made it dense).

``prefetch`` returns the device tensor the copy back writes, so the compiler sees its
bytes from where they are allocated; ``wait`` is declared as writing that tensor, so
every reader of it runs after the wait (and a wait, having no output, is never dropped
as dead code).

``offload_received`` is ``offload`` for a gradient the backward graph receives (a tangent), between
its early and its late readers (see :func:`offload_received`).

The ops are registered with fake kernels, so Dynamo, AOT autograd and inductor trace
through them; inductor calls them as extern kernels.
"""

from __future__ import annotations

import torch

from ..runtime.backend import backend_for, inverse_order


def _token(shape: torch.Size | list, ticket: int | None) -> torch.Tensor:
    tok = torch.empty_strided(tuple(shape), (0,) * len(shape), dtype=torch.int64, device="cpu")
    if ticket is not None:
        tok.fill_(ticket)
    return tok


def _no_element_token(shape: torch.Size | list, ticket: int | None) -> torch.Tensor:
    """A token of ``shape`` with a last dimension of size 0: no elements, so that
    inductor's peak-memory model (elements x dtype size, strides not read) sees an op
    that makes it as allocating nothing; its one-element storage holds the ticket. The
    extra dimension is past the ones :func:`reload` reads (``order`` names the others)."""
    one = torch.full((1,), -1 if ticket is None else ticket, dtype=torch.int64, device="cpu")
    return one.as_strided((*shape, 0), (0,) * (len(shape) + 1))


def _ticket(token: torch.Tensor) -> int:
    return int(token.as_strided((), ()).item())


@torch.library.custom_op("tierflow::offload", mutates_args=())
def offload(x: torch.Tensor, slot: int) -> torch.Tensor:
    """Copy ``x`` to the host tier of its device's back-end; a token for :func:`reload`."""
    return _token(x.shape, backend_for(x.device).put(slot, x))


@offload.register_fake
def _offload_fake(x: torch.Tensor, slot: int) -> torch.Tensor:
    return _token(x.shape, None)


@torch.library.custom_op("tierflow::reload", mutates_args=())
def reload(
    token: torch.Tensor, after: torch.Tensor, order: list[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The tensor :func:`offload` copied out, back on ``device`` with its strides.

    ``after`` is not read: it is the tensor the backward graph computes just before the
    reloaded tensor's first use, an input only so that the compiler cannot run the
    reload earlier (inductor schedules an op with no pending input as early as it can,
    which would bring every offloaded tensor back at the start of backward)."""
    return backend_for(device).take(_ticket(token))


@reload.register_fake
def _reload_fake(
    token: torch.Tensor, after: torch.Tensor, order: list[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    shape = [token.shape[d] for d in order]
    return torch.empty(shape, dtype=dtype, device=device).permute(inverse_order(order))


@torch.library.custom_op("tierflow::prefetch", mutates_args=())
def prefetch(
    token: torch.Tensor, after: torch.Tensor | None, order: list[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Start the copy back of :func:`offload`'s ``token`` (a side-stream copy on CUDA,
    done at once on the CPU): the device tensor it writes, with the original strides,
    not to be read before :func:`wait` has run on it.

    The tensor is the op's output so that the compiler counts its bytes from here, where
    they are allocated (inductor orders nodes by the memory it sees). ``after`` is not
    read: the tensor the backward graph computes just before the point the plan chose for
    the copy to start (``None``: the graph's start), so that the copy is not issued
    earlier than the budget allows."""
    be = backend_for(device)
    return be.arriving(be.start(_ticket(token)))


@prefetch.register_fake
def _prefetch_fake(
    token: torch.Tensor, after: torch.Tensor | None, order: list[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    shape = [token.shape[d] for d in order]
    return torch.empty(shape, dtype=dtype, device=device).permute(inverse_order(order))


@torch.library.custom_op("tierflow::wait", mutates_args=("x",))
def wait(x: torch.Tensor, token: torch.Tensor, after: torch.Tensor) -> None:
    """The compute stream waits for the copy back into ``x`` that :func:`prefetch`
    started for ``token``. Declared as writing ``x`` (the copy lands in it), so that the
    compiler runs every reader of ``x`` after this op; ``after`` is not read, as for
    :func:`reload`: it keeps the wait at the first use (waiting earlier would stall on a
    copy still running)."""
    backend_for(x.device).finish(_ticket(token))


@wait.register_fake
def _wait_fake(x: torch.Tensor, token: torch.Tensor, after: torch.Tensor) -> None:
    return None



@torch.library.custom_op("tierflow::offload_received", mutates_args=())
def offload_received(x: torch.Tensor, slot: int) -> torch.Tensor:
    """Copy ``x`` to the host tier of its device's back-end; a token for :func:`reload`
    with no elements (:func:`_no_element_token`).

    For a gradient a backward graph receives (a tangent) between its early readers and
    its late ones (:func:`tierflow.compiled.hook.rewrite_tangents`): the late readers
    read the copy :func:`reload` brings back, so this op is the tangent's last reader
    and the compiled code drops it here (nothing outside the graph holds it: measured,
    HF GPT-2's logits' gradient left the allocator's peak as it does when freed in
    place)."""
    return _no_element_token(x.shape, backend_for(x.device).put(slot, x))


@offload_received.register_fake
def _offload_received_fake(x: torch.Tensor, slot: int) -> torch.Tensor:
    # NOTE: a token with x's elements (as offload's) counts in inductor's peak-memory
    # model as 8-byte elements allocated here: the evict then ran just before its
    # reload, holding the tangent through the gap; with none it runs after the early
    # readers, as the tangent's last reader.
    return _no_element_token(x.shape, None)
