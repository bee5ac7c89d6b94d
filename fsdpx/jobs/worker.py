"""One rank of a job (the process ``execute`` starts under torchrun).

    python -m torch.distributed.run --nproc-per-node N -m fsdpx.jobs.worker RUN_CONFIG.json

Runs ``fsdpx.train.run`` on the ``RunConfig`` in the file; every rank writes its peak memory to
``<run_dir>/rank<R>.json``, rank 0 the run's summary to ``<run_dir>/summary.json``.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path

import torch

from fsdpx.train import RunConfig, run
from fsdpx.train.device import torchrun_device
from fsdpx.train.launch import watch_launcher


def peak_bytes(device: torch.device) -> int:
    """This process's peak memory on the run's device: the CUDA allocator's peak for a run on a
    GPU, else the peak RSS (also for a CPU run on a machine that has a GPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main(path: str) -> None:
    watch_launcher()  # die with torchrun and with the process that launched it (execute.launch)
    config = RunConfig.from_dict(json.loads(Path(path).read_text()))
    device = torchrun_device(config.run.device)
    comm = None
    if "WORLD_SIZE" in os.environ:
        from fsdpx.runtime.dist_comm import init_from_env

        comm = init_from_env(config.parallelism.mesh(int(os.environ["WORLD_SIZE"])), device=device)
    rank = 0 if comm is None else comm.rank
    summary = run(config, progress=False, comm=comm)
    config.run_dir.mkdir(parents=True, exist_ok=True)
    (config.run_dir / f"rank{rank}.json").write_text(json.dumps({"peak_bytes": peak_bytes(device)}))
    if rank == 0:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in summary.items()}
        (config.run_dir / "summary.json").write_text(json.dumps(clean, indent=2))
    if comm is not None:
        from fsdpx.runtime.dist_comm import shutdown

        shutdown()


if __name__ == "__main__":
    import atexit
    import gc

    atexit.register(gc.freeze)  # at exit, no last collection over torch's objects (as fsdpx.__main__)
    main(sys.argv[1])
