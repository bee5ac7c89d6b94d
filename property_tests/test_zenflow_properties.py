"""Invariants of ZenFlow (offload.zenflow): exact against plain training, deterministic, and equal
to a column-by-column sequential reference of its documented semantics. Float64 throughout:
every equality here is bit for bit."""

from __future__ import annotations

import functools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import offload
from fsdpx.optim import adamw, sgd
from offload.columns import column_scores, select_columns

F64 = torch.float64
INNERS = {
    "adamw": adamw(lr=0.1, weight_decay=0.01),
    "sgd_momentum": sgd(lr=0.1, momentum=0.9),
    "sgd": sgd(lr=0.1),
}
few = settings(max_examples=25, deadline=None)


# --- helpers ---------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    fresh = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)  # standard strides
    return fresh.reshape(-1).view(torch.uint8)


def assert_same_bits(a, b, path="state"):
    """Nested dicts/lists/tensors/numbers equal bit for bit (the clock readings excepted)."""
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, path
        assert torch.equal(bits(a), bits(b)), f"{path} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: keys {a.keys()} vs {b.keys()}"
        for k in a:
            if k not in ("host_wait_s", "host_loop_s"):  # clock readings
                assert_same_bits(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_bits(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a} vs {b}"


@st.composite
def problems(draw, *, steps=(1, 10)):
    """Parameters (two 2-D weights and a bias) and a sequence of gradients whose column scales
    vary from step to step, so selections change."""
    seed = draw(st.integers(0, 2**31 - 1))
    out, n_in, n_in2 = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 4))
    n_steps = draw(st.integers(*steps))
    gen = torch.Generator().manual_seed(seed)
    params = {
        "w": torch.randn(out, n_in, dtype=F64, generator=gen),
        "v": torch.randn(n_in2, out, dtype=F64, generator=gen),
        "b": torch.randn(out, dtype=F64, generator=gen),
    }
    grads = []
    for _ in range(n_steps):
        g = {}
        for k, p in params.items():
            scale = torch.rand(p.shape[-1], dtype=F64, generator=gen) * 3 if p.dim() == 2 else 1.0
            g[k] = torch.randn(p.shape, dtype=F64, generator=gen) * scale
        grads.append(g)
    return params, grads


def run(opt, params, grads):
    """Parameters after every step, and the final state."""
    state, p, history = opt.init(params), params, []
    for g in grads:
        p, state = opt.update(g, state, p)
        history.append(p)
    return history, state


def run_inner_every(inner, params, grads, k, *, mean=True):
    """``inner`` applied at the end of every k steps to the window's mean gradient."""
    state, p, history, acc = inner.init(params), params, [], None
    for t, g in enumerate(grads, 1):
        acc = dict(g) if acc is None else {n: acc[n] + g[n] for n in g}
        if t % k == 0:
            p, state = inner.update({n: a / k if mean else a for n, a in acc.items()}, state, p)
            acc = None
        history.append(p)
    return history


