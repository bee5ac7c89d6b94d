"""AdamW over lists (``adamw_foreach``): the path of float32/float64 tensors the compiled CPU loop
does not take (GPU tensors) equals the one-tensor operations (``adamw_ops``) bit for bit. Here on the CPU the lists
run torch's per-tensor fallback; the CUDA cases run where a GPU is."""

from __future__ import annotations

import pytest
import torch

from fsdpx.optim import adamw
from fsdpx.optim import optimizers
from fsdpx.optim.optimizers import adamw_foreach, adamw_foreach_, adamw_ops, adamw_ops_

HYPER = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, NO_GPU])]


def tensors(dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (7,), (2, 4, 3), ()]
    make = lambda s: torch.randn(s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return ([make(s) for s in shapes], [make(s) for s in shapes], [make(s) for s in shapes],
            [make(s).abs() for s in shapes])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("count", [1, 7])
def test_foreach_equals_the_one_tensor_kernel_bit_for_bit(device, dtype, count):
    ps, gs, ms, vs = tensors(dtype, device)
    before = [t.clone() for t in ps + gs + ms + vs]
    outs = adamw_foreach(ps, gs, ms, vs, count, **HYPER)
    assert all(torch.equal(a, b) for a, b in zip(before, ps + gs + ms + vs))  # inputs untouched
    for i in range(len(ps)):
        want = adamw_ops(ps[i], gs[i], ms[i], vs[i], count, **HYPER)
        for got, w in zip((outs[0][i], outs[1][i], outs[2][i]), want):
            assert got.dtype == w.dtype and torch.equal(got, w)
    adamw_foreach_(ps, gs, ms, vs, count, **HYPER)
    for i in range(len(ps)):
        p, m, v = (t.clone() for t in (before[i], before[8 + i], before[12 + i]))
        adamw_ops_(p, before[4 + i], m, v, count, **HYPER)
        assert torch.equal(ps[i], p) and torch.equal(ms[i], m) and torch.equal(vs[i], v)


def test_adamw_update_mixes_both_paths_and_keeps_the_key_order():
    """float32 parameters take the compiled loop, half ones the lists; the update and the
    in-place update agree and return the parameters' key order."""
    g = torch.Generator().manual_seed(1)
    params = {"b": torch.randn(4, generator=g), "a": torch.randn(3, 2, generator=g).half(),
              "c": torch.randn(5, generator=g).bfloat16(), "d": torch.randn(2, 2, generator=g, dtype=torch.float64)}
    grads = {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in params.items()}
    opt = adamw(**{"lr": 1e-2})
    state = opt.init(params)
    new, st = opt.update(grads, state, params)
    assert list(new) == list(params) and list(st["mu"]) == list(params)
    donated = {k: v.clone() for k, v in params.items()}
    dstate = opt.init(donated)
    new2, st2 = opt.update_inplace(grads, dstate, donated)
    for k in params:
        assert torch.equal(new[k], new2[k]) and torch.equal(st["nu"][k], st2["nu"][k])


def test_groups_are_chunked_by_bytes_in_order_and_meta_and_cpu_stay_one_by_one(monkeypatch):
    """Chunks keep the key order and hold at most FOREACH_CHUNK_BYTES (a larger tensor alone);
    CPU and meta tensors (the memory model's) never take the lists."""
    monkeypatch.setattr(optimizers, "FOREACH_CHUNK_BYTES", 100)
    params = {k: torch.zeros(n) for k, n in (("a", 10), ("b", 15), ("c", 30), ("d", 5), ("e", 20))}  # 4 bytes each
    assert optimizers._chunks(list(params), params) == [["a", "b"], ["c"], ["d", "e"]]
    for device in ("cpu", "meta"):
        ps = {k: v.to(device) for k, v in params.items()}
        state = {"mu": ps, "nu": ps}
        assert optimizers._split_by_path(ps, ps, state) == (list(ps), [])
