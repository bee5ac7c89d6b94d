"""Functional optimizers over ``dict[str, Tensor]`` (optax style), at the bottom layer with the
sharding algebra: ``privacy``, ``offload``, ``ckpt`` and the runtime all build on them.

``optimizers`` holds the rules (SGD, AdamW), ``adamw_loop`` AdamW's compiled per-element pass and
``freezing`` the schedule of which parameters train when, with the update that skips the others.
"""

from . import adamw_loop
from .freezing import Freezing, Trainable, TrainableSets, model_aliases, update_trainable
from .optimizers import (
    ColumnUpdate,
    OptState,
    Optimizer,
    Params,
    adamw,
    adamw_kernel,
    adamw_kernel_,
    check_same_keys,
    sgd,
    sgd_kernel,
    update_fn,
)

__all__ = [
    "ColumnUpdate", "Freezing", "OptState", "Optimizer", "Params", "Trainable", "TrainableSets", "adamw",
    "adamw_kernel", "adamw_kernel_", "adamw_loop", "check_same_keys", "model_aliases", "sgd", "sgd_kernel",
    "update_fn", "update_trainable",
]
