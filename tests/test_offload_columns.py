"""The ZenFlow selection rule: column scores and the top-k choice (offload.columns)."""

import math

import pytest
import torch

from offload.columns import column_scores, complement, num_selected, select_columns


def test_column_scores_are_squared_column_norms_in_float64():
    g = torch.tensor([[1.0, -2.0, 0.0], [3.0, 0.5, 0.0]], dtype=torch.float32)
    s = column_scores(g)
    assert s.dtype == torch.float64
    assert s.tolist() == [10.0, 4.25, 0.0]


def test_column_scores_read_the_logical_view_not_the_storage():
    g = torch.randn(5, 3, dtype=torch.float64)
    transposed_storage = g.t().contiguous().t()  # same values, column-major storage
    assert not transposed_storage.is_contiguous()
    assert torch.equal(column_scores(transposed_storage), column_scores(g))


@pytest.mark.parametrize("shape", [(4,), (2, 3, 4), ()])
def test_column_scores_reject_tensors_that_are_not_2d(shape):
    with pytest.raises(ValueError, match="2-D"):
        column_scores(torch.zeros(shape))


def test_column_scores_of_empty_shapes():
    assert column_scores(torch.zeros(3, 0)).shape == (0,)
    assert column_scores(torch.zeros(0, 4)).tolist() == [0.0] * 4


def test_non_finite_entries_only_affect_their_column():
    g = torch.ones(2, 3)
    g[0, 1] = float("nan")
    g[1, 2] = float("inf")
    s = column_scores(g)
    assert s[0] == 2.0 and math.isnan(s[1]) and math.isinf(s[2])


@pytest.mark.parametrize(
    "n, ratio, k",
    [(10, 0.0, 0), (10, 0.01, 1), (10, 0.1, 1), (10, 0.25, 2), (10, 1.0, 10), (3, 0.5, 1), (0, 0.5, 0),
     (100, 0.29, 28)],  # 0.29 * 100 == 28.999999999999996: the documented float floor
)
def test_num_selected_is_max_one_floor_ratio_times_columns(n, ratio, k):
    assert num_selected(n, ratio) == k


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan")])
def test_invalid_ratio_is_rejected(ratio):
    with pytest.raises(ValueError, match="topk_ratio"):
        select_columns(torch.ones(4), ratio)


def test_select_columns_returns_the_top_scores_sorted():
    s = torch.tensor([0.1, 5.0, 3.0, 0.2, 4.0], dtype=torch.float64)
    sel = select_columns(s, 0.6)
    assert sel.dtype == torch.int64
    assert sel.tolist() == [1, 2, 4]


def test_select_columns_breaks_ties_by_lower_index():
    s = torch.tensor([1.0, 2.0, 2.0, 0.0, 2.0, 2.0])
    assert select_columns(s, 0.5).tolist() == [1, 2, 4]
    assert select_columns(torch.zeros(5), 0.4).tolist() == [0, 1]


def test_select_columns_ranks_nan_first_then_inf():
    s = torch.tensor([1.0, float("inf"), 3.0, float("nan"), 2.0])
    assert select_columns(s, 0.4).tolist() == [1, 3]


def test_ratio_zero_selects_nothing_and_ratio_one_everything():
    s = torch.rand(7)
    assert select_columns(s, 0.0).tolist() == []
    assert select_columns(s, 1.0).tolist() == list(range(7))
    assert select_columns(torch.zeros(0), 0.5).tolist() == []


def test_select_columns_rejects_scores_that_are_not_1d():
    with pytest.raises(ValueError, match="1-D"):
        select_columns(torch.ones(2, 2), 0.5)


def test_complement_is_the_sorted_rest():
    assert complement(torch.tensor([1, 3]), 5).tolist() == [0, 2, 4]
    assert complement(torch.tensor([], dtype=torch.int64), 2).tolist() == [0, 1]


def test_float_row_shards_select_the_same_columns_and_scores_agree_to_rounding():
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(37, 50, generator=gen) * torch.rand(50, generator=gen)
    full = column_scores(g)
    for world in (2, 3, 5):
        parts = [column_scores(shard) for shard in torch.tensor_split(g, world, dim=0)]
        summed = parts[0]
        for p in parts[1:]:
            summed = summed + p
        torch.testing.assert_close(summed, full, rtol=37 * 2**-52, atol=0)
        assert torch.equal(select_columns(summed, 0.1), select_columns(full, 0.1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_cpu_scores_add_the_rows_in_order(dtype, threads):
    """Each column's float64 sum of squares adds the rows in order, bit for bit, on any number
    of threads, for row-major and transposed storage alike."""
    gen = torch.Generator().manual_seed(5)
    g = (torch.randn(67, 13, generator=gen, dtype=torch.float64) * torch.logspace(-8, 8, 13, dtype=torch.float64)).to(dtype)
    want = torch.zeros(13, dtype=torch.float64)
    for row in g.to(torch.float64):
        want = want + row * row
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(column_scores(g), want)
        assert torch.equal(column_scores(g.t().contiguous().t()), want)
    finally:
        torch.set_num_threads(before)
