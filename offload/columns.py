"""Which columns of a weight ZenFlow updates at once: scores and the top-k rule.

A 2-D weight ``[out, in]`` is split by *column* (input feature). A column's score is the squared
L2 norm of its gradient, taken on the parameter's logical ``[out, in]`` view, never on a flat
buffer, so the choice does not depend on how the weight is stored or partitioned. Parameters that
are not 2-D have no columns and are always updated on the device.

Under DP the caller passes the *noised* gradient: scores read nothing else, so selecting columns
is post-processing and costs no privacy.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from torch import Tensor

from offload.row_team import RowJob, run_rows


def column_scores(grad: Tensor) -> Tensor:
    """Squared L2 norm of each column of a 2-D gradient ``[out, in]``, as a float64 ``Tensor[in]``.

    Guarantees:
      - ``scores[j] == sum_i grad[i, j] ** 2``, accumulated in float64 on ``grad``'s device. On
        the CPU (float32 and float64) one compiled pass adds the rows in order, ``i = 0, 1, ...``,
        with no float64 copy of the gradient, its columns split over the caller's intra-op
        threads (each column summed by one thread: the bits do not depend on the count;
        ``tests/test_offload_columns.py::test_cpu_scores_add_the_rows_in_order``); elsewhere
        torch's ``sum``.
      - Row-shard decomposable: for row shards ``grad = cat(shards, 0)``, the scores of the shards
        summed in rank order equal ``column_scores(grad)``; bit for bit whenever the sums are exact
        in float64 (every float32/bf16 square is exact in float64; integer-valued or few-bit
        gradients make the sums exact too), otherwise within ``out * 2**-53`` relative, and exact
        ties (identical columns, zero columns) stay exact ties on any number of shards
        (``test_column_scores_are_world_size_invariant``).

    Edge cases: an ``[out, 0]`` gradient gives an empty tensor; ``[0, in]`` gives zeros; a NaN or
    inf entry gives a NaN or inf score for its column only. Raises ``ValueError`` if ``grad`` is
    not 2-D."""
    if grad.dim() != 2:
        raise ValueError(f"column_scores needs a 2-D [out, in] gradient, got shape {tuple(grad.shape)}")
    if grad.device.type != "cpu" or grad.dtype not in (torch.float32, torch.float64):
        return grad.to(torch.float64).square().sum(dim=0)
    scores = torch.zeros(grad.shape[1], dtype=torch.float64)
    if grad.shape[0]:
        run_rows([RowJob(_column_squares, (grad.detach().numpy(), scores.numpy()), grad.shape[1], grad.numel())])
    return scores


@numba.njit(nogil=True, cache=True)
def _column_squares(g, out, c0, c1):  # noqa: ANN001, ANN202
    """``out[j] = sum_i g[i, j] ** 2`` in float64 for columns ``c0 <= j < c1``, rows in order (an
    ``offload.row_team.RowJob`` whose ranges are columns: each touches only its own ``out[j]``).
    The sums live in an array of the loop's own until the end, which the compiler can vectorise
    (it cannot prove ``out`` apart from ``g``)."""
    acc = np.zeros(c1 - c0, np.float64)
    for i in range(g.shape[0]):
        row = g[i, c0:c1]
        for j in range(c1 - c0):
            acc[j] = acc[j] + np.float64(row[j]) * np.float64(row[j])
    out[c0:c1] = acc


def num_selected(n_columns: int, topk_ratio: float) -> int:
    """``max(1, floor(topk_ratio * n_columns))`` if ``topk_ratio > 0``, else 0; never more than
    ``n_columns``. ``floor`` is taken of the float product (``0.29 * 100`` is 28.999..., so 28)."""
    if not 0.0 <= topk_ratio <= 1.0:  # also rejects NaN
        raise ValueError(f"topk_ratio must be in [0, 1], got {topk_ratio}")
    if topk_ratio == 0.0:
        return 0
    return min(n_columns, max(1, math.floor(topk_ratio * n_columns)))


def select_columns(scores: Tensor, topk_ratio: float) -> Tensor:
    """The ``num_selected(len(scores), topk_ratio)`` highest-scoring columns, as a sorted
    ``LongTensor`` on ``scores``' device.

    Guarantees:
      - Deterministic: ties are broken by the lower index, so equal scores give equal answers on
        1 rank or N (``test_select_columns_breaks_ties_by_lower_index``).
      - Returned indices are strictly increasing, unique and in ``[0, len(scores))``.
      - ``topk_ratio == 0`` selects nothing; ``topk_ratio == 1`` selects every column.

    Edge cases: NaN ranks above +inf, which ranks above every finite score: a column whose
    gradient is not finite is updated on the device at once, where it shows, instead of being
    hidden in a host accumulator (``test_select_columns_ranks_nan_first``). Empty ``scores`` give
    an empty selection. Raises ``ValueError`` if ``scores`` is not 1-D or the ratio is outside
    ``[0, 1]``."""
    if scores.dim() != 1:
        raise ValueError(f"select_columns needs 1-D scores, got shape {tuple(scores.shape)}")
    k = num_selected(scores.numel(), topk_ratio)
    # A stable descending sort keeps equal scores in index order; torch ranks NaN highest.
    order = torch.sort(scores, descending=True, stable=True).indices
    return torch.sort(order[:k]).values


def complement(selected: Tensor, n_columns: int) -> Tensor:
    """The sorted columns of ``range(n_columns)`` that are not in ``selected``."""
    keep = torch.ones(n_columns, dtype=torch.bool, device=selected.device)
    keep[selected] = False
    return keep.nonzero().squeeze(1)
