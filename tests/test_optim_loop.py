"""fsdpx.optim.adamw_loop: the compiled AdamW pass is the per-operation-rounded arithmetic, on any
slice, layout and thread split, and agrees with the tensor operations to torch's sqrt rounding."""

import numpy as np
import pytest
import torch

from fsdpx import optim
from fsdpx.optim import adamw_loop

HP = dict(lr=3e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)


def _inputs(n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    p, g = torch.randn(n, generator=gen, dtype=dtype), torch.randn(n, generator=gen, dtype=dtype) * 1e-3
    m, v = torch.randn(n, generator=gen, dtype=dtype) * 1e-3, torch.rand(n, generator=gen, dtype=dtype) * 1e-6
    g[:7] = torch.tensor([0.0, -0.0, 1e-30, -1e30, 5e-8, 1.0, -3.0], dtype=dtype)  # zeros, tiny and huge
    return p, g, m, v


def _rounded_reference(p, g, m, v, count, lr, b1, b2, eps, weight_decay):
    """numpy, one array operation per step, each IEEE-rounded to the dtype (sqrt included)."""
    f = np.float32 if p.dtype == torch.float32 else np.float64
    p, g, m, v = (t.numpy() for t in (p, g, m, v))
    bc2_sqrt, step = np.sqrt(1 - b2**count), lr / (1 - b1**count)
    with np.errstate(over="ignore"):  # g = -1e30 squares to inf in float32, as it does in the loop
        new_p = p * f(1 - lr * weight_decay)
        new_m = m * f(b1) + g * f(1 - b1)
        new_v = (g * g) * f(1 - b2) + v * f(b2)
        d = ((new_m / (np.sqrt(new_v) / f(bc2_sqrt) + f(eps))) * f(step))
    return new_p - d, new_m, new_v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("count", [1, 2, 57])
def test_the_compiled_pass_is_the_per_operation_rounded_arithmetic(dtype, count):
    n = 3 * adamw_loop.CHUNK + 1001  # several chunks (threads) and a ragged end
    p, g, m, v = _inputs(n, dtype, count)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = optim.adamw_kernel(p, g, m, v, count, **HP)
        p2, m2, v2 = p.clone(), m.clone(), v.clone()
        optim.adamw_kernel_(p2, g, m2, v2, count, **HP)  # in place
    finally:
        torch.set_num_threads(threads)
    ref = _rounded_reference(p, g, m, v, count, **HP)
    for a, b, c in zip(got, (p2, m2, v2), ref):
        assert np.array_equal(a.numpy(), c) and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_compiled_pass_agrees_with_the_tensor_operations_up_to_torch_sqrt(dtype, monkeypatch):
    p, g, m, v = _inputs(100_000, dtype, 5)
    got = optim.adamw_kernel(p, g, m, v, 3, **HP)
    monkeypatch.setattr(adamw_loop, "applies", lambda *t: False)
    ref = optim.adamw_kernel(p, g, m, v, 3, **HP)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])  # the moments: no sqrt
    differ = (got[0] != ref[0]).sum().item()
    assert differ <= 10  # torch's sqrt is not always correctly rounded: a few in 10^5
    # A last-bit difference in sqrt(v) changes the update u by about eps * |u|; where u nearly
    # cancels p, that is more than eps of the new parameter, so the bound is on |p'| + |u|.
    update = (p * (1 - HP["lr"] * HP["weight_decay"]) - ref[0]).abs()
    bound = 2 * torch.finfo(dtype).eps * (ref[0].abs() + update)
    assert bool(((got[0] - ref[0]).abs() <= bound).all())


def test_any_layout_and_slice_gives_each_elements_same_bits():
    p, g, m, v = (t.reshape(300, 200) for t in _inputs(60_000, torch.float32, 9))
    whole = optim.adamw_kernel(p, g, m, v, 4, **HP)
    cols = optim.adamw_kernel(p[:, 50:130], g[:, 50:130], m[:, 50:130], v[:, 50:130], 4, **HP)  # strided
    tr = optim.adamw_kernel(p.t(), g.t(), m.t(), v.t(), 4, **HP)
    for w, c, t in zip(whole, cols, tr):
        assert torch.equal(w[:, 50:130], c) and torch.equal(w.t(), t)
    pt, mt, vt = p.t().clone().t(), m.clone(), v.clone()  # p non-contiguous, updated in place
    optim.adamw_kernel_(pt, g, mt, vt, 4, **HP)
    assert torch.equal(pt, whole[0]) and torch.equal(mt, whole[1]) and torch.equal(vt, whole[2])


