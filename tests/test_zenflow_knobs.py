"""ZenFlow's DeepSpeed knobs (issue 31): ``full_warm_up_rounds`` in ``offload.zenflow`` and the
reselection schedule of ``offload.schedule`` (``select_strategy`` step / epoch / auto)."""

from __future__ import annotations

import pytest
import torch

import offload
from fsdpx.optim import adamw
from offload.columns import column_scores, select_columns
from offload.schedule import select_interval_steps, steps_per_epoch
from support.threads import one_thread  # noqa: F401 - autouse fixture

F64 = torch.float64
INNER = adamw(lr=0.1, weight_decay=0.01)


def _problem(dtype: torch.dtype, steps: int, seed: int = 11) -> tuple[dict, list[dict]]:
    """Two 2-D weights and a bias; gradient scales vary per column and step (selections change)."""
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(4, 9, dtype=dtype, generator=gen), "v": torch.randn(9, 3, dtype=dtype, generator=gen),
              "b": torch.randn(4, dtype=dtype, generator=gen)}
    grads = [{k: torch.randn(v.shape, dtype=dtype, generator=gen)
              * (1 + torch.rand(v.shape[-1], dtype=dtype, generator=gen) * (1 + t % 3)) for k, v in params.items()}
             for t in range(steps)]
    return params, grads


def _run(opt, params: dict, grads: list[dict], *, donate: bool = False) -> tuple[list[dict], dict]:
    state = opt.init(params)
    p = {k: v.clone() for k, v in params.items()} if donate else params
    history = []
    for g in grads:
        p, state = (opt.update_inplace if donate else opt.update)(g, state, p)
        history.append({k: v.clone() for k, v in p.items()})
    return history, state


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


# --- full_warm_up_rounds ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("donate", [False, True])
def test_warm_up_rounds_equal_plain_adamw_bit_for_bit(dtype, donate):
    """The first N steps are AdamW's: the parameters after each, and every element's master,
    moments and count after the last, bit for bit."""
    params, grads = _problem(dtype, 5)
    opt = offload.zenflow(INNER, topk_ratio=0.3, update_interval=2, select_interval=4, full_warm_up_rounds=5)
    got, state = _run(opt, params, grads, donate=donate)
    want, inner_state = _run(INNER, params, grads)
    assert all(_equal(a, b) for a, b in zip(got, want))
    assert state["selected"] is None and state["window_steps"] == 0
    merged = offload.element_state(state)
    for k in params:
        assert torch.equal(merged[k]["master"], want[-1][k])
        assert all(torch.equal(merged[k][s], inner_state[s][k]) for s in ("mu", "nu"))
        count = merged[k]["count"]
        assert (count == 5).all() if isinstance(count, torch.Tensor) else count == 5


def test_after_warm_up_zenflow_starts_its_schedule_at_step_n_plus_1():
    """Warm-up 3, then ZenFlow: the first selection is made from step 4's gradient and
    reselections follow every ``select_interval`` steps counted from there."""
    params, grads = _problem(F64, 15)
    opt = offload.zenflow(INNER, topk_ratio=0.34, update_interval=2, select_interval=4, full_warm_up_rounds=3)
    state, p = opt.init(params), params
    for t, g in enumerate(grads, 1):
        p, state = opt.update(g, state, p)
        if t <= 3:
            assert state["selected"] is None, f"step {t}"
            continue
        if t == 4 or (t - 3) % 4 == 0:
            current = select_columns(column_scores(g["w"]), 0.34)
        assert state["selected"]["w"].tolist() == current.tolist(), f"after step {t}"


@pytest.mark.parametrize("delay", [0, 1])
def test_warm_up_then_zenflow_with_one_step_windows_is_adamw(delay):
    """ZenFlow with ``update_interval=1`` and ``delay=0`` is ``inner`` (its documented
    equality); with a warm-up in front the whole run still is, so the handover at step N+1
    keeps every count and moment. With ``delay=1`` the warm-up steps alone are."""
    params, grads = _problem(F64, 9)
    opt = offload.zenflow(INNER, topk_ratio=0.5, update_interval=1, select_interval=2, delay=delay,
                          full_warm_up_rounds=3)
    got, _ = _run(opt, params, grads)
    want, _ = _run(INNER, params, grads)
    checked = got if delay == 0 else got[:3]
    assert all(_equal(a, b) for a, b in zip(checked, want))
    if delay == 1:
        assert not _equal(got[-1], want[-1])


@pytest.mark.parametrize("update_interval", [3, "auto"])
def test_overlap_and_donation_give_the_same_bits_with_a_warm_up(update_interval):
    params, grads = _problem(torch.float32, 14)
    runs = []
    for overlap in (True, False):
        for donate in (False, True):
            opt = offload.zenflow(INNER, topk_ratio=0.3, update_interval=update_interval, select_interval=6
                                  if update_interval == 3 else 4, overlap=overlap, full_warm_up_rounds=4)
            history, state = _run(opt, params, grads, donate=donate)
            runs.append((history, offload.master_params(state)))
    for history, masters in runs[1:]:
        assert all(_equal(a, b) for a, b in zip(history, runs[0][0]))
        assert _equal(masters, runs[0][1])


