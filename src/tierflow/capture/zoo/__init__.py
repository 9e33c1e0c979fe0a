"""Built-in models in plain PyTorch, nothing downloaded.

Every entry builds the published architecture (parameter counts match the published
figures) together with a batch maker and a loss, ready for :func:`tierflow.capture`.
``*-tiny`` variants keep the same structure at toy sizes and train on a CPU in well
under a second a step.

Example:
    >>> from tierflow.capture import zoo
    >>> m = zoo.build("gpt-tiny", device="cpu")
    >>> inputs, target = m.make_batch(2, 16)
    >>> m.loss_fn(m.model(inputs), target).dim()
    0
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import TraceError
from .resnet import MLPNet, ResNet
from .transformer import GPT2, Bert, Llama, ViT

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Spec:
    """A zoo entry.

    Attributes:
        name: the zoo name. family: ``gpt2``, ``llama``, ``bert``, ``vit``, ``resnet``, ``mlp``.
        description: one line. factory: builds the module (called under the target device).
        batch, seq: defaults for :func:`tierflow.capture.zoo_trace` (seq None: not a
            sequence model). max_seq: longest sequence the model accepts.
        params: the published parameter count this entry must match, when there is one.
    """

    name: str
    family: str
    description: str
    factory: Callable[[], nn.Module]
    batch: int
    seq: int | None = None
    max_seq: int | None = None
    vocab: int = 0
    image: int = 224
    classes: int = 1000
    features: int = 0
    params: int | None = None


def _lm(name, desc, factory, batch, seq, max_seq, vocab, params=None, family="gpt2"):
    return Spec(name, family, desc, factory, batch, seq, max_seq, vocab=vocab, params=params)


_SPECS: list[Spec] = [
    _lm("gpt2-small", "GPT-2 124M: 12 layers, d=768, 12 heads", lambda: GPT2(12, 768, 12), 8, 1024, 1024, 50257,
        124_439_808),
    _lm("gpt2-medium", "GPT-2 355M: 24 layers, d=1024, 16 heads", lambda: GPT2(24, 1024, 16), 8, 1024, 1024, 50257,
        354_823_168),
    _lm("gpt2-large", "GPT-2 774M: 36 layers, d=1280, 20 heads", lambda: GPT2(36, 1280, 20), 8, 1024, 1024, 50257,
        774_030_080),
    _lm("gpt2-xl", "GPT-2 1.5B: 48 layers, d=1600, 25 heads", lambda: GPT2(48, 1600, 25), 8, 1024, 1024, 50257,
        1_557_611_200),
    _lm("gpt-tiny", "GPT-2 structure at toy size: 2 layers, d=64", lambda: GPT2(2, 64, 4, vocab=512, n_pos=128),
        4, 32, 128, 512),
    _lm("llama-1b", "Llama 3.2 1B: 16 layers, d=2048, GQA 32/8 heads, ffn 8192, vocab 128256, tied",
        lambda: Llama(16, 2048, 32, 8, 8192, 128256, tied=True, rope_theta=500000.0), 4, 2048, 131072, 128256,
        1_235_814_400, "llama"),
    _lm("llama-7b", "Llama 7B: 32 layers, d=4096, 32 heads, ffn 11008, vocab 32000, untied",
        lambda: Llama(32, 4096, 32, 32, 11008, 32000, tied=False), 4, 2048, 4096, 32000, 6_738_415_616, "llama"),
    _lm("llama-tiny", "Llama structure at toy size: 2 layers, d=64, GQA 4/2 heads",
        lambda: Llama(2, 64, 4, 2, 172, 512, tied=False), 4, 32, 128, 512, None, "llama"),
    _lm("bert-base", "BERT-base masked LM: 12 layers, d=768, 12 heads", lambda: Bert(12, 768, 12, 3072), 32, 512,
        512, 30522, 109_514_298, "bert"),
    _lm("bert-large", "BERT-large masked LM: 24 layers, d=1024, 16 heads", lambda: Bert(24, 1024, 16, 4096), 32,
        512, 512, 30522, 335_174_458, "bert"),
    _lm("bert-tiny", "BERT structure at toy size: 2 layers, d=64", lambda: Bert(2, 64, 4, 256, vocab=512, n_pos=128),
        4, 32, 128, 512, None, "bert"),
    Spec("vit-b16", "vit", "ViT-B/16: 12 layers, d=768, 224x224, 1000 classes", lambda: ViT(12, 768, 12), 64,
         params=86_567_656),
    Spec("vit-l16", "vit", "ViT-L/16: 24 layers, d=1024, 224x224, 1000 classes", lambda: ViT(24, 1024, 16), 64,
         params=304_326_632),
    Spec("vit-tiny", "vit", "ViT structure at toy size: 2 layers, d=64, 32x32, 10 classes",
         lambda: ViT(2, 64, 4, image=32, patch=8, classes=10), 4, image=32, classes=10),
    Spec("resnet50", "resnet", "ResNet-50 (torchvision layout), 224x224", lambda: ResNet((3, 4, 6, 3)), 64,
         params=25_557_032),
    Spec("resnet152", "resnet", "ResNet-152 (torchvision layout), 224x224", lambda: ResNet((3, 8, 36, 3)), 64,
         params=60_192_808),
    Spec("resnet-tiny", "resnet", "ResNet structure at toy size: one bottleneck per stage, width 8, 32x32",
         lambda: ResNet((1, 1, 1, 1), width=8, classes=10), 4, image=32, classes=10),
    Spec("mlp", "mlp", "MLP: 1024 -> 4 x 4096 ReLU -> 1000", lambda: MLPNet(1024, 4096, 4, 1000), 256,
         features=1024),
    Spec("mlp-tiny", "mlp", "MLP at toy size: 32 -> 2 x 64 ReLU -> 10", lambda: MLPNet(32, 64, 2, 10), 8,
         classes=10, features=32),
]
_BY_NAME = {s.name: s for s in _SPECS}


class Built(NamedTuple):
    """What :func:`build` returns: the module, a batch maker
    ``make_batch(batch, seq=None) -> (inputs, target)`` and ``loss_fn(output, target)``."""

    model: nn.Module
    make_batch: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def names() -> list[str]:
    """Zoo model names, full-size models first, in family order."""
    return [s.name for s in _SPECS]


def spec(name: str) -> Spec:
    """The :class:`Spec` of ``name``.

    Raises:
        TraceError: unknown name (the message lists the zoo).
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise TraceError(f"unknown zoo model {name!r} (models: {', '.join(names())})") from None


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def build(name: str, dtype: str = "fp32", device: str | torch.device = "cpu", seed: int = 0) -> Built:
    """Build zoo model ``name`` on ``device`` with parameters in ``dtype``.

    On ``meta`` nothing is allocated (``llama-7b`` builds in a fraction of a second);
    elsewhere weights are initialised from ``torch.manual_seed(seed)``.

    Args:
        name: one of :func:`names`.
        dtype: ``"fp32"`` or ``"bf16"`` (parameters, activations and images).
        device: ``"meta"``, ``"cpu"``, ``"cuda"``.
        seed: seeds weight initialisation and :attr:`Built.make_batch`.

    Raises:
        TraceError: unknown name or dtype.

    Example:
        >>> m = build("llama-7b", device="meta")
        >>> sum(p.numel() for p in m.model.parameters())
        6738415616
    """
    s = spec(name)
    if dtype not in DTYPES:
        raise TraceError(f"unknown dtype {dtype!r} (dtypes: {', '.join(DTYPES)})")
    dt = DTYPES[dtype]
    dev = torch.device(device)
    with _seeded(seed), dev:
        model = s.factory().to(dt)
    gen_seed = [seed]

    def make_batch(batch: int, seq: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if batch is None or batch < 1:
            raise TraceError(f"{name}: batch must be >= 1, got {batch!r}")
        g = torch.Generator().manual_seed(gen_seed[0])
        if s.seq is not None:
            t = s.seq if seq is None else seq
            if not 1 <= t <= (s.max_seq or t):
                raise TraceError(f"{name}: seq must be in 1..{s.max_seq}, got {t}")
            x = _on(torch.randint(0, s.vocab, (batch, t + 1), generator=g), dev)
            return x[:, :-1].contiguous(), x[:, 1:].contiguous()
        if seq is not None:
            raise TraceError(f"{name}: not a sequence model; --seq does not apply")
        y = _on(torch.randint(0, s.classes, (batch,), generator=g), dev)
        if s.family == "mlp":
            return _on(torch.randn(batch, s.features, generator=g), dev).to(dt), y
        return _on(torch.randn(batch, 3, s.image, s.image, generator=g), dev).to(dt), y

    loss_fn = _lm_loss if s.seq is not None else F.cross_entropy
    return Built(model, make_batch, loss_fn)


def _on(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """``t`` on ``dev`` (on meta: a meta tensor of the same shape, no copy)."""
    if dev.type == "meta":
        return torch.empty_like(t, device="meta")
    return t.to(dev)


@contextlib.contextmanager
def _seeded(seed: int):
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


def param_count(model: nn.Module) -> int:
    """Parameters of ``model``, each shared (tied) parameter once."""
    return sum(p.numel() for p in model.parameters())


__all__ = ["Built", "Spec", "build", "names", "param_count", "spec"]
_ = Any
