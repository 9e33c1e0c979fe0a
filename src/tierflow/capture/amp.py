"""What a GPU would run, emulated on the ``meta`` device.

``torch.autocast`` and the fused attention kernels key on a real device, so a ``meta``
capture would otherwise record fp32 matmuls under autocast and the math attention
fallback (which materialises the full ``S x S`` matrix). Two ``TorchFunctionMode``s put
back what CUDA does:

* :func:`meta_autocast` applies CUDA autocast's cast policy: matmul, linear,
  convolution and attention run in the low-precision dtype, softmax, log-softmax,
  cross-entropy, the losses and the normalisations in fp32, with the cast of a leaf
  parameter cached for the region as autocast does (one copy per weight per forward);
* :func:`fused_sdpa` routes ``F.scaled_dot_product_attention`` without a mask to
  ``_scaled_dot_product_flash_attention`` (bf16/fp16) or
  ``_scaled_dot_product_efficient_attention`` (fp32), the kernels PyTorch picks on a
  recent GPU, with their real saved tensors (output and log-sum-exp).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_LOW = {
    F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm,
    torch.bmm, torch.Tensor.bmm, torch.addmm, torch.Tensor.addmm, torch.baddbmm, torch.Tensor.baddbmm,
    F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
    F.scaled_dot_product_attention,
}
_FP32 = {
    F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax,
    F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.binary_cross_entropy_with_logits, F.layer_norm,
    F.group_norm, torch.Tensor.exp, torch.exp, torch.Tensor.log, torch.log, torch.cumsum, torch.Tensor.cumsum,
}


class _MetaAutocast(TorchFunctionMode):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _cast(self, x, dtype):
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype):
            return x
        if x.is_leaf and x.requires_grad and dtype == self.dtype:
            hit = self.cache.get(id(x))
            if hit is not None and hit[0] is x:
                return hit[1]
            y = x.to(dtype)
            self.cache[id(x)] = (x, y)
            return y
        return x.to(dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LOW:
            target = self.dtype
        elif func in _FP32:
            target = torch.float32
        else:
            return func(*args, **kwargs)
        args = tuple(self._cast(a, target) for a in args)
        kwargs = {k: self._cast(v, target) for k, v in kwargs.items()}
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_autocast(dtype: torch.dtype) -> Iterator[None]:
    """Emulate ``torch.autocast("cuda", dtype)`` for tensors on ``meta``.

    Args:
        dtype: ``torch.bfloat16`` or ``torch.float16``.

    Example:
        >>> w = torch.empty(4, 4, device="meta", requires_grad=True)
        >>> with meta_autocast(torch.bfloat16):
        ...     (torch.empty(2, 4, device="meta") @ w).dtype
        torch.bfloat16
    """
    mode = _MetaAutocast(dtype)
    with mode:
        yield
    mode.cache.clear()


class _FusedSDPA(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        a = dict(zip(names, args))
        a.update(kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        if (a.get("attn_mask") is not None or q.device.type != "meta" or q.dim() != 4
                or k.shape[1] != q.shape[1] or q.dtype != k.dtype or q.dtype != v.dtype):
            return func(*args, **kwargs)
        p, causal, scale = float(a.get("dropout_p", 0.0)), bool(a.get("is_causal", False)), a.get("scale")
        if q.dtype in (torch.bfloat16, torch.float16):
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, p, causal, scale=scale)[0]
        need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, need_lse, p, causal,
                                                                      scale=scale)[0]


@contextlib.contextmanager
def fused_sdpa() -> Iterator[None]:
    """Route mask-free ``scaled_dot_product_attention`` on ``meta`` to the fused kernels.

    Example:
        >>> q = torch.empty(1, 2, 8, 16, device="meta")
        >>> with fused_sdpa():
        ...     F.scaled_dot_product_attention(q, q, q, is_causal=True).shape
        torch.Size([1, 2, 8, 16])
    """
    with _FusedSDPA():
        yield
