"""Functional optimizers over ``dict[str, Tensor]`` (optax style), at the bottom layer with the
sharding algebra: ``privacy``, ``offload``, ``ckpt`` and the runtime all build on them.

``optimizers`` holds the rules (SGD, AdamW) and ``adamw_loop`` AdamW's compiled per-element pass.
"""

from . import adamw_loop
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
    "ColumnUpdate", "OptState", "Optimizer", "Params", "adamw", "adamw_kernel", "adamw_kernel_", "adamw_loop",
    "check_same_keys", "sgd", "sgd_kernel", "update_fn",
]
