"""A small GPT, readable top to bottom (nanoGPT's shape), built only from layers the private
core has ghost rules for: ``nn.Embedding``, ``nn.Linear``, ``nn.LayerNorm`` / ``RMSNorm``.

Shapes in comments: B batch, T sequence, C model width, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    norm: str = "layernorm"  # or "rmsnorm"
    bias: bool = True
    tie_weights: bool = True


class RMSNorm(nn.Module):
    """Root-mean-square norm: ``x / sqrt(mean(x^2) + eps) * weight``. ``ghost_rule`` tells
    ``privacy/layers.py`` that forward is ``normalize(x) * weight``, so ghost clipping reuses
    :meth:`normalize` for exact per-example norms."""

    ghost_rule = "normalize_then_scale"

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def normalize(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.normalize(x) * self.weight


def _norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.n_embd)
    if config.norm == "layernorm":
        return nn.LayerNorm(config.n_embd, bias=config.bias)
    raise ValueError(f"unknown norm {config.norm!r}: use 'layernorm' or 'rmsnorm'")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd={config.n_embd} is not divisible by n_head={config.n_head}")
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        # shapes are read off q, not x or the config: under tensor parallelism a rank holds whole
        # heads of q, k and v (C_r = C / tp, nh_r = nh / tp), and with sequence parallelism x is
        # the rank's chunk of the sequence while q covers all of it (``models.tp_plans``)
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x (B, T, C_r)
        B, T, width = q.shape
        heads = width // self.head_dim
        q, k, v = (t.view(B, T, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, nh_r, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh_r, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block; one FSDP unit by default."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = _norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = _norm(config)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token ids ``(B, T)`` -> logits ``(B, T, V)``. With ``tie_weights`` the LM head shares
    ``wte.weight`` (one parameter used by two layers, as in GPT-2)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = _norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(_init_weights)

    def forward(self, idx: Tensor) -> Tensor:
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device).repeat(B, 1)  # (B, T): batch-first, so wpe has per-example grads
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)


def token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Per-example loss ``(B,)``: the mean next-token cross-entropy over each sequence."""
    B, T, V = logits.shape
    return F.cross_entropy(logits.reshape(B * T, V), targets.reshape(B * T), reduction="none").view(B, T).mean(1)
