"""Two small models that are not in tierflow's zoo, for checks that must not depend on
the zoo's shapes: a convolutional encoder/decoder with skip connections (a U-Net in
miniature: its activations dwarf its parameters) and an MLP-Mixer (token and channel
mixing through transposes, LayerNorm, GELU, dropout).

Each is built by :func:`build` as ``(model, make_batch, loss_fn)``, like
:func:`tierflow.capture.zoo.build`; ``make_batch(i)`` is the ``i``-th seeded batch.
Tests load this file by path (see ``tests/test_runtime_follows_plan.py``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

NAMES = ("unet-mini", "mixer-mini")


class _Down(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm = nn.GroupNorm(4, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv2(F.relu(self.norm(self.conv1(x)))))


class _Up(nn.Module):
    def __init__(self, cin: int, skip: int, cout: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cin, 2, stride=2)
        self.conv = nn.Conv2d(cin + skip, cout, 3, padding=1)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(torch.cat([self.up(x), skip], dim=1)))


class UNetMini(nn.Module):
    """Three stages down, a bottleneck, three stages up, each up stage joined to the
    matching down stage's output (the skip connection)."""

    def __init__(self, width: int = 8, channels: int = 3):
        super().__init__()
        w = width
        self.d1, self.d2, self.d3 = _Down(channels, w), _Down(w, 2 * w), _Down(2 * w, 4 * w)
        self.mid = _Down(4 * w, 8 * w)
        self.u3, self.u2, self.u1 = _Up(8 * w, 4 * w, 4 * w), _Up(4 * w, 2 * w, 2 * w), _Up(2 * w, w, w)
        self.head = nn.Conv2d(w, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s1 = self.d1(x)
        s2 = self.d2(F.max_pool2d(s1, 2))
        s3 = self.d3(F.max_pool2d(s2, 2))
        m = self.mid(F.max_pool2d(s3, 2))
        return self.head(self.u1(self.u2(self.u3(m, s3), s2), s1))


class _MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int, dropout: float):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.token = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens))
        self.channel = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel(self.norm2(x))


class MixerMini(nn.Module):
    """Patches of a 16x16 image, two mixer blocks, mean-pooled to 10 classes."""

    def __init__(self, image: int = 16, patch: int = 4, dim: int = 48, blocks: int = 2, dropout: float = 0.1):
        super().__init__()
        tokens = (image // patch) ** 2
        self.embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.blocks = nn.Sequential(*[_MixerBlock(tokens, dim, dropout) for _ in range(blocks)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.blocks(x)).mean(dim=1))


def build(name: str, *, batch: int = 4, seed: int = 0, device: str | torch.device = "cpu"
          ) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]], Callable]:
    """``(model, make_batch, loss_fn)`` for ``name`` (one of :data:`NAMES`), weights
    seeded by ``seed``; ``make_batch(i)`` gives the ``i``-th batch of ``batch`` samples,
    the same on every call."""
    if name not in NAMES:
        raise ValueError(f"unknown model {name!r} (models: {', '.join(NAMES)})")
    torch.manual_seed(seed)
    if name == "unet-mini":
        model = UNetMini().to(device)

        def make_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(seed * 1000 + i)
            x = torch.randn(batch, 3, 32, 32, generator=g)
            return x.to(device), (0.5 * x + 0.1 * torch.randn(x.shape, generator=g)).to(device)

        return model, make_batch, F.mse_loss
    model = MixerMini().to(device)

    def make_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1000 + i)
        return (torch.randn(batch, 3, 16, 16, generator=g).to(device),
                torch.randint(0, 10, (batch,), generator=g).to(device))

    return model, make_batch, F.cross_entropy


def any_model(name: str, *, seed: int = 0):
    """``(model, make_batch, loss_fn)`` for ``name``, one of :data:`NAMES` or a zoo
    model (``tierflow.capture.zoo``, at its default batch): the checks that run both
    kinds take them alike."""
    if name in NAMES:
        return build(name, seed=seed)
    from tierflow.capture import zoo

    built = zoo.build(name, seed=seed)
    batch = zoo.spec(name).batch
    return built.model, (lambda i: built.make_batch(batch)), built.loss_fn
