"""The problem ``tests/multiprocess/hf_worker.py`` trains and ``test_hf_gloo.py`` checks: a tiny
BERT classifier (``support.hf.bert``), two padded batches of mapping inputs (the second padded to
a fixed size with masked rows, ``privacy.padding``), private ghost clipping, SGD with momentum."""

from fsdpx.optim import sgd
from privacy.padding import pad_batch
from privacy.step import DPConfig

from support.hf import bert, padded_batch

NUM_EXAMPLES = 40


def make_bert():
    return bert()


def batches():
    import torch

    first = padded_batch([5, 8, 3], causal=False, seed=1)
    data = padded_batch([2, 7, 4, 6, 1], causal=False, seed=2)
    return [first, pad_batch(data, torch.tensor([0, 3, 4]), 4)]


def config() -> DPConfig:
    return DPConfig(clip_norm=0.4, noise_multiplier=0.8, sample_rate=0.1, method="ghost")


def optimizer():
    return sgd(0.1, momentum=0.9)
