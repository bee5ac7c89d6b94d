"""fsdpx: private, sharded and offloaded training as pure functions, checked against plain training.

The sharding algebra: ``Mesh`` (named axes), ``Spec`` (one tensor's layout), ``shard`` /
``unshard`` / ``local_box`` (which block each rank holds), ``plan`` / ``Collective`` / ``cost`` /
``adjoint`` (moving between layouts), ``SimulatedMesh`` (running collectives on lists of
tensors), ``strategies`` (DDP, ZeRO-1/2/3, HSDP as data) and the derived cost model
``memory_per_rank`` / ``comm_per_step``.
"""

from . import strategies
from .collectives import Collective, adjoint, cost, plan
from .cost_model import comm_per_step, memory_by_rank, memory_per_rank, peak_gathered_bytes, step_collectives
from .layout import local_box, shard, unshard
from .mesh import Mesh
from .simulated import SimulatedMesh
from .spec import Spec

__all__ = [
    "Collective",
    "Mesh",
    "SimulatedMesh",
    "Spec",
    "adjoint",
    "comm_per_step",
    "cost",
    "local_box",
    "memory_by_rank",
    "memory_per_rank",
    "peak_gathered_bytes",
    "plan",
    "shard",
    "strategies",
    "step_collectives",
    "unshard",
]
