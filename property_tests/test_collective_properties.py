"""Properties of plans and collectives, checked by running them on a SimulatedMesh: the global
value survives, bytes counted equal bytes costed, and adjoints are transposes."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fsdpx import Collective, SimulatedMesh, Spec, adjoint, cost, plan, shard, unshard
from fsdpx.sharding.collectives import KINDS

from support.layout_gen import arbitrary_locals, consistent_locals, meshes, shapes, specs

F64 = torch.float64
# example counts come from the profile in conftest.py (ci: 40); per-kind tests split them
PER_KIND = settings(max_examples=max(20, settings.default.max_examples // 2), deadline=None)


@st.composite
def transitions(draw):
    """A random pair src != dst on a random mesh and shape, dst's partial axes a subset of src's."""
    mesh = draw(meshes())
    ndim = draw(st.integers(1, 3))  # 0-d layouts differ only in partial axes: unit-tested
    shape = draw(shapes(ndim))
    src = draw(specs(mesh, ndim))
    dst = draw(specs(mesh, ndim))
    dst = Spec(*dst.dims, partial=[a for a in dst.partial if a in src.partial])
    assume(dst != src)  # plan(s, s) == [] is checked on its own
    seed = draw(st.integers(0, 2**31))
    return mesh, src, dst, shape, torch.Generator().manual_seed(seed)


@st.composite
def collectives_of_kind(draw, kind: str):
    """A valid Collective of ``kind`` over 1-2 axes (any order), the rest of the layout random."""
    mesh = draw(meshes(max_axes=2, sizes=(2, 3, 4)))  # size-1 axes: covered by transitions()
    ndim = draw(st.integers(2 if kind == "all_to_all" else 1, 3))
    shape = draw(shapes(ndim, max_size=12))
    axes = mesh.axis_names[: draw(st.sampled_from([2, 1]))]
    if draw(st.booleans()):  # minor-to-major: groups not in rank order
        axes = axes[::-1]
    d1, d2 = draw(st.permutations(range(ndim)))[:2] if ndim > 1 else (0, None)
    base = draw(specs(mesh, ndim))
    # the collective's axes and dims start free: drop them from the random base layout
    dims = [tuple(a for a in base.axes(d) if a not in axes) if d not in (d1, d2) else () for d in range(ndim)]
    base = Spec(*dims, partial=[a for a in base.partial if a not in axes])
    partial = base.partial + axes
    src, cdims = {
        "all_gather": (base.with_dim(d1, axes), (d1,)),
        "reduce_scatter": (base.with_partial(partial), (d1,)),
        "all_reduce": (base.with_partial(partial), ()),
        "all_to_all": (base.with_dim(d1, axes), (d1, d2)),
        "local_slice": (base, (d1,)),
        "local_pad": (base.with_dim(d1, axes), (d1,)),
    }[kind]
    return Collective(kind, axes, cdims, src, shape, mesh, F64), torch.Generator().manual_seed(draw(st.integers(0, 2**31)))


def pairing(xs, ys) -> torch.Tensor:
    """<x, y> = sum over ranks of the dot product of the local blocks (replicas all counted)."""
    return sum((torch.dot(x.flatten(), y.flatten()) for x, y in zip(xs, ys)), torch.zeros((), dtype=F64))


@given(transitions())
def test_plan_chains_from_src_to_dst(case):
    mesh, src, dst, shape, _ = case
    p = plan(src, dst, shape, mesh)
    layouts = [src] + [c.dst for c in p]
    assert [c.src for c in p] == layouts[:-1]
    assert layouts[-1] == dst
    assert plan(src, src, shape, mesh) == [] and plan(dst, dst, shape, mesh) == []


@given(transitions())
def test_executing_a_plan_preserves_the_global_value(case):
    mesh, src, dst, shape, gen = case
    t = torch.randn(shape, generator=gen, dtype=F64)
    out = SimulatedMesh(mesh).run(plan(src, dst, shape, mesh, F64), consistent_locals(t, src, mesh, gen))
    torch.testing.assert_close(unshard(out, dst, mesh), t, rtol=0, atol=1e-10)


@given(transitions())
def test_counted_bytes_equal_cost_of_plan(case):
    mesh, src, dst, shape, _ = case
    for dtype in (torch.float32, torch.bfloat16):
        p = plan(src, dst, shape, mesh, dtype)
        sim = SimulatedMesh(mesh)
        sim.run(p, shard(torch.zeros(shape, dtype=dtype), src, mesh))
        assert sim.counts == cost(p)


def check_adjoint(c: Collective, gen: torch.Generator) -> None:
    sim = SimulatedMesh(c.mesh)
    a = adjoint(c)
    assert (a.src, a.dst) == (c.dst.dual(c.mesh), c.src.dual(c.mesh))
    x = arbitrary_locals(c.shape, c.src, c.mesh, gen)
    y = arbitrary_locals(c.shape, a.src, c.mesh, gen)
    lhs, rhs = pairing(sim.run(c, x), y), pairing(x, sim.run(a, y))
    torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=1e-12 * (1 + lhs.abs().item()))


@pytest.mark.parametrize("kind", KINDS)
@PER_KIND
@given(data=st.data())
def test_adjoint_satisfies_inner_product_identity(kind, data):
    c, gen = data.draw(collectives_of_kind(kind))
    check_adjoint(c, gen)
    assert adjoint(adjoint(c)) == c


@pytest.mark.parametrize("kind", KINDS)
@PER_KIND
@given(data=st.data())
def test_every_collective_kind_preserves_the_global_value(kind, data):
    c, gen = data.draw(collectives_of_kind(kind))
    t = torch.randn(c.shape, generator=gen, dtype=F64)
    out = SimulatedMesh(c.mesh).run(c, consistent_locals(t, c.src, c.mesh, gen))
    torch.testing.assert_close(unshard(out, c.dst, c.mesh), t, rtol=0, atol=1e-10)


@given(transitions())
def test_adjoint_of_every_planned_collective_is_its_transpose(case):
    mesh, src, dst, shape, gen = case
    for c in plan(src, dst, shape, mesh, F64):
        check_adjoint(c, gen)


@given(transitions())
def test_rank_pairing_equals_global_pairing_of_dual_layouts(case):
    """For x laid out as S and y as S.dual, sum_r <x_r, y_r> == <global x, global y>: the
    pairing under which adjoint() is the transpose is the one on global values."""
    mesh, src, _, shape, gen = case
    dual = src.dual(mesh)
    t, u = torch.randn(shape, generator=gen, dtype=F64), torch.randn(shape, generator=gen, dtype=F64)
    got = pairing(consistent_locals(t, src, mesh, gen), consistent_locals(u, dual, mesh, gen))
    torch.testing.assert_close(got, torch.dot(t.flatten(), u.flatten()), rtol=1e-12, atol=1e-10)
