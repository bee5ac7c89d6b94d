"""What jobs run on: a number of interchangeable devices of one memory size."""

from __future__ import annotations

import hashlib
import os
import platform
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Devices:
    """``count`` interchangeable devices of ``memory_bytes`` each (a GPU's memory, or a CPU
    core's share of host memory). ``kind`` is ``"cuda"`` or ``"cpu"``. A job gets a group of
    ``count`` of them; a cluster is the same object with the cluster's size."""

    count: int
    memory_bytes: int
    kind: str = "cpu"
    ids: tuple[int, ...] | None = None  # which ones (GPU indices or CPU cores), when placed

    def __post_init__(self) -> None:
        if self.count < 1 or self.memory_bytes < 1:
            raise ValueError(f"Devices needs count >= 1 and memory_bytes >= 1, got {self.count}, {self.memory_bytes}")
        if self.kind not in ("cpu", "cuda"):
            raise ValueError(f"Devices.kind must be 'cpu' or 'cuda', got {self.kind!r}")
        if self.ids is not None and len(self.ids) != self.count:
            raise ValueError(f"Devices.ids lists {len(self.ids)} devices, count is {self.count}")

    def group(self, count: int, ids: tuple[int, ...] | None = None) -> "Devices":
        """``count`` of these devices (same memory and kind), optionally which ones."""
        return Devices(count, self.memory_bytes, self.kind, ids)


def physical_ids(cluster: Devices, ids: Sequence[int]) -> tuple[int, ...]:
    """The GPUs or CPU cores of this machine behind plan device ``ids``: GPU ``i`` is ``i``; on a
    CPU, device ``i`` is core ``cores[i % len(cores)]`` of the cores this process may use (a
    slot sharing a core when there are more devices than cores). Raises ``ValueError`` when
    ``ids`` name more GPUs than this machine has."""
    if cluster.kind == "cuda":
        import torch

        have = torch.cuda.device_count()
        if max(ids) >= have:
            raise ValueError(f"the plan uses GPU {max(ids)} but this machine has {have}")
        return tuple(ids)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return tuple(cores[i % len(cores)] for i in ids)


def local_devices() -> Devices:
    """This machine: its GPUs when torch sees any, else its CPU cores, each with an equal
    share of host memory."""
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return Devices(n, torch.cuda.get_device_properties(0).total_memory, "cuda")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Devices(cores, total // cores, "cpu")


def hardware_fingerprint(devices: Devices) -> str:
    """A short hash of what step times depend on: device kind, model and memory, CPU model,
    torch version. Profiles measured under another fingerprint are not reused."""
    import torch

    name = torch.cuda.get_device_name(0) if devices.kind == "cuda" else platform.processor() or platform.machine()
    text = "|".join([devices.kind, name, str(devices.memory_bytes), platform.machine(), torch.__version__])
    return hashlib.sha256(text.encode()).hexdigest()[:16]
