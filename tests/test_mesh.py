"""Mesh: row-major ranks, rank groups along axes, value semantics, bad input."""

import pytest

from fsdpx import Mesh


def test_rank_of_inverts_coords_row_major():
    m = Mesh(replica=2, shard=3)
    assert m.size == 6 and m.axis_names == ("replica", "shard")
    assert [m.coords(r) for r in range(3)] == [{"replica": 0, "shard": s} for s in range(3)]
    assert m.coords(4) == {"replica": 1, "shard": 1}
    for r in range(m.size):
        assert m.rank_of(m.coords(r)) == r


def test_groups_partition_ranks_in_combined_index_order():
    m = Mesh(replica=2, shard=2)
    assert m.groups("shard") == [[0, 1], [2, 3]]
    assert m.groups("replica") == [[0, 2], [1, 3]]
    assert m.groups(("replica", "shard")) == [[0, 1, 2, 3]]
    # major-to-minor as given: shard major here
    assert m.groups(("shard", "replica")) == [[0, 2, 1, 3]]
    assert m.groups(()) == [[0], [1], [2], [3]]
    big = Mesh(a=2, b=3, c=2)
    for axes in ["a", "b", "c", ("a", "c"), ("c", "a"), ("b", "a", "c")]:
        groups = big.groups(axes)
        assert sorted(r for g in groups for r in g) == list(range(big.size))
        for g in groups:
            assert [big.index(r, axes) for r in g] == list(range(len(g)))


def test_index_is_combined_major_to_minor():
    m = Mesh(a=2, b=3)
    r = m.rank_of({"a": 1, "b": 2})
    assert m.index(r, ("a", "b")) == 1 * 3 + 2
    assert m.index(r, ("b", "a")) == 2 * 2 + 1
    assert m.index(r, ()) == 0
    assert m.axis_size(("a", "b")) == 6 and m.axis_size(()) == 1


def test_mesh_is_an_immutable_hashable_value_whose_axis_order_matters():
    assert Mesh(dp=4) == Mesh(dp=4) and hash(Mesh(dp=4)) == hash(Mesh(dp=4))
    assert Mesh(a=2, b=2) != Mesh(b=2, a=2)
    assert repr(Mesh(replica=2, shard=2)) == "Mesh(replica=2, shard=2)"
    assert {Mesh(dp=2): 1}[Mesh(dp=2)] == 1
    with pytest.raises(AttributeError):
        Mesh(dp=2).x = 1
    assert Mesh().size == 1 and Mesh().coords(0) == {} and Mesh().groups(()) == [[0]]


@pytest.mark.parametrize("size", [0, -1, 2.5, True, "2"])
def test_mesh_rejects_non_positive_int_sizes(size):
    with pytest.raises(ValueError, match="'dp'"):
        Mesh(dp=size)


def test_mesh_errors_name_the_bad_rank_axis_or_coordinate():
    m = Mesh(dp=4)
    with pytest.raises(ValueError, match="rank 4 out of range.*size 4"):
        m.coords(4)
    with pytest.raises(ValueError, match="rank -1"):
        m.coords(-1)
    with pytest.raises(ValueError, match="unknown mesh axis 'tp'"):
        m.groups("tp")
    with pytest.raises(ValueError, match="'dp' listed twice"):
        m.groups(("dp", "dp"))
    with pytest.raises(ValueError, match="must name exactly the axes"):
        m.rank_of({"tp": 0})
    with pytest.raises(ValueError, match="dp=4 out of range"):
        m.rank_of({"dp": 4})
