"""Box arithmetic and byte-range reads (``ckpt.boxes``, ``ckpt.reader``)."""

import random

import pytest
import torch

from ckpt.boxes import global_shape, intersect, is_writer, runs
from ckpt.errors import LayoutError
from fsdpx import Mesh, Spec
from fsdpx.sharding.layout import local_box


def _random_box(rng, shape):
    out = []
    for n in shape:
        a, b = sorted(rng.randint(0, n) for _ in range(2))
        out.append((a, b))
    return tuple(out)


def test_runs_read_exactly_the_intersection():
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 4)))
        stored, want = _random_box(rng, shape), _random_box(rng, shape)
        inter = intersect(stored, want)
        if inter is None:
            continue
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.int32).reshape(shape)
        block = full[tuple(slice(s, e) for s, e in stored)].contiguous().reshape(-1)
        offsets, length = runs(stored, inter, 4)
        got = torch.cat([block[o // 4:(o + length) // 4] for o in offsets.tolist()])
        expect = full[tuple(slice(s, e) for s, e in inter)].reshape(-1)
        assert torch.equal(got, expect), (shape, stored, want)


def test_sharding_on_dim_0_is_one_run():
    offsets, length = runs(((0, 8), (0, 4)), ((2, 5), (0, 4)), 4)
    assert offsets.tolist() == [2 * 4 * 4] and length == 3 * 4 * 4


@pytest.mark.parametrize("mesh", [Mesh(dp=3), Mesh(a=2, b=2), Mesh(a=1, b=3)])
def test_each_box_written_once(mesh):
    for spec in [Spec(None, None), Spec(mesh.axis_names[0], None), Spec(None, mesh.axis_names[-1]),
                 Spec(mesh.axis_names, None)]:
        shape = (5, 3)
        writers = [r for r in range(mesh.size) if is_writer(spec, mesh, r)]
        boxes = [local_box(shape, spec, mesh, r) for r in writers]
        assert len(set(boxes)) == len(boxes)  # no box twice
        all_boxes = {local_box(shape, spec, mesh, r) for r in range(mesh.size)}
        assert set(boxes) == all_boxes  # every box by someone
        for r in writers:  # the lowest rank holding it
            assert all(local_box(shape, spec, mesh, q) != local_box(shape, spec, mesh, r) for q in range(r))


def test_partial_specs_are_refused():
    with pytest.raises(LayoutError, match="partial"):
        is_writer(Spec(None, partial=("dp",)), Mesh(dp=2), 0)


def test_global_shape_inverts_local_box_and_names_inconsistent_ranks():
    mesh, spec = Mesh(dp=4), Spec("dp", None)
    locals_ = [local_box((5, 2), spec, mesh, r) for r in range(4)]
    assert global_shape("w", [[e - s for s, e in b] for b in locals_], spec, mesh) == (5, 2)
    with pytest.raises(LayoutError, match="w: rank 2 holds shape"):
        global_shape("w", [[2, 2], [2, 2], [1, 2], [1, 2]], spec, mesh)