def test_warm_up_moves_whole_weights_each_way():
    params, grads = _problem(torch.float32, 2)
    opt = offload.zenflow(INNER, topk_ratio=0.3, full_warm_up_rounds=2)
    state, p = opt.init(params), params
    p, state = opt.update(grads[0], state, p)
    two_d = sum(params[k].numel() * 4 for k in ("w", "v"))
    assert state["metrics"]["d2h_bytes"] == two_d and state["metrics"]["h2d_bytes"] == two_d


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_full_warm_up_rounds_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match="full_warm_up_rounds"):
        offload.zenflow(INNER, full_warm_up_rounds=bad)


def test_zero_warm_up_rounds_keep_todays_bits():
    params, grads = _problem(torch.float32, 10)
    a, _ = _run(offload.zenflow(INNER, topk_ratio=0.3, update_interval=2, select_interval=4), params, grads)
    b, _ = _run(offload.zenflow(INNER, topk_ratio=0.3, update_interval=2, select_interval=4, full_warm_up_rounds=0),
                params, grads)
    assert all(_equal(x, y) for x, y in zip(a, b))


# --- the reselection schedule ----------------------------------------------------------------


@pytest.mark.parametrize("rate, steps", [(0.25, 4), (1 / 3, 3), (0.3, 4), (1.0, 1), (16 / 20000, 1250), (0.999, 2)])
def test_steps_per_epoch_is_the_ceiling_of_the_inverse_rate(rate, steps):
    assert steps_per_epoch(rate) == steps


@pytest.mark.parametrize("rate", [0.0, -0.1, 1.5])
def test_steps_per_epoch_refuses_rates_outside_the_unit_interval(rate):
    with pytest.raises(ValueError):
        steps_per_epoch(rate)


@pytest.mark.parametrize("strategy, interval, update, epoch, want", [
    ("step", None, 4, 7, 100), ("step", None, 3, 7, 99), ("step", None, 200, 7, 200), ("step", None, "auto", 7, 100),
    ("step", 8, 4, 7, 8), ("step", "auto", 4, 7, "auto"), ("step", 5, "auto", 7, 5),
    ("epoch", None, 4, 8, 8), ("epoch", 2, 4, 8, 16), ("epoch", 1, 4, 7, 8), ("epoch", 3, "auto", 7, 21),
    ("auto", None, 2, 10, 10), ("auto", "auto", 4, 10, 12), ("auto", "auto", "auto", 10, 10),
])
def test_select_interval_steps_follows_its_table(strategy, interval, update, epoch, want):
    """The module docstring's table, row by row; every fixed-window result is a whole number of
    windows, so ``zenflow`` accepts it."""
    got = select_interval_steps(strategy, interval, update, epoch)
    assert got == want
    if isinstance(got, int) and isinstance(update, int):
        offload.zenflow(INNER, update_interval=update, select_interval=got)


@pytest.mark.parametrize("strategy, interval, update, epoch, match", [
    ("auto", 3, 4, 10, "unset or 'auto'"), ("epoch", "auto", 4, 10, "number of epochs"),
    ("step", 6, 4, 10, "multiple of update_interval"), ("steps", None, 4, 10, "select_strategy"),
    ("epoch", 1, 4, 0, "steps per epoch"), ("step", 0, 4, 10, ">= 1"),
])
def test_select_interval_steps_refuses_what_it_cannot_mean(strategy, interval, update, epoch, match):
    with pytest.raises(ValueError, match=match):
        select_interval_steps(strategy, interval, update, epoch)


@pytest.mark.parametrize("warm_up", [0, 4])
def test_select_strategy_epoch_reselects_at_epoch_boundaries(warm_up):
    """An epoch of 4 steps (sample rate 1/4), windows of 2, "epoch" every epoch, a warm-up of
    whole epochs: ZenFlow selects at its first step and reselects at the end of every step that
    ends an epoch, from that step's gradient, and at no other step."""
    epoch = steps_per_epoch(0.25)
    select = select_interval_steps("epoch", 1, 2, epoch)
    params, grads = _problem(F64, warm_up + 13, seed=5)
    opt = offload.zenflow(INNER, topk_ratio=0.34, update_interval=2, select_interval=select,
                          full_warm_up_rounds=warm_up)
    state, p, changes = opt.init(params), params, []
    for t, g in enumerate(grads, 1):
        before = None if state["selected"] is None else state["selected"]["w"].tolist()
        p, state = opt.update(g, state, p)
        if t <= warm_up:
            continue
        if t == warm_up + 1 or t % epoch == 0:
            current = select_columns(column_scores(g["w"]), 0.34).tolist()
        assert state["selected"]["w"].tolist() == current, f"after step {t}"
        if before is not None and before != current:
            changes.append(t)
    assert changes and all(t % epoch == 0 for t in changes)
