"""The end of an ``offload`` block: the model's and optimizer's tensors made whole again.

Inside the block a storage the plan sent away has no device bytes (its storage resized
to zero, its bytes in the host pool or the SSD file). When the block ends the tiers
close, so every such storage must get its bytes back somewhere. The first choice is the
device, where the user put the model: after the block it is as it was before. But a
model whose weights and optimizer state are larger than the device (the case tierflow
exists for) cannot all come back: fetching until the allocator fails would raise out of
``__exit__`` with half the state on the device and the host copies about to be freed,
and the trained model would be lost.

So before fetching anything, the bytes away are compared with the device's free memory.
Where they fit (the usual case), everything comes back as before. Where they do not, the
model's and optimizer's tensors move to the host instead, all of them (also those on the
device, so that the model and its optimizer are each on one device, not split): each
parameter's and buffer's ``.data``, each ``.grad`` and each optimizer state tensor is
re-bound to a CPU tensor holding its bytes (tensors that shared a storage, a tied
weight, share the new one), one storage at a time through the device, and a warning says
so once. ``model.to(device)`` and ``optimizer.load_state_dict`` move them back where there
is room. An out-of-memory error in the first path (the free memory was misjudged, another
process took it) switches to the second for what is left: nothing is lost.

NOTE: a tensor the loop itself kept that views a storage moved to the host (a slice of a
weight held in a Python variable) is not re-bound: it sees an empty storage afterwards.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import TierflowError
from ..units import fmt_bytes
from .recompute import DROPPED
from .storages import RESIDENT, _Entry, _storage_id

#: room the device keeps free when deciding whether the state fits (the allocator's
#: fragmentation and the kernels' workspaces)
_MARGIN = 0.05


def device_free_bytes(device: torch.device) -> int:
    """Bytes the device can still give: on CUDA the driver's free memory plus what the
    caching allocator holds unused; on the CPU the memory the OS reports available."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError):  # (not every OS names it)
        return 1 << 62


def bring_home(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device, *,
               storages: Any, mover: Any, ledger: Any, errors: list[str]) -> str:
    """Give every storage the run tracks that is away its bytes back (see the module
    docstring).

    Args:
        model, optimizer: the run's; their tensors are re-bound to CPU tensors where the
            state does not fit the device.
        device: the run's device.
        storages: the run's ``StorageTable`` (which storages are away).
        mover: the run's ``Mover`` (the fetches, and the copies to wait for).
        ledger: the run's ``DeviceLedger`` (a storage re-homed on the host leaves it).
        errors: collects the tiers' I/O errors (the state is brought home regardless).

    Returns:
        Where the state went: ``"device"`` or ``"host"``.
    """
    away = [e for e in list(storages.entries.values()) if _is_away(e)]
    need = sum(e.nbytes for e in away)
    if not away:
        return "device"
    if need <= (1 - _MARGIN) * device_free_bytes(device):
        try:
            for e in away:
                try:
                    mover.fetch(e)
                except TierflowError as err:
                    errors.append(str(err))
            return "device"
        except torch.OutOfMemoryError:
            pass  # (the free memory was misjudged: what is left goes to the host)
    moved = _rehome_on_host(model, optimizer, device, storages, mover, ledger, errors)
    warnings.warn(
        f"tierflow.offload: the model and optimizer state away from the device at the end of the block "
        f"({fmt_bytes(need)}) does not fit the device's free memory: {fmt_bytes(moved)} of parameters, "
        "gradients and optimizer state are now CPU tensors; model.to(device) moves the model back, "
        "and optimizer state follows with optimizer.load_state_dict(optimizer.state_dict()) once the "
        "parameters are there", stacklevel=3)
    return "host"


def _is_away(e: _Entry) -> bool:
    return e.state != RESIDENT and e.state is not DROPPED


def _state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device
                   ) -> Iterator[tuple[Any, Any, torch.Tensor]]:
    """(owner, slot, tensor) for every tensor of the model and optimizer: ``setattr``-like
    re-binding is ``_rebind(owner, slot, new)``."""
    for p in model.parameters():
        yield p, "data", p
        if p.grad is not None:
            yield p, "grad", p.grad
    for b in model.buffers():
        yield b, "data", b
    if optimizer is not None:
        for state in optimizer.state.values():
            for k, v in list(state.items()):
                if isinstance(v, torch.Tensor) and v.device.type == device.type:
                    yield state, k, v


def _rebind(owner: Any, slot: Any, new: torch.Tensor) -> None:
    if isinstance(owner, dict):
        owner[slot] = new
    elif slot == "grad":
        owner.grad = new
    else:
        owner.data = new


def _rehome_on_host(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device,
                    storages: Any, mover: Any, ledger: Any, errors: list[str]) -> int:
    """Every model and optimizer tensor on ``device`` re-bound to a CPU copy, one storage
    at a time (away ones fetched first); returns the bytes moved."""
    host: dict[int, torch.UntypedStorage] = {}  # device storage id -> its CPU copy
    moved = 0
    for owner, slot, t in list(_state_tensors(model, optimizer, device)):
        if t.device != device:
            continue
        sid = _storage_id(t)
        if sid not in host:
            e = storages.entries.get(sid)
            if e is not None and _is_away(e):
                try:
                    mover.fetch(e)  # (one storage's bytes on the device at a time)
                except TierflowError as err:
                    errors.append(str(err))
                    continue
                mover.drain_copies()
            st = t.untyped_storage()
            # (a copy also in CPU mode, where .cpu() would return the same storage)
            n = st.nbytes()
            host[sid] = torch.empty(n, dtype=torch.uint8).copy_(
                torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (n,), (1,))).untyped_storage()
            moved += n
            if e is not None and e.resizable and not e.foreign:
                st.resize_(0)  # (its bytes live on the host now: the next storage has the room)
                ledger.remove(min(ledger.used, e.nbytes))
        cpu = torch.empty(0, dtype=t.dtype).set_(host[sid], t.storage_offset(), t.size(), t.stride())
        _rebind(owner, slot, cpu)
    # what no model or optimizer tensor holds (a cut-short iteration's activations) comes
    # back to the device if it still can, else it dies with its graph
    for e in list(storages.entries.values()):
        if _is_away(e):
            try:
                mover.fetch(e)
            except (TierflowError, torch.OutOfMemoryError) as err:
                errors.append(str(err))
    return moved
