"""The ZeRO-Offload baseline (offload.zero_offload): inner on the host, synchronously, every step."""

import pytest
import torch

from fsdpx.optim import adamw, sgd
from offload import zero_offload

INNERS = [adamw(lr=0.05, weight_decay=0.1), sgd(lr=0.05, momentum=0.9), sgd(lr=0.05)]


def problem(dtype, n_steps=5):
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=gen).to(dtype), "b": torch.randn(4, generator=gen).to(dtype),
              "conv": torch.randn(2, 1, 2, 2, generator=gen).to(dtype)}
    grads = [{k: torch.randn(v.shape, generator=gen).to(dtype) for k, v in params.items()} for _ in range(n_steps)]
    return params, grads


def run(opt, params, grads):
    state, p, history = opt.init(params), params, []
    for g in grads:
        p, state = opt.update(g, state, p)
        history.append(p)
    return history, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("inner", INNERS)
def test_equals_inner_bit_for_bit(inner, dtype):
    params, grads = problem(dtype)
    got, _ = run(zero_offload(inner), params, grads)
    want, _ = run(inner, params, grads)
    for a, b in zip(got, want):
        for k in a:
            assert a[k].dtype == dtype and torch.equal(a[k], b[k])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("inner", INNERS)
def test_donated_update_gives_the_same_bits(inner, dtype):
    params, grads = problem(dtype)
    opt = zero_offload(inner)
    want, want_state = run(opt, params, grads)
    state, p = opt.init(params), {k: v.clone() for k, v in params.items()}
    for g, expected in zip(grads, want):
        p, state = opt.update_inplace(g, state, p)
        for k in p:
            assert p[k].dtype == dtype and torch.equal(p[k], expected[k])
    for k, m in state["master"].items():
        assert torch.equal(m, want_state["master"][k])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_are_the_fp32_master_run_cast_down(dtype):
    params, grads = problem(dtype)
    inner = INNERS[0]
    got, state = run(zero_offload(inner), params, grads)
    want, _ = run(inner, {k: v.float() for k, v in params.items()}, 
                  [{k: v.float() for k, v in g.items()} for g in grads])
    for a, b in zip(got, want):
        for k in a:
            assert a[k].dtype == dtype and torch.equal(a[k], b[k].to(dtype))
    assert torch.equal(state["master"]["w"], want[-1]["w"])  # the master is never re-quantised


def test_state_is_plain_host_data_and_metrics_count_every_byte():
    params, grads = problem(torch.bfloat16, n_steps=1)
    opt = zero_offload(adamw(lr=0.1))
    state = opt.init(params)
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in state["master"].values())
    assert all(t.device.type == "cpu" for slot in ("mu", "nu") for t in state["inner"][slot].values())
    _, state = opt.update(grads[0], state, params)
    n = sum(p.numel() for p in params.values())
    m = state["metrics"]
    assert (m["d2h_bytes"], m["h2d_bytes"]) == (2 * n, 2 * n)  # bf16 grads down, bf16 weights up
    assert m["host_wait_s"] > 0.0


def test_inputs_are_never_written_and_outputs_never_alias_the_state():
    params, grads = problem(torch.float32, n_steps=1)
    before = ({k: v.clone() for k, v in params.items()}, {k: v.clone() for k, v in grads[0].items()})
    opt = zero_offload(sgd(lr=0.1))
    state = opt.init(params)
    new, state = opt.update(grads[0], state, params)
    assert all(torch.equal(params[k], before[0][k]) and torch.equal(grads[0][k], before[1][k]) for k in params)
    new["w"].add_(1.0)
    assert not torch.equal(state["master"]["w"], new["w"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.cuda
@pytest.mark.parametrize("donate", [False, True])
def test_cuda_params_give_the_cpu_run_bit_for_bit(donate):
    """Parameters on a GPU: the update runs on the host (pinned gradient copies down, parameters
    back up), so every step's parameters are the CPU run's, bit for bit, and stay on the GPU."""
    params, grads = problem(torch.float32)
    opt = zero_offload(INNERS[0])
    want, _ = run(opt, params, grads)
    state, p = opt.init(params), {k: v.cuda() for k, v in params.items()}
    update = opt.update_inplace if donate else opt.update
    for g, expected in zip(grads, want):
        p, state = update({k: v.cuda() for k, v in g.items()}, state, p)
        for k in p:
            assert p[k].device.type == "cuda" and torch.equal(p[k].cpu(), expected[k])
    assert all(m.device.type == "cpu" for m in state["master"].values())
