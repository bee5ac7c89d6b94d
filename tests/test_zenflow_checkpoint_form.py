"""ZenFlow's checkpoint form (``offload.checkpoint_form``) through a real checkpoint: a run saved
and restored mid-window continues bit for bit. The tp / pp runs through ``fsdpx train`` are
``tests/test_offload_model_parallel.py::test_zenflow_with_model_parallelism_resumes_bit_for_bit``."""

from __future__ import annotations

import pytest
import torch

import ckpt
import offload
from fsdpx import Mesh
from fsdpx.optim import adamw
from offload.checkpoint_form import from_checkpoint, is_checkpoint_form, to_checkpoint
from support.threads import one_thread  # noqa: F401


def _zenflow(**knobs):
    return offload.zenflow(adamw(1e-2), topk_ratio=0.25, update_interval=2, select_interval=4, **knobs)


def _grads(step: int, params: dict) -> dict:
    g = torch.Generator().manual_seed(step)
    grads = {k: torch.randn(p.shape, generator=g, dtype=p.dtype) for k, p in params.items()}
    if 3 <= step <= 5:  # "w" frozen mid-window: its window sum waits, a landed window goes stale
        del grads["w"]
    return grads


@pytest.mark.parametrize("knobs", [dict(delay=1, overlap=True), dict(delay=0, overlap=False),
                                   dict(delay=1, overlap=True, full_warm_up_rounds=2)],
                         ids=["delay1", "delay0", "warm_up"])
def test_a_run_saved_and_restored_mid_window_continues_bit_for_bit(tmp_path, one_thread, knobs):
    """Saved after steps 2, 3, 5 and 6 (inside windows, a host window in flight, a frozen
    weight's landed columns, before and after a reselection), loaded and restored into a fresh
    state's shapes: every later step's parameters equal the straight run's bit for bit."""
    torch.manual_seed(0)
    init = {"w": torch.randn(6, 8), "v": torch.randn(5, 8), "b": torch.randn(6)}
    opt = _zenflow(**knobs)

    def run(saves: set[int]) -> list[dict]:
        params, state, out = {k: t.clone() for k, t in init.items()}, opt.init(init), []
        for step in range(1, 9):
            params, state = opt.update(_grads(step, params), state, params)
            out.append({k: t.clone() for k, t in params.items()})
            if step in saves:
                saved = to_checkpoint(state, {})
                assert is_checkpoint_form(saved)
                where = tmp_path / f"{len(saves)}_{step}"
                ckpt.save(where, {"opt": saved}, mesh=Mesh(dp=1), strategy=None)
                loaded = ckpt.load(where, mesh=Mesh(dp=1), strategy=None)["opt"]
                state = from_checkpoint(loaded, opt.init(init))
        return out

    straight, resumed = run(set()), run({2, 3, 5, 6})
    for step, (a, b) in enumerate(zip(straight, resumed), 1):
        assert all(torch.equal(a[k], b[k]) for k in a), f"step {step}"
    assert not torch.equal(straight[-1]["w"], init["w"])


def test_restoring_into_a_model_without_the_weight_names_it(tmp_path):
    opt = _zenflow()
    init = {"w": torch.randn(4, 4)}
    params, state = opt.update({"w": torch.randn(4, 4)}, opt.init(init), init)
    saved = to_checkpoint(state, {})
    with pytest.raises(KeyError, match="'u'"):
        from_checkpoint(saved, opt.init({"u": torch.randn(4, 4)}))
