"""Roofline cost model: FLOPs and bytes per aten op, and the time they take on a device.

An op's time is ``max(flops / peak, bytes / memory_bandwidth) + launch overhead``: compute
bound ops (matmul, convolution, attention) are priced by their FLOPs against the peak of
the dtype they run in, everything else by the bytes it reads and writes against the
device's memory bandwidth. View and metadata ops (``view``, ``t``, ``expand``,
``detach``, ``empty``...) launch no kernel and cost nothing.

The formulas count multiply-adds as two FLOPs, and count bytes as the elements each
tensor argument and result spans (not its whole storage: a slice reads only its slice).

Example:
    >>> from tierflow.hardware import load_hardware
    >>> hw = load_hardware("h100-80g-pcie5-nvme")
    >>> round(roofline(2 * 4096**3, 3 * 4096 * 4096 * 4, hw.compute, "fp32") * 1e3, 3)
    2.056
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..hardware import Compute

#: Seconds added to every op that launches a kernel (eager launch + dispatch overhead).
LAUNCH_OVERHEAD_S = 4e-6

_LOW_PRECISION = {torch.bfloat16, torch.float16}

# Ops that allocate or re-describe memory without running a kernel.
_FREE_OPS = {
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::detach",
    "aten::lift_fresh",
    "aten::_local_scalar_dense",
    "aten::set_",
    "aten::resize_",
    "aten::scalar_tensor",
    "aten::_unsafe_view",
}


def roofline(flops: float, nbytes: float, compute: Compute, dtype: str = "fp32", overhead_s: float = 0.0) -> float:
    """Seconds an op with ``flops`` and ``nbytes`` of memory traffic takes on ``compute``.

    Args:
        flops: floating-point operations (a multiply-add is two).
        nbytes: bytes read plus bytes written.
        compute: the device's peak rates (:class:`tierflow.hardware.Compute`).
        dtype: ``"fp32"`` or ``"bf16"`` (also used for fp16): which peak FLOP rate applies.
        overhead_s: added once (kernel launch).

    Raises:
        ValueError: a negative count or an unknown dtype.

    Example:
        >>> from tierflow.hardware import Compute
        >>> roofline(1e12, 0, Compute(1e12, 2e12, 1e12), "fp32")
        1.0
    """
    if flops < 0 or nbytes < 0:
        raise ValueError(f"flops and bytes must be >= 0, got {flops}, {nbytes}")
    if dtype == "fp32":
        peak = compute.peak_flops_fp32
    elif dtype in ("bf16", "fp16"):
        peak = compute.peak_flops_bf16
    else:
        raise ValueError(f"dtype must be 'fp32' or 'bf16', got {dtype!r}")
    return max(flops / peak, nbytes / compute.mem_bandwidth) + overhead_s


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _prod(xs) -> int:
    return math.prod(int(x) for x in xs)


def matmul_flops(name: str, args: tuple, out: Any) -> int | None:
    """FLOPs of the matrix-multiply family (``mm``, ``addmm``, ``bmm``, ``baddbmm``,
    ``addbmm``, ``matmul``, ``_scaled_mm``), or ``None`` if ``name`` is not one of them.

    Example:
        >>> a, b = torch.empty(8, 16, device="meta"), torch.empty(16, 32, device="meta")
        >>> matmul_flops("aten::mm", (a, b), torch.empty(8, 32, device="meta"))
        8192
    """
    if name in ("aten::mm", "aten::_scaled_mm"):
        a, b = args[0], args[1]
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    if name == "aten::addmm":
        a, b = args[1], args[2]
        m, k, n = a.shape[0], a.shape[1], b.shape[1]
        return 2 * m * k * n + m * n
    if name in ("aten::bmm", "aten::baddbmm"):
        a, b = (args[0], args[1]) if name == "aten::bmm" else (args[1], args[2])
        bsz, m, k, n = a.shape[0], a.shape[1], a.shape[2], b.shape[2]
        return 2 * bsz * m * k * n + (bsz * m * n if name == "aten::baddbmm" else 0)
    if name == "aten::addbmm":
        a, b = args[1], args[2]
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    if name == "aten::matmul":
        a, b = args[0], args[1]
        o = out if isinstance(out, torch.Tensor) else _tensors(out)[0]
        k = a.shape[-1]
        return 2 * o.numel() * k
    return None


def conv_flops(x_shape, w_shape, out_shape, transposed: bool = False) -> int:
    """FLOPs of one convolution: ``2 * N * C_out * prod(out_spatial) * C_in/groups *
    prod(kernel)`` (for a transposed convolution the roles of input and output swap).

    Example:
        >>> conv_flops((1, 3, 224, 224), (64, 3, 7, 7), (1, 64, 112, 112))
        236027904
    """
    n = x_shape[0]
    if transposed:
        # weight is (C_in, C_out/groups, k...): every input pixel scatters into the output
        return 2 * n * _prod(x_shape[1:]) * _prod(w_shape[1:])
    return 2 * n * out_shape[1] * _prod(out_shape[2:]) * _prod(w_shape[1:])


def attention_flops(q_shape, k_shape, v_shape, causal: bool) -> int:
    """Forward FLOPs of scaled dot-product attention: ``QK^T`` and ``PV``, each
    ``2 * B * H * Sq * Sk * D``; a causal mask lets fused kernels skip half.

    Example:
        >>> attention_flops((1, 1, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8), causal=False)
        512
    """
    b_h = _prod(q_shape[:-2])
    sq, d = q_shape[-2], q_shape[-1]
    sk, dv = k_shape[-2], v_shape[-1]
    f = 2 * b_h * sq * sk * d + 2 * b_h * sq * sk * dv
    return f // 2 if causal and sq == sk else f


_ATTN_FWD = {
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
}
_ATTN_BWD = {
    "aten::_scaled_dot_product_flash_attention_backward",
    "aten::_scaled_dot_product_efficient_attention_backward",
    "aten::_scaled_dot_product_cudnn_attention_backward",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::_flash_attention_backward",
    "aten::_efficient_attention_backward",
}
_CONV_FWD = {
    "aten::convolution", "aten::_convolution", "aten::cudnn_convolution", "aten::mkldnn_convolution",
    "aten::convolution_overrideable", "aten::_slow_conv2d_forward", "aten::thnn_conv2d",
}


def named_args(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """An op call's arguments by schema name (positional and keyword together)."""
    names = [a.name for a in func._schema.arguments]
    out = dict(zip(names, args))
    out.update(kwargs)
    return out


