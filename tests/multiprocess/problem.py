"""The fixed problem the multi-process tests train: a tiny GPT (uneven shapes: vocab 11 over
2 or 3 ranks) and three batches, one of them smaller than the world (a rank gets no example)."""

import torch

from fsdpx.models.gpt import GPT, GPTConfig
from privacy.step import DPConfig

NUM_EXAMPLES = 40


def make_model() -> GPT:
    torch.manual_seed(5)
    return GPT(GPTConfig(vocab_size=11, block_size=4, n_layer=2, n_head=2, n_embd=6)).double()


def _batch(b: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 11, (b, 4), generator=g), torch.randint(0, 11, (b, 4), generator=g)


BATCHES = [_batch(5, 1), _batch(1, 2), _batch(4, 3)]


def private_config() -> DPConfig:
    return DPConfig(clip_norm=0.5, noise_multiplier=0.8, sample_rate=0.1, method="ghost")
