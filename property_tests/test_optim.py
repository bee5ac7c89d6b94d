"""The functional optimizers equal torch.optim and are elementwise."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from fsdpx.optim import adamw, sgd

shapes = st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=3), min_size=1, max_size=3)


def _run_torch(opt_cls, kwargs, params, grads_seq):
    tparams = [torch.nn.Parameter(p.clone()) for p in params.values()]
    opt = opt_cls(tparams, foreach=False, **kwargs)
    for grads in grads_seq:
        for t, g in zip(tparams, grads.values()):
            t.grad = g.clone()
        opt.step()
    return {k: t.detach() for k, t in zip(params, tparams)}


def _run_ours(optimizer, params, grads_seq):
    state = optimizer.init(params)
    for grads in grads_seq:
        params, state = optimizer.update(grads, state, params)
    return params


def _problem(shape_list, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    params = {f"p{i}": torch.randn(s, generator=g, dtype=dtype) for i, s in enumerate(shape_list)}
    grads_seq = [{k: torch.randn(v.shape, generator=g, dtype=dtype) for k, v in params.items()} for _ in range(20)]
    return params, grads_seq


@given(shapes, st.integers(0, 2**31), st.sampled_from([torch.float32, torch.float64]),
       st.floats(1e-4, 1e-1), st.floats(0.0, 0.2), st.sampled_from([(0.9, 0.999), (0.5, 0.9)]))
def test_adamw_matches_torch_optim_over_20_steps(shape_list, seed, dtype, lr, wd, betas):
    params, grads_seq = _problem(shape_list, seed, dtype)
    ours = _run_ours(adamw(lr, betas=betas, weight_decay=wd), params, grads_seq)
    ref = _run_torch(torch.optim.AdamW, dict(lr=lr, betas=betas, weight_decay=wd), params, grads_seq)
    for k in params:
        torch.testing.assert_close(ours[k], ref[k], rtol=1e-6, atol=1e-6)


@given(shapes, st.integers(0, 2**31), st.sampled_from([torch.float32, torch.float64]),
       st.floats(1e-4, 1e-1), st.sampled_from([0.0, 0.5, 0.9]))
def test_sgd_matches_torch_optim_over_20_steps(shape_list, seed, dtype, lr, momentum):
    params, grads_seq = _problem(shape_list, seed, dtype)
    ours = _run_ours(sgd(lr, momentum), params, grads_seq)
    ref = _run_torch(torch.optim.SGD, dict(lr=lr, momentum=momentum), params, grads_seq)
    for k in params:
        torch.testing.assert_close(ours[k], ref[k], rtol=1e-6, atol=1e-6)


@given(st.integers(2, 12), st.integers(0, 2**31), st.data())
def test_optimizers_are_elementwise_on_any_slice(n, seed, data):
    """Updating a slice alone gives the same bits as that slice of the full update (ZeRO relies on it)."""
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start, n))
    params, grads_seq = _problem([[n]], seed, torch.float32)
    sliced = {k: v[start:stop] for k, v in params.items()}
    sliced_grads = [{k: v[start:stop] for k, v in g.items()} for g in grads_seq]
    for opt in (adamw(1e-2, weight_decay=0.1), sgd(1e-2, 0.9)):
        full = _run_ours(opt, params, grads_seq)
        part = _run_ours(opt, sliced, sliced_grads)
        for k in params:
            assert torch.equal(full[k][start:stop], part[k])


@given(shapes, st.integers(0, 2**31), st.sampled_from([torch.float32, torch.float64]),
       st.floats(1e-4, 1e-1), st.floats(0.0, 0.2))
def test_inplace_update_equals_the_pure_update(shape_list, seed, dtype, lr, wd):
    """``update_inplace`` (donated buffers) gives the bits of ``update``, parameters and state."""
    params, grads_seq = _problem(shape_list, seed, dtype)
    opt = adamw(lr, weight_decay=wd)
    pure_p, pure_s = params, opt.init(params)
    own_p = {k: v.clone() for k, v in params.items()}
    own_s = opt.init(own_p)
    for grads in grads_seq:
        pure_p, pure_s = opt.update(grads, pure_s, pure_p)
        own_p, own_s = opt.update_inplace(grads, own_s, own_p)
    assert own_s["count"] == pure_s["count"] == len(grads_seq)
    for k in params:
        assert torch.equal(own_p[k], pure_p[k])
        assert torch.equal(own_s["mu"][k], pure_s["mu"][k]) and torch.equal(own_s["nu"][k], pure_s["nu"][k])
