"""offload.column_copy: the compiled column gathers and scatters equal torch's index operations bit for bit."""

from __future__ import annotations

import pytest
import torch

from offload.column_copy import (ColumnCopies, add_gathered_columns_, gather_columns, scatter_columns_,
                                 scatter_two_columns_, split_columns_, split_wide_)

DTYPES = [torch.float32, torch.float64, torch.bfloat16]  # bfloat16 takes the torch fallback


def _problem(dtype, rows=7, n=13, k=5, sorted_=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randn(rows, n, generator=gen).to(dtype)
    cols = torch.randperm(n, generator=gen)[:k]
    return src, (torch.sort(cols).values if sorted_ else cols)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sorted_", [True, False])
def test_gather_equals_index_select(dtype, sorted_):
    src, cols = _problem(dtype, sorted_=sorted_)
    assert torch.equal(gather_columns(src, cols), src.index_select(1, cols))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float64])
def test_gather_into_a_buffer_equals_copy_of_index_select(dtype, out_dtype):
    src, cols = _problem(dtype)
    out = torch.full((src.shape[0], cols.numel()), float("nan"), dtype=out_dtype)
    assert gather_columns(src, cols, out=out) is out
    assert torch.equal(out, torch.empty_like(out).copy_(src.index_select(1, cols)))
    assert gather_columns(src, cols[:0], out=out[:, :0]).shape == (src.shape[0], 0)
    with pytest.raises(ValueError, match="out must be"):
        gather_columns(src, cols, out=out[:, 1:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_gathered_equals_add_of_index_select(dtype):
    src, cols = _problem(dtype)
    acc = torch.randn(src.shape[0], cols.numel(), generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = acc.clone().add_(src.index_select(1, cols))
    out = add_gathered_columns_(acc, src, cols)
    assert out is acc and torch.equal(acc, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_equals_index_copy(dtype):
    dst, cols = _problem(dtype, sorted_=False)
    values = torch.randn(dst.shape[0], cols.numel(), generator=torch.Generator().manual_seed(2)).to(dtype)
    expected = dst.clone().index_copy_(1, cols, values)
    out = scatter_columns_(dst, cols, values)
    assert out is dst and torch.equal(dst, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [0, 1, 5, 13])
def test_scatter_two_equals_two_scatters(dtype, k):
    """Two disjoint column sets (a split of a shuffled range: any sizes, one of them empty, or
    all columns) written in one pass equal two scatters, in either order."""
    dst, _ = _problem(dtype, k=0)
    n = dst.shape[1]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(k))
    a, b = torch.sort(perm[:k]).values, torch.sort(perm[k:]).values
    gen = torch.Generator().manual_seed(3)
    src_a = torch.randn(dst.shape[0], a.numel(), generator=gen).to(dtype)
    src_b = torch.randn(dst.shape[0], b.numel(), generator=gen).to(dtype)
    expected = scatter_columns_(scatter_columns_(dst.clone(), a, src_a), b, src_b)
    assert torch.equal(scatter_columns_(scatter_columns_(dst.clone(), b, src_b), a, src_a), expected)
    out = scatter_two_columns_(dst, a, src_a, b, src_b)
    assert out is dst and torch.equal(dst, expected)
    with pytest.raises(ValueError, match="src must be"):
        scatter_two_columns_(dst, a, src_a, b, src_b[:1])
    with pytest.raises(IndexError, match="out of (range|bounds)"):  # torch's words in the fallback
        scatter_two_columns_(dst, a, src_a, torch.cat([b, torch.tensor([n])]).sort().values,
                             torch.zeros(dst.shape[0], b.numel() + 1, dtype=dtype))


def test_non_contiguous_rows_and_parameters_work():
    base = torch.randn(6, 20)
    src = base[::2]  # rows strided, columns contiguous: the compiled loop
    cols = torch.tensor([1, 4, 19])
    assert torch.equal(gather_columns(src, cols), src.index_select(1, cols))
    transposed = torch.randn(9, 5).t()  # columns strided: the torch fallback
    assert torch.equal(gather_columns(transposed, cols[:2]), transposed.index_select(1, cols[:2]))
    param = torch.nn.Parameter(torch.randn(3, 4))
    with torch.no_grad():
        scatter_columns_(param, torch.tensor([2]), torch.ones(3, 1))
    assert torch.equal(param[:, 2], torch.ones(3))


def test_empty_columns_and_bad_input():
    src = torch.randn(4, 6)
    assert gather_columns(src, torch.empty(0, dtype=torch.int64)).shape == (4, 0)
    with pytest.raises(IndexError, match="out of range"):
        gather_columns(src, torch.tensor([0, 6]))
    with pytest.raises(IndexError, match="out of range"):
        scatter_columns_(src, torch.tensor([-1]), torch.zeros(4, 1))
    with pytest.raises(ValueError, match="acc must be"):
        add_gathered_columns_(torch.zeros(4, 3), src, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="src must be"):
        scatter_columns_(src, torch.tensor([0, 1]), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="2-D"):
        gather_columns(torch.randn(4), torch.tensor([0]))
    with pytest.raises(ValueError, match="int64"):
        gather_columns(src, torch.tensor([0, 1], dtype=torch.int32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("add", [False, True])
def test_split_equals_a_gather_and_a_gather_and_add(dtype, add):
    src, sel = _problem(dtype, rows=9, n=31, k=6, seed=6)
    uns = torch.tensor([c for c in range(31) if c not in set(sel.tolist())])
    acc0 = torch.randn(9, uns.numel(), generator=torch.Generator().manual_seed(7)).to(dtype)
    acc = acc0.clone()
    picked = split_columns_(src, sel, acc, uns, add=add)
    assert torch.equal(picked, src.index_select(1, sel))
    expected = acc0.clone().add_(src.index_select(1, uns)) if add else src.index_select(1, uns)
    assert torch.equal(acc, expected)
    assert split_columns_(src, sel[:0], acc, uns, add=add).shape == (9, 0)
    with pytest.raises(ValueError, match="acc must be"):
        split_columns_(src, sel, acc[:, 1:], uns, add=add)
    with pytest.raises(IndexError if dtype != torch.bfloat16 else RuntimeError):  # bfloat16: torch's own error
        split_columns_(src, sel, acc, torch.cat([uns[:-1], torch.tensor([31])]), add=add)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("add", [False, True])
def test_a_wide_split_holds_the_split_in_its_columns(dtype, add):
    """``split_wide_`` keeps the whole row: its unselected columns are ``split_columns_``'s sum."""
    src, sel = _problem(dtype, rows=9, n=31, k=6, seed=8)
    uns = torch.tensor([c for c in range(31) if c not in set(sel.tolist())])
    wide0 = torch.randn(9, 31, generator=torch.Generator().manual_seed(9)).to(dtype)
    narrow, wide = wide0.index_select(1, uns), wide0.clone()
    want = split_columns_(src, sel, narrow, uns, add=add)
    queue = ColumnCopies()
    picked = split_wide_(src, sel, wide, add=add, queue=queue)
    queue.run()
    assert torch.equal(picked, want) and torch.equal(wide.index_select(1, uns), narrow)
    assert torch.equal(wide, wide0 + src if add else src)
    with pytest.raises(ValueError, match="acc must be"):
        split_wide_(src, sel, wide[:, 1:], add=add)
    if dtype != torch.bfloat16:
        with pytest.raises(IndexError):
            split_wide_(src, torch.tensor([0, 31]), wide, add=add)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_queue_gives_the_bits_of_copies_run_at_once(dtype, threads):
    """A step's copies queued in one ColumnCopies (a split per gradient, a scatter and a
    two-set scatter per parameter) and run on ``threads`` threads equal the torch operations."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(1, 9), (5, 13), (33, 8)]
    queue = ColumnCopies()
    expected, got = [], []
    for rows, n in shapes:
        src = torch.randn(rows, n, generator=gen).to(dtype)
        perm = torch.randperm(n, generator=gen)
        sel, uns = torch.sort(perm[:3]).values, torch.sort(perm[3:]).values
        acc = torch.randn(rows, uns.numel(), generator=gen).to(dtype)
        dst = torch.randn(rows, n, generator=gen).to(dtype)
        dst2, val_a, val_b = dst.clone(), src[:, :3].clone(), src[:, 3:].clone()
        expected += [src.index_select(1, sel), acc + src.index_select(1, uns),
                     dst.clone().index_copy_(1, sel, val_a),
                     dst.clone().index_copy_(1, sel, val_a).index_copy_(1, uns, val_b)]
        picked = split_columns_(src, sel, acc, uns, add=True, queue=queue)
        got += [picked, acc, scatter_columns_(dst, sel, val_a, queue=queue),
                scatter_two_columns_(dst2, sel, val_a, uns, val_b, queue=queue)]
    queue.run(threads)
    assert not queue.jobs
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
