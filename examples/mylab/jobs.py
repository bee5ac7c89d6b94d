# examples/mylab/jobs.py
import torch
import torch.nn.functional as F
from torch import nn

from fsdpx.jobs import Privacy, Task


def model(h):
    return nn.Sequential(nn.Linear(8, h["hidden"]), nn.Tanh(), nn.Linear(h["hidden"], 3))


def points(h):
    x = torch.randn(h["n"], 8)  # seeded by the run: every rank draws the same points
    return x, (x[:, 0] > 0).long()


def loss(out, y):
    return F.cross_entropy(out, y, reduction="none")  # per example, (B,)


task = Task("mlp", model, points, loss, steps=300, batch_size=64, privacy=Privacy(target_epsilon=8.0),
            hparams={"hidden": 32, "n": 4096, "lr": 0.05, "ckpt_every": 50})  # lr, seed, ckpt_every: the run's