def reference(inner, params, grads, *, ratio, update_interval, select_interval, delay, reduce):
    """ZenFlow's semantics, column by column, in plain sequential order (fixed intervals)."""
    slot_names = [s for s in inner.init({}) if s != "count"]

    def step(master, g, slots, count):
        sub = {"count": count, **{s: ({"x": slots[s]} if s in slots else {}) for s in slot_names}}
        p, new = inner.update({"x": g}, sub, {"x": master})
        return p["x"], {s: new[s]["x"] for s in slots}

    mats = [k for k, p in params.items() if p.dim() == 2]
    vec_params = {k: p for k, p in params.items() if k not in mats}
    vec_state = inner.init(vec_params)
    init_slots = inner.init({k: params[k] for k in mats})
    cols = {  # one record per column: master, slots, count
        k: [{"master": params[k][:, c].clone(),
             "slots": {s: init_slots[s][k][:, c].clone() for s in slot_names if k in init_slots[s]},
             "count": 0} for c in range(params[k].shape[1])]
        for k in mats
    }
    visible = {k: p.clone() for k, p in params.items()}
    sel = {k: set(select_columns(column_scores(grads[0][k]), ratio).tolist()) for k in mats}
    acc = {k: {} for k in mats}
    shown_next_window = {}
    history, window_steps = [], 0
    for t, g in enumerate(grads, 1):
        if vec_params:
            vec_params, vec_state = inner.update({k: g[k] for k in vec_params}, vec_state, vec_params)
            visible.update({k: v.clone() for k, v in vec_params.items()})
        for k in mats:
            for c, rec in enumerate(cols[k]):
                gc = g[k][:, c]
                if c in sel[k]:
                    rec["master"], rec["slots"] = step(rec["master"], gc, rec["slots"], rec["count"])
                    rec["count"] += 1
                    visible[k][:, c] = rec["master"]
                else:
                    acc[k][c] = gc.clone() if c not in acc[k] else acc[k][c] + gc
        window_steps += 1
        if window_steps == update_interval:
            for (k, c), value in shown_next_window.items():
                visible[k][:, c] = value
            shown_next_window = {}
            new_sel = sel
            if t % select_interval == 0:
                new_sel = {k: set(select_columns(column_scores(g[k]), ratio).tolist()) for k in mats}
            for k in mats:
                for c, a in acc[k].items():
                    rec = cols[k][c]
                    mean = a / window_steps if reduce == "mean" and window_steps != 1 else a
                    rec["master"], rec["slots"] = step(rec["master"], mean, rec["slots"], rec["count"])
                    rec["count"] += 1
                    if delay == 0 or c in new_sel[k]:
                        visible[k][:, c] = rec["master"]
                    else:
                        shown_next_window[(k, c)] = rec["master"].clone()
                acc[k] = {}
            sel, window_steps = new_sel, 0
        history.append({k: v.clone() for k, v in visible.items()})
    masters = {k: torch.stack([rec["master"] for rec in cols[k]], 1) for k in mats}
    masters.update(vec_params)
    return history, masters, cols


# --- 1. exact against plain training (delay=0) -------------------------------------------------


@few
@given(problems(), st.sampled_from(sorted(INNERS)), st.integers(1, 3), st.integers(1, 3), st.sampled_from([0, 1]))
def test_full_ratio_equals_inner_bit_for_bit(problem, inner_name, u, m, delay):
    params, grads = problem
    inner = INNERS[inner_name]
    opt = offload.zenflow(inner, topk_ratio=1.0, update_interval=u, select_interval=u * m, delay=delay)
    got, state = run(opt, params, grads)
    want, _ = run(inner, params, grads)
    assert_same_bits(got, want, "params")
    assert state["metrics"]["d2h_bytes"] == 0  # nothing left for the host


@few
@given(problems(), st.sampled_from(sorted(INNERS)), st.floats(0.0, 1.0), st.integers(1, 4), st.booleans())
def test_update_interval_one_equals_inner_bit_for_bit_for_any_ratio(problem, inner_name, ratio, m, overlap):
    params, grads = problem
    inner = INNERS[inner_name]
    opt = offload.zenflow(inner, topk_ratio=ratio, update_interval=1, select_interval=m, delay=0, overlap=overlap)
    got, _ = run(opt, params, grads)
    want, _ = run(inner, params, grads)
    assert_same_bits(got, want, "params")


@few
@given(problems(), st.sampled_from(sorted(INNERS)), st.integers(1, 4), st.sampled_from(["mean", "sum"]))
def test_zero_ratio_equals_inner_every_k_steps_on_the_window_gradient(problem, inner_name, k, reduce):
    params, grads = problem
    params = {n: p for n, p in params.items() if p.dim() == 2}  # non-2-D parameters never wait
    grads = [{n: g[n] for n in params} for g in grads]
    inner = INNERS[inner_name]
    opt = offload.zenflow(inner, topk_ratio=0.0, update_interval=k, select_interval=k, delay=0, reduce=reduce)
    got, _ = run(opt, params, grads)
    want = run_inner_every(inner, params, grads, k, mean=reduce == "mean")
    assert_same_bits(got, want, "params")


