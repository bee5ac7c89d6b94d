"""Where a run's tensors live: ``RunConfig.device`` resolved to a ``torch.device``.

    device = run_device("cuda", local_rank=1)    # cuda:1, checked to exist
    batch = to_device(sample_batch(data, sampler, step), device)

The data, the Poisson sampler, the noise sampler and the accountant stay on the host; the
model's parameters, the optimizer state, each step's batch and everything the step computes
live on the run's device. ``cpu`` (the default) changes nothing: every ``.to(cpu)`` of a CPU
tensor is that tensor, so a ``cpu`` run is today's run bit for bit.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils._pytree import tree_map

from .config import DEVICES, ConfigError


class DeviceUnavailableError(ConfigError):
    """The run asked for a device this machine does not have (``cuda`` without a GPU, or more
    processes than GPUs); raised before anything is written."""


def run_device(name: str, *, local_rank: int = 0, processes: int = 1) -> torch.device:
    """The device of the process with ``local_rank`` among ``processes`` on this host.

    ``cpu``: the CPU. ``cuda``: ``cuda:<local_rank>`` (torchrun's ``LOCAL_RANK``: one GPU per
    process, as NCCL requires: it refuses two ranks on one GPU). ``auto``: ``cuda`` when
    ``torch.cuda.is_available()`` and there is a GPU for each of ``processes``, else ``cpu``.

    Raises :class:`DeviceUnavailableError` for ``cuda`` without CUDA or with fewer GPUs than
    ``processes`` (or than ``local_rank + 1``), and :class:`ConfigError` for a name not in
    ``DEVICES``."""
    if name not in DEVICES:
        raise ConfigError(f"device must be one of {DEVICES}, got {name!r}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    need = max(processes, local_rank + 1)
    if name == "auto":
        name = "cuda" if count >= need else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if count == 0:
        raise DeviceUnavailableError("device cuda: torch.cuda.is_available() is False on this machine (no GPU, or"
                                     f" torch {torch.__version__} built without CUDA); use --device cpu")
    if count < need:
        raise DeviceUnavailableError(f"device cuda: {need} processes need one GPU each, this machine has {count}"
                                     " (NCCL refuses two ranks on one GPU); use fewer processes or --device cpu")
    return torch.device("cuda", local_rank)


def torchrun_device(name: str) -> torch.device:
    """:func:`run_device` of this torchrun worker: its ``LOCAL_RANK`` among the
    ``LOCAL_WORLD_SIZE`` processes on this host (one process outside torchrun)."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return run_device(name, local_rank=local, processes=int(os.environ.get("LOCAL_WORLD_SIZE", local + 1)))


def to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` (a batch: tensors nested in tuples, lists and dicts, as ``privacy.batch`` reads it) with every tensor on ``device``;
    a tensor already there is returned as it is (no copy)."""
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)
