"""Properties of the layout algebra: shard/unshard are inverse, boxes tile the tensor, and a
single axis cuts like torch.chunk and DTensor's Shard."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fsdpx import Mesh, local_box, shard, unshard
from fsdpx.sharding.layout import chunk, chunk_bounds, chunks_nest, padded_local_shape
from fsdpx.sharding.spec import Spec

from support.layout_gen import meshes, shapes, specs, torch_chunk_padded



@st.composite
def layouts(draw, partial=True):
    mesh = draw(meshes())
    ndim = draw(st.integers(0, 3))
    return mesh, draw(specs(mesh, ndim, partial)), draw(shapes(ndim))


def distinct_global(shape) -> torch.Tensor:
    return torch.arange(1, math.prod(shape) + 1, dtype=torch.float64).reshape(shape)


@given(layouts())
def test_unshard_inverts_shard_for_any_spec_and_mesh(layout):
    mesh, spec, shape = layout
    t = distinct_global(shape)
    locals_ = shard(t, spec, mesh)
    assert len(locals_) == mesh.size
    back = unshard(locals_, spec, mesh)
    assert back.shape == t.shape and torch.equal(back, t)


@given(layouts())
def test_local_boxes_tile_the_tensor_exactly(layout):
    mesh, spec, shape = layout
    locals_ = shard(distinct_global(shape), spec, mesh)
    cover = torch.zeros(shape, dtype=torch.int64)
    box_of_key = {}
    for r in range(mesh.size):
        box = local_box(shape, spec, mesh, r)
        assert tuple(locals_[r].shape) == tuple(e - s for s, e in box)
        assert all(0 <= s <= e <= n for (s, e), n in zip(box, shape))
        key = tuple(mesh.index(r, spec.axes(d)) for d in range(len(shape)))
        assert box_of_key.setdefault(key, box) == box  # replicas and partial peers share a box
        assert all(e - s <= p for (s, e), p in zip(box, padded_local_shape(shape, spec, mesh)))
    for box in box_of_key.values():
        view = cover
        for d, (s, e) in enumerate(box):
            view = view.narrow(d, s, e - s)
        view += 1
    assert torch.all(cover == 1)  # disjoint and covering
    assert len(box_of_key) == math.prod(mesh.axis_size(spec.axes(d)) for d in range(len(shape)))
    assert tuple(locals_[0].shape) == padded_local_shape(shape, spec, mesh)


@given(k=st.integers(1, 8), shape=st.lists(st.integers(0, 9), min_size=1, max_size=3), data=st.data())
def test_one_axis_shards_match_torch_chunk_and_dtensor_split(k, shape, data):
    from torch.distributed.tensor.placement_types import Shard

    dim = data.draw(st.integers(0, len(shape) - 1))
    mesh = Mesh(x=k)
    t = distinct_global(tuple(shape))
    entries = [None] * len(shape)
    entries[dim] = "x"
    ours = shard(t, Spec(*entries), mesh)
    reference = torch_chunk_padded(t, k, dim)
    dtensor, _ = Shard(dim)._split_tensor(t, k, with_padding=False, contiguous=False)
    assert len(ours) == len(reference) == len(dtensor) == k
    for a, b, c, d in zip(ours, reference, dtensor, chunk(t, k, dim)):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)


@given(n=st.integers(0, 30), outer=st.integers(1, 6), inner=st.integers(1, 6))
def test_chunks_nest_exactly_when_nested_cuts_equal_flat_cuts(n, outer, inner):
    t = torch.arange(n)
    nested = [piece for part in chunk(t, outer, 0) for piece in chunk(part, inner, 0)]
    flat = chunk(t, outer * inner, 0)
    same = all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(nested, flat))
    assert chunks_nest(n, outer, inner) == same
    if n % (outer * inner) == 0 or outer == 1 or inner == 1:
        assert same


def test_chunk_bounds_rejects_undefined_chunks():
    assert chunk_bounds(5, 4, 3) == (5, 5)
    with pytest.raises(ValueError, match="chunk 4 of 4"):
        chunk_bounds(5, 4, 4)


def test_unshard_refuses_disagreeing_replicas_and_wrong_shapes():
    mesh = Mesh(dp=2)
    with pytest.raises(ValueError, match="rank 1 differs from rank 0"):
        unshard([torch.zeros(2), torch.ones(2)], Spec(None), mesh)
    assert unshard([torch.zeros(2), torch.ones(2)], Spec(None), mesh, check_replicas=False).tolist() == [0, 0]
    # 1 + 3 rows imply 4 rows, cut 2 + 2
    with pytest.raises(ValueError, match="rank 0 holds shape \\(1,\\)"):
        unshard([torch.zeros(1), torch.zeros(3)], Spec("dp"), mesh)
    with pytest.raises(ValueError, match="rank 1 holds shape \\(2, 4\\)"):
        unshard([torch.zeros(2, 3), torch.zeros(2, 4)], Spec("dp", None), mesh)
    with pytest.raises(ValueError, match="one local tensor per rank .* got 3"):
        unshard([torch.zeros(2)] * 3, Spec("dp"), mesh)
    # partial: the sum, starting from the value on rank 0
    assert unshard([torch.ones(2), torch.ones(2)], Spec(None, partial="dp"), mesh).tolist() == [2, 2]
