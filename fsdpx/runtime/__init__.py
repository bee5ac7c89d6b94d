"""The runtime: executes a sharded train step on a communicator.

``make_sharded_step`` (``step.py``: one train step for every layout, private or plain; with a
pipeline, ``pipeline.py``; both cut their rows and sum their metrics with ``global_batch.py``,
clip with ``sharded_clipping.py`` and end in ``reduce.py``, which adds ``owned_noise.py``'s
noise), ``init_sharded`` / ``ShardedState`` (``sharded_state.py``), the per-unit gathering
(``gather.py``, ``units.py``), the plain unsharded baseline (``plain_step.py``) and two ``Comm``
backends: ``run_threads`` (ranks as threads of one process, ``threads.py``) and
``dist_comm.init_from_env`` (``torch.distributed`` processes started by torchrun). Opacus' FSDP
path (``FSDP2Wrapper``, ``grad_sample_mode="ghost_fsdp"``) is ``opacus_fsdp.py``, over the same
step. It stands on
the algebra and optimizers, and on ``privacy`` / ``offload`` / ``ckpt``; nothing below imports
it.
"""

from .sharded_state import ShardedState, init_sharded
from .step import make_sharded_step
from .threads import ThreadComm, run_threads

__all__ = ["ShardedState", "ThreadComm", "init_sharded", "make_sharded_step", "run_threads"]