def op_flops(name: str, args: tuple, kwargs: dict, out: Any, named: dict[str, Any] | None = None) -> int:
    """FLOPs of one aten op call (schema name without overload, e.g. ``aten::mm``).

    Matmul, convolution and attention get their exact formulas; every other op that
    produces floating-point tensors counts one FLOP per output element (per input
    element for reductions), optimizer ``_foreach_*`` ops one per element per list
    entry. ``named`` (arguments by schema name, see :func:`named_args`) supplies flags
    such as ``is_causal``; without it they default to off.

    Example:
        >>> x = torch.empty(10, device="meta")
        >>> op_flops("aten::add", (x, x), {}, x)
        10
    """
    f = matmul_flops(name, args, out)
    if f is not None:
        return f
    named = named or {}
    if name in _CONV_FWD:
        x, w = args[0], args[1]
        o = out if isinstance(out, torch.Tensor) else _tensors(out)[0]
        return conv_flops(tuple(x.shape), tuple(w.shape), tuple(o.shape), bool(named.get("transposed", False)))
    if name == "aten::convolution_backward":
        grad_out, x, w = args[0], args[1], args[2]
        mask = named.get("output_mask", (True, True, True))
        one = conv_flops(tuple(x.shape), tuple(w.shape), tuple(grad_out.shape), bool(named.get("transposed", False)))
        return one * (int(bool(mask[0])) + int(bool(mask[1]))) + (grad_out.numel() if mask[2] else 0)
    if name in _ATTN_FWD or name in _ATTN_BWD:
        causal = bool(named.get("is_causal", False)) or named.get("custom_mask_type", 0) == 1
        if name in _ATTN_BWD:  # grad_out comes first; dQ, dK, dV, dP and the recomputed S
            q, k, v = args[1], args[2], args[3]
            return attention_flops(q.shape, k.shape, v.shape, causal) * 5 // 2
        q, k, v = args[0], args[1], args[2]
        return attention_flops(q.shape, k.shape, v.shape, causal)
    if name == "aten::embedding_dense_backward":
        return _tensors(args[0])[0].numel()
    ins = _tensors((args, kwargs))
    outs = _tensors(out)
    if name.startswith("aten::_foreach_"):
        return sum(t.numel() for t in (outs or ins[: len(ins) // max(1, _n_lists(args))]))
    if not any(t.is_floating_point() for t in outs + ins):
        return 0
    n_out = sum(t.numel() for t in outs)
    n_in = max((t.numel() for t in ins), default=0)
    return max(n_out, n_in)


def _n_lists(args: tuple) -> int:
    return sum(1 for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)) or 1


def op_bytes(args: tuple, kwargs: dict, out: Any) -> int:
    """Bytes an op moves: every tensor argument read once and every result written once
    (an in-place result that is also an argument counts twice: read and write).

    Example:
        >>> x = torch.empty(10, device="meta")
        >>> op_bytes((x, x), {}, torch.empty(10, device="meta"))
        120
    """
    return sum(_nbytes(t) for t in _tensors((args, kwargs))) + sum(_nbytes(t) for t in _tensors(out))


def compute_dtype(args: tuple, kwargs: dict) -> str:
    """``"bf16"`` if the op's floating-point inputs are bf16/fp16 (tensor-core peak),
    else ``"fp32"``."""
    floats = [t.dtype for t in _tensors((args, kwargs)) if t.is_floating_point()]
    return "bf16" if floats and all(d in _LOW_PRECISION for d in floats) else "fp32"


def is_free_op(func: Any) -> bool:
    """True for view and metadata ops, which launch no kernel."""
    name = func._schema.name
    return bool(getattr(func, "is_view", False)) or name in _FREE_OPS


def op_time(func: Any, args: tuple, kwargs: dict, out: Any, compute: Compute,
            overhead_s: float = LAUNCH_OVERHEAD_S) -> float:
    """Roofline seconds for one dispatched aten op (``func`` an ``OpOverload``).

    Example:
        >>> from tierflow.hardware import Compute
        >>> a = torch.empty(1000, 1000, device="meta")
        >>> t = op_time(torch.ops.aten.mm.default, (a, a), {}, a, Compute(1e12, 1e12, 1e12), 0.0)
        >>> round(t, 6)
        0.002
    """
    if is_free_op(func):
        return 0.0
    name = func._schema.name
    flops = op_flops(name, args, kwargs, out, named_args(func, args, kwargs))
    nbytes = op_bytes(args, kwargs, out)
    return roofline(flops, nbytes, compute, compute_dtype(args, kwargs), overhead_s)
