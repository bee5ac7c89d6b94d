"""Every rank of a sharded step receives the same GLOBAL batch: this module cuts out the rank's
own rows (``my_share``), zeroes the losses of padding rows (``masked_losses``), and puts the
ranks' statistics back together into the global batch's metrics (``global_metrics``).

The non-pipelined step (``fsdpx.runtime.step``) and the pipelined one
(``fsdpx.runtime.pipeline``) share these, so both see the same rows and report the same metrics.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor

from fsdpx.sharding.comm import Comm
from fsdpx.sharding.layout import chunk_bounds
from fsdpx.sharding.plan import ShardingPlan
from privacy.batch import slice_batch, unpack
from privacy.step import DPConfig
from privacy.step_metrics import StepMetrics


def my_share(batch: tuple, plan: ShardingPlan, comm: Comm) -> tuple:
    """This rank's rows of the global ``batch`` (``privacy.batch.slice_batch``: every tensor
    leading with the batch dimension is cut, mapping inputs and a padding mask included, the
    rest shared): chunk ``i`` of ``k`` over the plan's data axes (``chunk_bounds``: sizes differ
    by at most one, so a rank may get no rows; tensor-parallel ranks share theirs). Proven with
    the steps it feeds: ``property_tests/test_sharded_properties.py::
    test_sharded_steps_equal_unsharded_steps``, ``property_tests/test_padded_batch_properties.py::
    test_a_padded_sharded_step_equals_the_unpadded_unsharded_step``."""
    k = comm.mesh.axis_size(plan.data_axes)
    i = comm.mesh.index(comm.rank, plan.data_axes)
    a, b = chunk_bounds(unpack(batch)[1].shape[0], k, i)
    return slice_batch(batch, a, b)


def counts_its_share(plan: ShardingPlan, comm: Comm) -> bool:
    """Whether this rank's statistics count toward the global metrics: the ranks of one
    tensor-parallel group hold the same share of the batch (``my_share``), so only the first of
    them (index 0 on ``plan.tp_axis``) counts it and each example is counted once; without
    tensor parallelism every rank counts its own. Proven by ``tests/test_step_metrics.py``."""
    return plan.tp_axis is None or comm.mesh.index(comm.rank, plan.tp_axis) == 0


NO_STATS = (0.0, 0, 0, 0.0)
"""The statistics of a rank that counts no example (loss sum, examples, clipped, norm sum)."""


def masked_losses(losses: Tensor, mask: Tensor | None) -> Tensor:
    """``losses`` with padding rows (mask False) set to exactly 0, so their gradient is 0
    (``property_tests/test_padded_batch_properties.py::test_a_padding_row_of_nan_contributes_nothing``)."""
    return losses if mask is None else torch.where(mask, losses, torch.zeros_like(losses))


def device_stats(loss_sum: Tensor, n: int, clipped: Tensor | int = 0, norm_sum: Tensor | float = 0.0) -> Tensor:
    """A rank's statistics (loss sum, examples, clipped examples, norm sum) as one float64
    tensor on ``loss_sum``'s device, formed there (no host round trip): what
    :func:`global_metrics` gathers. Integers below 2**53 and float32 sums are exact in float64."""
    parts = [loss_sum.detach().to(torch.float64)]
    for v in (n, clipped, norm_sum):
        parts.append(v.detach().to(torch.float64) if isinstance(v, Tensor) else parts[0].new_full((), float(v)))
    return torch.stack(parts)


def global_metrics(comm: Comm, stats, config: DPConfig | None) -> StepMetrics:
    """The step's metrics over every rank from each rank's ``stats`` (loss sum, examples,
    clipped examples, norm sum: a :func:`device_stats` tensor, a tuple of numbers, or
    :data:`NO_STATS` from a rank whose examples another rank counts, :func:`counts_its_share`):
    summed in rank order, the same floats whichever way they travel. Where the communicator
    has ``all_gather_stats`` and ``stats`` is a tensor, the gathered rows stay on the device
    until the metrics are read (:class:`privacy.step_metrics.StepMetrics`: the step does not
    wait for its device); otherwise one float64 all-gather (``all_gather_floats``) or an
    object all-gather. ``loss`` is NaN (and the private fractions 0) when the global batch has
    no example; ``batch_size`` is the global batch's count of real examples on every layout
    (``tests/test_step_metrics.py``, ``tests/test_step_syncs.py``).
    The same metrics as the unsharded step (``property_tests/test_padded_batch_properties.py::
    test_a_padded_sharded_step_equals_the_unpadded_unsharded_step``)."""
    gather = getattr(comm, "all_gather_stats", None)
    if gather is not None:  # every rank takes this branch: the same collective on every rank
        if not isinstance(stats, Tensor):
            device = getattr(comm, "device", torch.device("cpu"))
            stats = (torch.zeros(4, dtype=torch.float64, device=device) if tuple(stats) == NO_STATS
                     else torch.tensor([float(v) for v in stats], dtype=torch.float64, device=device))
        return StepMetrics({"everyone": gather(stats)}, partial(_summed, private=config is not None))
    if isinstance(stats, Tensor):
        stats = tuple(stats.tolist())
    floats = getattr(comm, "all_gather_floats", None)
    everyone = floats(stats) if floats is not None else comm.all_gather_object(stats)
    return StepMetrics({"everyone": [list(s) for s in everyone]}, partial(_summed, private=config is not None))


def _summed(host: dict[str, Any], private: bool) -> dict[str, Any]:
    everyone = host["everyone"]
    loss = sum(s[0] for s in everyone)
    n = int(sum(s[1] for s in everyone))
    metrics: dict[str, Any] = {"loss": loss / n if n else float("nan"), "batch_size": n}
    if private:
        metrics["clipped_fraction"] = sum(s[2] for s in everyone) / n if n else 0.0
        metrics["mean_norm"] = sum(s[3] for s in everyone) / n if n else 0.0
    return metrics
