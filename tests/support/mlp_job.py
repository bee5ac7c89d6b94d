"""A user's own job for the jobs tests: a small classifier on random points, its three functions
defined with ``def`` at the top of this module, so that a torchrun worker imports them by name
(``"support.mlp_job:mlp"``) as it would a user's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fsdpx.jobs as jobs


def mlp(h):
    """A two-layer classifier: (B, d_in) -> (B, classes)."""
    return nn.Sequential(nn.Linear(h["d_in"], h["hidden"]), nn.Tanh(), nn.Linear(h["hidden"], h["classes"]))


def blobs(h):
    """``n`` points in ``d_in`` dimensions, labelled by the sign pattern of two coordinates."""
    x = torch.randn(h["n"], h["d_in"])  # seeded by the run: every rank draws the same points
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return x, y


def cross_entropy(out, y):
    """Per-example cross-entropy ``(B,)`` of the logits ``out`` against the labels ``y``."""
    return F.cross_entropy(out, y, reduction="none")  # (B,)


def mlp_task(name: str = "mlp", *, steps: int = 6, private: bool = False, **kw) -> jobs.Task:
    """A user's job of ``mlp`` on ``blobs`` (``steps`` steps, batches of 32, lr 0.05, a checkpoint
    every 4 steps; ``kw`` over the hparams), private to epsilon 8 when ``private``."""
    hparams = {"d_in": 8, "hidden": 16, "classes": 3, "n": 256, "lr": 0.05, "ckpt_every": 4, **kw}
    return jobs.Task(name, mlp, blobs, cross_entropy, steps=steps, batch_size=32,
                     privacy=jobs.Privacy(target_epsilon=8.0) if private else None, hparams=hparams)