@few
@given(problems(steps=(1, 12)), st.integers(1, 3))
def test_delay_one_shows_each_host_window_one_window_later(problem, k):
    params, grads = problem
    params = {n: p for n, p in params.items() if p.dim() == 2}
    grads = [{n: g[n] for n in params} for g in grads]
    inner = INNERS["adamw"]
    run_delay = {d: run(offload.zenflow(inner, topk_ratio=0.0, update_interval=k, select_interval=k, delay=d),
                        params, grads) for d in (0, 1)}
    (p0, s0), (p1, s1) = run_delay[0], run_delay[1]
    for t in range(len(grads)):  # after step t+1
        assert_same_bits(p1[t], p0[t - k] if t >= k else params, f"params after step {t + 1}")
    assert_same_bits(offload.master_params(s1), offload.master_params(s0), "master")  # same chain


# --- the whole semantics, column by column ---------------------------------------------------


@few
@given(problems(steps=(6, 12)), st.sampled_from(sorted(INNERS)), st.sampled_from([0.0, 0.2, 0.34, 0.5, 0.75, 1.0]),
       st.integers(1, 3), st.integers(1, 3), st.sampled_from([0, 1]), st.sampled_from(["mean", "sum"]), st.booleans())
def test_matches_sequential_reference(problem, inner_name, ratio, u, m, delay, reduce, overlap):
    params, grads = problem
    inner = INNERS[inner_name]
    kw = dict(ratio=ratio, update_interval=u, select_interval=u * m, delay=delay, reduce=reduce)
    opt = offload.zenflow(inner, topk_ratio=ratio, update_interval=u, select_interval=u * m, delay=delay,
                          reduce=reduce, overlap=overlap)
    got, state = run(opt, params, grads)
    want, masters, cols = reference(inner, params, grads, **kw)
    assert_same_bits(got, want, "params")
    assert_same_bits(offload.master_params(state), masters, "master")
    merged = offload.element_state(state)
    for k, records in cols.items():
        assert merged[k]["count"].tolist() == [r["count"] for r in records]


# --- 2. overlap never changes a bit ----------------------------------------------------------


@few
@given(problems(steps=(1, 12)), st.sampled_from([0, 1]), st.sampled_from([(2, 4), (1, 3), ("auto", 4), (2, "auto")]),
       st.sampled_from([0.2, 0.5]))
def test_overlap_never_changes_a_bit_over_repeated_runs(problem, delay, intervals, ratio):
    params, grads = problem
    u, s = intervals
    make = functools.partial(offload.zenflow, INNERS["adamw"], topk_ratio=ratio, update_interval=u,
                             select_interval=s, delay=delay, auto=offload.AutoConfig(max_interval=3))
    runs = [run(make(overlap=o), params, grads) for o in (True, False, True)]
    for history, state in runs[1:]:
        assert_same_bits(history, runs[0][0], "params")
        assert_same_bits(offload.materialize(state), offload.materialize(runs[0][1]))


# --- 3. selection is world-size invariant ----------------------------------------------------


@few
@given(st.integers(0, 2**31 - 1), st.integers(1, 9), st.integers(1, 12), st.integers(-20, 20), st.floats(0.0, 1.0))
def test_column_scores_are_world_size_invariant(seed, out, n_in, exponent, ratio):
    # Integer-valued gradients times a power of two: squares and sums are exact, so the rank order
    # of the sum cannot matter and every tie is a true tie.
    gen = torch.Generator().manual_seed(seed)
    g = torch.randint(-3, 4, (out, n_in), generator=gen).to(torch.float32) * 2.0**exponent
    full = column_scores(g)
    for world in (1, 2, 3):
        parts = [column_scores(shard) for shard in torch.tensor_split(g, world, dim=0)]  # row shards
        summed = functools.reduce(torch.add, parts)  # in rank order
        assert torch.equal(bits(summed), bits(full))
        assert torch.equal(select_columns(summed, ratio), select_columns(full, ratio))


