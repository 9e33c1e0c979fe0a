"""Transformer families in plain PyTorch: GPT-2, a Llama-style decoder, BERT, ViT.

Layer shapes follow the published models (Hugging Face ``transformers`` and
``timm``/``torchvision`` layouts), so parameter counts match the published figures.
Attention goes through ``F.scaled_dot_product_attention``; dropout is off (as in most
large-model pre-training today), so an iteration is deterministic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    """Multi-head self-attention with a fused QKV projection (GPT-2, BERT, ViT layout)."""

    def __init__(self, d: int, n_head: int, causal: bool, bias: bool = True):
        super().__init__()
        self.n_head, self.causal = n_head, causal
        self.qkv = nn.Linear(d, 3 * d, bias=bias)
        self.proj = nn.Linear(d, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int, approximate: str):
        super().__init__()
        self.fc = nn.Linear(d, hidden)
        self.proj = nn.Linear(hidden, d)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class PreLNBlock(nn.Module):
    """``x + attn(ln(x))`` then ``x + mlp(ln(x))`` (GPT-2, ViT)."""

    def __init__(self, d: int, n_head: int, causal: bool, approximate: str, eps: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d, eps=eps)
        self.attn = SelfAttention(d, n_head, causal)
        self.ln2 = nn.LayerNorm(d, eps=eps)
        self.mlp = MLP(d, 4 * d, approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT2(nn.Module):
    """GPT-2 (Radford et al. 2019): learned positions, pre-LN blocks, tied LM head."""

    def __init__(self, n_layer: int, d: int, n_head: int, vocab: int = 50257, n_pos: int = 1024):
        super().__init__()
        self.n_pos = n_pos
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(n_pos, d)
        self.h = nn.ModuleList(PreLNBlock(d, n_head, True, "tanh", 1e-5) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        _init(self, 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, d: int, n_head: int, n_kv: int):
        super().__init__()
        self.n_head, self.n_kv, self.hd = n_head, n_kv, d // n_head
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, n_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.q_proj(x).view(b, t, self.n_head, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if self.n_kv != self.n_head:  # grouped-query attention: repeat K and V per group
            r = self.n_head // self.n_kv
            k = k[:, :, None].expand(b, self.n_kv, r, t, self.hd).reshape(b, self.n_head, t, self.hd)
            v = v[:, :, None].expand(b, self.n_kv, r, t, self.hd).reshape(b, self.n_head, t, self.hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, d: int, n_head: int, n_kv: int, ffn: int, eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = LlamaAttention(d, n_head, n_kv)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = SwiGLU(d, ffn)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Llama-style decoder (Touvron et al. 2023): RMSNorm, SwiGLU, rotary positions,
    optional grouped-query attention and tied embeddings (Llama 3.2 1B)."""

    def __init__(self, n_layer: int, d: int, n_head: int, n_kv: int, ffn: int, vocab: int,
                 tied: bool, rope_theta: float = 10000.0, eps: float = 1e-5):
        super().__init__()
        self.hd, self.theta = d // n_head, rope_theta
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaBlock(d, n_head, n_kv, ffn, eps) for _ in range(n_layer))
        self.norm = RMSNorm(d, eps)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight
        _init(self, 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        dev = idx.device
        inv = 1.0 / self.theta ** (torch.arange(0, self.hd, 2, device=dev, dtype=torch.float32) / self.hd)
        freqs = torch.outer(torch.arange(t, device=dev, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        x = self.embed_tokens(idx)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


class PostLNBlock(nn.Module):
    """``ln(x + attn(x))`` then ``ln(x + mlp(x))`` (BERT)."""

    def __init__(self, d: int, n_head: int, ffn: int):
        super().__init__()
        self.attn = SelfAttention(d, n_head, causal=False)
        self.ln1 = nn.LayerNorm(d, eps=1e-12)
        self.fc = nn.Linear(d, ffn)
        self.proj = nn.Linear(ffn, d)
        self.ln2 = nn.LayerNorm(d, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.proj(F.gelu(self.fc(x))))


class Bert(nn.Module):
    """BERT (Devlin et al. 2019) with its masked-LM head (``BertForMaskedLM`` layout:
    no pooler, transform + LayerNorm + decoder tied to the word embeddings)."""

    def __init__(self, n_layer: int, d: int, n_head: int, ffn: int, vocab: int = 30522, n_pos: int = 512):
        super().__init__()
        self.word = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(n_pos, d)
        self.token_type = nn.Embedding(2, d)
        self.ln = nn.LayerNorm(d, eps=1e-12)
        self.layers = nn.ModuleList(PostLNBlock(d, n_head, ffn) for _ in range(n_layer))
        self.transform = nn.Linear(d, d)
        self.transform_ln = nn.LayerNorm(d, eps=1e-12)
        self.decoder = nn.Linear(d, vocab)
        self.decoder.weight = self.word.weight  # tied; the bias is its own
        _init(self, 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.ln(self.word(idx) + self.pos(pos) + self.token_type(torch.zeros_like(idx)))
        for layer in self.layers:
            x = layer(x)
        return self.decoder(self.transform_ln(F.gelu(self.transform(x))))


class ViT(nn.Module):
    """Vision Transformer (Dosovitskiy et al. 2021): patch embedding, class token,
    learned positions, pre-LN blocks, linear head."""

    def __init__(self, n_layer: int, d: int, n_head: int, image: int = 224, patch: int = 16,
                 classes: int = 1000, channels: int = 3):
        super().__init__()
        n = (image // patch) ** 2
        self.patch = nn.Conv2d(channels, d, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.zeros(1, n + 1, d))
        self.blocks = nn.ModuleList(PreLNBlock(d, n_head, False, "none", 1e-6) for _ in range(n_layer))
        self.ln = nn.LayerNorm(d, eps=1e-6)
        self.head = nn.Linear(d, classes)
        _init(self, 0.02)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.patch(img).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls.expand(x.shape[0], -1, -1), x), dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x)[:, 0])


def _init(model: nn.Module, std: float) -> None:
    """Normal(0, std) weights, zero biases, unit norms (a no-op on ``meta``)."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding, nn.Conv2d)):
            nn.init.normal_(m.weight, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
