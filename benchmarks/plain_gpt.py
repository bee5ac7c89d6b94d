"""A GPT written the ordinary way, as a user brings it: nothing in it knows about fsdpx.

Biased ``nn.Linear`` layers (one fused q/k/v projection, as nanoGPT writes it), pre-norm
``nn.LayerNorm`` blocks, ``F.scaled_dot_product_attention`` with a causal mask, learned positions
looked up with ids of shape ``(B, T)`` (the ids broadcast over the batch by ``expand``, a view), an
untied LM head by default. ``benchmarks/privacy_step.py --model plain-gpt`` runs it.

Shapes in comments: B batch, T sequence, C width, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, h, T, C/h)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    """Token ids ``(B, T)`` -> logits ``(B, T, V)``; ``tied`` shares the token embedding with the head."""

    def __init__(self, vocab: int, block_size: int, width: int, layers: int, heads: int, tied: bool = False):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(block_size, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, idx: Tensor) -> Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device).unsqueeze(0).expand(B, T)  # (B, T)
        x = self.tok(idx) + self.pos(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, V)