# --- 4. wrapping leaves the weights alone ----------------------------------------------------


@few
@given(st.integers(0, 2**31 - 1), st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]),
       st.booleans())
def test_wrapping_leaves_weights_unchanged(seed, dtype, transposed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(5, 3, generator=gen).to(dtype)
    params = {"w": w.t() if transposed else w, "b": torch.randn(3, generator=gen).to(dtype),
              "conv": torch.randn(2, 1, 3, 3, generator=gen).to(dtype)}
    before = {k: v.clone() for k, v in params.items()}
    opt = offload.zenflow(adamw(lr=0.0, weight_decay=0.0), topk_ratio=0.4, update_interval=1, select_interval=1)
    state = opt.init(params)
    masters = offload.master_params(state)
    for k, p in params.items():
        assert torch.equal(bits(params[k]), bits(before[k]))  # init did not write them
        assert masters[k].shape == p.shape and torch.equal(masters[k].to(p.dtype), p)
    zero = {k: torch.randn(p.shape, generator=gen).to(dtype) for k, p in params.items()}
    new, state = opt.update(zero, state, params)  # lr = 0: a step that moves nothing
    for k, p in params.items():
        assert torch.equal(bits(new[k]), bits(p.contiguous()))


# --- 5. moments are handed over, never reset -------------------------------------------------


def test_a_column_leaving_and_reentering_the_selection_keeps_its_moments():
    """Column 0 is on the device in windows 1-2, on the host in window 3, on the device again in
    window 4 (update_interval = select_interval = 2, one column selected)."""
    inner = INNERS["adamw"]
    params = {"w": torch.tensor([[1.0, -1.0, 0.5]], dtype=F64)}
    large = [[5.0, 0.1, 0.2], [0.1, 5.0, 0.2], [5.0, 0.2, 0.1], [5.0, 0.1, 0.1]]  # per window
    grads = [{"w": torch.tensor([large[t // 2]], dtype=F64) * (1 + 0.1 * t)} for t in range(8)]
    g0 = [g["w"][:, 0] for g in grads]
    zeros = torch.zeros(1, dtype=F64)
    # column 0: device steps 1-4, one host window (mean of steps 5-6), device steps 7-8
    m, mu, nu = params["w"][:, 0], zeros, zeros
    for count, g in enumerate([g0[0], g0[1], g0[2], g0[3], (g0[4] + g0[5]) / 2, g0[6], g0[7]], 1):
        m, mu, nu = adamw_step(m, g, mu, nu, count)
        if count == 5:
            m_reset, mu_reset, nu_reset = m, zeros, zeros  # what resetting at re-entry would start from
    for count, g in enumerate([g0[6], g0[7]], 1):
        m_reset, mu_reset, nu_reset = adamw_step(m_reset, g, mu_reset, nu_reset, count)
    for delay in (0, 1):
        opt = offload.zenflow(inner, topk_ratio=0.34, update_interval=2, select_interval=2, delay=delay)
        state, p, seen = opt.init(params), params, []
        for g in grads:
            p, state = opt.update(g, state, p)
            seen.append(state["selected"]["w"].tolist())
        assert seen == [[0], [0], [0], [1], [1], [0], [0], [0]]  # leaves after step 4, back after step 6
        e = offload.element_state(state)["w"]
        assert e["count"].tolist()[0] == 7
        for field, want in (("master", m), ("mu", mu), ("nu", nu)):
            assert torch.equal(bits(e[field][:, 0]), bits(want)), field
        assert torch.equal(bits(p["w"][:, 0]), bits(m))  # the device shows it: it is selected
        assert not torch.equal(e["mu"][:, 0], mu_reset) and not torch.equal(e["master"][:, 0], m_reset)


def adamw_step(p, g, m, v, count):
    from fsdpx.optim import adamw_kernel

    return adamw_kernel(p, g, m, v, count, lr=0.1, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