def test_other_dtypes_and_devices_take_the_tensor_operations():
    p = torch.randn(10, 4)
    assert adamw_loop.applies(p, p.t(), p, p)
    assert not adamw_loop.applies(p.bfloat16(), p.bfloat16(), p.bfloat16(), p.bfloat16())
    assert not adamw_loop.applies(p, p.double(), p, p)  # mixed dtypes
    b = p.bfloat16()
    out = optim.adamw_kernel(b, b, b * 0, b * 0 + 1e-3, 1, **HP)
    assert out[0].dtype == torch.bfloat16 and torch.isfinite(out[0].float()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_update_columns_equals_each_column_updated_alone_with_its_count(dtype):
    """adamw's ``update_columns`` (one pass, per-column step counts, rows over threads) gives every
    column the bits ``update`` gives that column alone with its own count."""
    rows, n = 300, 1000  # 300k elements: above CHUNK, so the rows are split over threads
    p, g, m, v = (t.view(rows, n) for t in _inputs(rows * n, dtype, seed=5))
    counts = torch.randint(0, 40, (n,), generator=torch.Generator().manual_seed(6))
    counts[:3] = torch.tensor([0, 0, 10_000])
    opt = optim.adamw(HP["lr"], betas=(HP["b1"], HP["b2"]), eps=HP["eps"], weight_decay=HP["weight_decay"])
    new_p, slots = opt.update_columns(p, g, {"mu": m, "nu": v}, counts)
    for j in [0, 1, 2, 3, 500, n - 1]:
        col = {"x": p[:, j].clone()}
        state = {"count": int(counts[j]), "mu": {"x": m[:, j].clone()}, "nu": {"x": v[:, j].clone()}}
        want_p, want = opt.update({"x": g[:, j].clone()}, state, col)
        assert torch.equal(new_p[:, j], want_p["x"])
        assert torch.equal(slots["mu"][:, j], want["mu"]["x"]) and torch.equal(slots["nu"][:, j], want["nu"]["x"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_update_columns_in_place_writes_the_same_bits_into_its_inputs(dtype):
    """``update_columns(..., inplace=True)`` returns the param and slot tensors it was given,
    holding the bits the pure call returns (rows over threads, per-column counts)."""
    rows, n = 300, 1000
    p, g, m, v = (t.view(rows, n) for t in _inputs(rows * n, dtype, seed=7))
    counts = torch.randint(0, 40, (n,), generator=torch.Generator().manual_seed(8))
    opt = optim.adamw(HP["lr"], betas=(HP["b1"], HP["b2"]), eps=HP["eps"], weight_decay=HP["weight_decay"])
    want_p, want = opt.update_columns(p, g, {"mu": m, "nu": v}, counts)
    mine = {"mu": m.clone(), "nu": v.clone()}
    q = p.clone()
    got_p, got = opt.update_columns(q, g, mine, counts, inplace=True)
    assert got_p is q and got["mu"] is mine["mu"] and got["nu"] is mine["nu"]
    assert torch.equal(q, want_p) and torch.equal(mine["mu"], want["mu"]) and torch.equal(mine["nu"], want["nu"])
    strided = p.t().contiguous().t()  # not contiguous: a new tensor, the input untouched
    before = strided.clone()
    out_p, _ = opt.update_columns(strided, g, {"mu": m.clone(), "nu": v.clone()}, counts, inplace=True)
    assert out_p is not strided and torch.equal(strided, before) and torch.equal(out_p, want_p)


def test_update_columns_declines_what_it_does_not_cover():
    opt = optim.adamw(1e-3)
    p = torch.zeros(2, 3, dtype=torch.bfloat16)
    assert opt.update_columns(p, p, {"mu": p, "nu": p}, torch.zeros(3, dtype=torch.int64)) is None
    q = torch.zeros(6)
    assert opt.update_columns(q, q, {"mu": q, "nu": q}, torch.zeros(6, dtype=torch.int64)) is None
