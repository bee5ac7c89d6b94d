"""The sharding algebra: the bottom layer, pure arithmetic on layouts and lists of tensors.

``Mesh`` (named axes), ``Spec`` (one tensor's layout), ``shard`` / ``unshard`` / ``local_box``
(which block each rank holds), ``plan`` / ``Collective`` / ``cost`` / ``adjoint`` (moving between
layouts), ``SimulatedMesh`` (running collectives on lists of tensors), ``strategies`` (DDP,
ZeRO-1/2/3, HSDP as data), the derived cost model (``memory_per_rank``, ``comm_per_step``) and
the ``Comm`` interface a runtime backend implements. Nothing here starts a thread or a process.
"""

from . import strategies
from .collectives import Collective, adjoint, cost, plan
from .comm import Comm, RankFailure
from .cost_model import comm_per_step, memory_by_rank, memory_per_rank, peak_gathered_bytes, step_collectives
from .layout import local_box, shard, unshard
from .mesh import Mesh
from .simulated import SimulatedMesh
from .spec import Spec

__all__ = [
    "Collective", "Comm", "Mesh", "RankFailure", "SimulatedMesh", "Spec", "adjoint", "comm_per_step", "cost",
    "local_box", "memory_by_rank", "memory_per_rank", "peak_gathered_bytes", "plan", "shard", "step_collectives",
    "strategies", "unshard",
]
