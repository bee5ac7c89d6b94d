"""fsdpx: private, sharded and offloaded training as pure functions, checked against plain training.

Layers, bottom to top (no module imports a layer above its own; ``tests/test_layers.py``):

1. ``fsdpx.sharding`` (mesh, spec, layouts, collectives, cost model, strategies, the ``Comm``
   interface) and ``fsdpx.optim`` (functional optimizers); ``fsdpx.models`` (the reference GPT);
2. ``privacy``, ``offload``, ``ckpt``;
3. ``fsdpx.runtime`` (the sharded step, gathering, the thread and torch.distributed backends);
4. ``fsdpx.train`` (the training job, its data, CLI and launcher).

The public names below are importable from ``fsdpx`` as before; they load on first use, so
importing ``fsdpx.sharding`` does not pull in the runtime.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "Collective": "fsdpx.sharding", "Mesh": "fsdpx.sharding", "RankFailure": "fsdpx.sharding",
    "SimulatedMesh": "fsdpx.sharding", "Spec": "fsdpx.sharding", "adjoint": "fsdpx.sharding",
    "comm_per_step": "fsdpx.sharding", "cost": "fsdpx.sharding", "local_box": "fsdpx.sharding",
    "memory_by_rank": "fsdpx.sharding", "memory_per_rank": "fsdpx.sharding",
    "peak_gathered_bytes": "fsdpx.sharding", "plan": "fsdpx.sharding", "shard": "fsdpx.sharding",
    "step_collectives": "fsdpx.sharding", "strategies": "fsdpx.sharding", "unshard": "fsdpx.sharding",
    "ShardedState": "fsdpx.runtime", "init_sharded": "fsdpx.runtime", "make_sharded_step": "fsdpx.runtime",
    "run_threads": "fsdpx.runtime",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fsdpx' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
