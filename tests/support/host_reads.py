"""Counting the aten ops that make the host read a device value (issue 30): on a GPU each one
stops the host until the device has finished everything queued before it.

On the CPU the same reads go through the same aten ops (``.item()``, ``float(t)`` and ``bool(t)``
are ``_local_scalar_dense``; ``nonzero``, ``unique`` and ``masked_select`` must know their output
size), so counting them under a dispatch mode proves on the CPU what a GPU step does."""

from __future__ import annotations

import collections

from torch.utils._python_dispatch import TorchDispatchMode

# aten ops whose result the host must read from the device (or whose output size it must know)
HOST_READS = {"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique", "_unique", "_unique2",
              "unique_dim", "unique_consecutive", "repeat_interleave", "equal", "is_nonzero", "_assert_async"}


class HostReads(TorchDispatchMode):
    """Counts, per op name, the ops of :data:`HOST_READS` run under it (this thread only)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))
