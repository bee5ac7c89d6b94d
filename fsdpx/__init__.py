"""fsdpx: private, sharded and offloaded training as pure functions, checked against plain training.

The sharding algebra: ``Mesh`` (named axes), ``Spec`` (one tensor's layout), ``shard`` /
``unshard`` / ``local_box`` (which block each rank holds), ``plan`` / ``Collective`` / ``cost`` /
``adjoint`` (moving between layouts), ``SimulatedMesh`` (running collectives on lists of
tensors), ``strategies`` (DDP, ZeRO-1/2/3, HSDP as data) and the derived cost model
``memory_per_rank`` / ``comm_per_step``.

The runtime: ``make_sharded_step`` / ``init_sharded`` (one train step for every strategy,
private or plain) over a communicator: ``run_threads`` (ranks as threads of one process) or
``fsdpx.dist_comm.init_from_env`` (torch.distributed processes started by torchrun).
"""

from . import strategies
from .collectives import Collective, adjoint, cost, plan
from .cost_model import comm_per_step, memory_by_rank, memory_per_rank, peak_gathered_bytes, step_collectives
from .layout import local_box, shard, unshard
from .mesh import Mesh
from .simulated import SimulatedMesh
from .spec import Spec
from .comm import RankFailure, run_threads
from .runtime import ShardedState, init_sharded, make_sharded_step

__all__ = [
    "Collective",
    "Mesh",
    "RankFailure",
    "ShardedState",
    "SimulatedMesh",
    "Spec",
    "adjoint",
    "comm_per_step",
    "cost",
    "init_sharded",
    "local_box",
    "make_sharded_step",
    "memory_by_rank",
    "memory_per_rank",
    "peak_gathered_bytes",
    "plan",
    "run_threads",
    "shard",
    "strategies",
    "step_collectives",
    "unshard",
]
