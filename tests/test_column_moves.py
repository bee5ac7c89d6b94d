"""In-place column moves (``offload.column_moves``): the bits of the torch operations they replace."""

import pytest
import torch

from offload.column_copy import ColumnCopies
from offload.column_moves import compact_columns_, handover_columns_


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("keep", [0, 1, 7, 12, 13])
def test_compaction_keeps_the_columns_in_place(dtype, keep):
    gen = torch.Generator().manual_seed(keep)
    t = torch.randn(9, 13, generator=gen).to(dtype)
    positions = torch.randperm(13, generator=gen)[:keep].sort().values
    want = t.index_select(1, positions)
    got = compact_columns_(t, positions)
    assert got.shape == (9, keep) and got.is_contiguous()
    assert got.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert torch.equal(got, want)


def test_compaction_refuses_what_it_cannot_do_in_place():
    t = torch.randn(4, 6)
    before = t.clone()
    with pytest.raises(ValueError, match="strictly increasing"):
        compact_columns_(t, torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="strictly increasing"):
        compact_columns_(t, torch.tensor([1, 1]))
    with pytest.raises(IndexError, match="out of range"):
        compact_columns_(t, torch.tensor([2, 6]))
    with pytest.raises(ValueError, match="contiguous"):
        compact_columns_(t.t(), torch.tensor([0]))
    assert torch.equal(t, before)  # nothing moved


def _reference(full, sel, old, new):
    """``offload.zenflow``'s handover by gathers and scatters (out of place)."""
    full, before = full.clone(), sel.clone()
    leaving, entering = ~torch.isin(old, new), ~torch.isin(new, old)
    full.index_copy_(1, old[leaving], before[:, leaving.nonzero().squeeze(1)])
    out = torch.empty_like(before)
    out.index_copy_(1, (~entering).nonzero().squeeze(1), before[:, (~leaving).nonzero().squeeze(1)])
    out.index_copy_(1, entering.nonzero().squeeze(1), full.index_select(1, new[entering]))
    return full, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_a_handover_equals_its_gathers_and_scatters(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    n, s = 17, [0, 1, 4, 6, 9, 17][seed]
    full = torch.randn(11, n, generator=gen).to(dtype)
    old = torch.randperm(n, generator=gen)[:s].sort().values
    new = old.clone() if seed == 3 else torch.randperm(n, generator=gen)[:s].sort().values
    sel = full.index_select(1, old) + 1  # the device's newer values of the selected columns
    want_full, want_sel = _reference(full, sel, old, new)
    queue = ColumnCopies()
    handover_columns_(full, sel, old, new, queue=queue)
    queue.run()
    assert torch.equal(full, want_full) and torch.equal(sel, want_sel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_handover_takes_the_entering_columns_given(dtype):
    """``entering`` given: the entering columns come from it, in order, and ``full``'s own
    copy of them is neither read nor written."""
    gen = torch.Generator().manual_seed(9)
    full = torch.randn(6, 15, generator=gen).to(dtype)
    old, new = torch.tensor([1, 4, 7, 9, 12]), torch.tensor([0, 4, 9, 10, 14])
    sel = torch.randn(6, 5, generator=gen).to(dtype)
    given = torch.randn(6, 3, generator=gen).to(dtype)  # columns 0, 10, 14
    expected_source = full.clone()
    expected_source[:, [0, 10, 14]] = given
    want_full, want_sel = _reference(expected_source, sel, old, new)
    want_full[:, [0, 10, 14]] = full[:, [0, 10, 14]]  # untouched
    handover_columns_(full, sel, old, new, given)
    assert torch.equal(full, want_full) and torch.equal(sel, want_sel)
    with pytest.raises(ValueError, match="entering must be"):
        handover_columns_(full, sel, new, old, given[:, :2])


def test_a_handover_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="handover_columns_"):
        handover_columns_(torch.zeros(3, 8), torch.zeros(3, 2), torch.tensor([0, 1]), torch.tensor([1, 2, 3]))


def test_a_large_handover_split_over_threads_equals_its_gathers_and_scatters():
    """Above ``offload.row_team``'s size for splitting: the rows go to several threads."""
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(1024, 700, generator=gen)
    old, new = (torch.randperm(700, generator=gen)[:350].sort().values for _ in range(2))
    sel = torch.randn(1024, 350, generator=gen)
    want_full, want_sel = _reference(full, sel, old, new)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        handover_columns_(full, sel, old, new)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(full, want_full) and torch.equal(sel, want_sel)
