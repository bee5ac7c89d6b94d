"""Collectives: the planner's choice for each single-axis transition, byte counts worked out by
hand, validation of steps, adjoints, and the simulated executor's semantics."""

import pytest
import torch

from fsdpx import Collective, Mesh, SimulatedMesh, Spec, adjoint, cost, plan, shard, unshard

F32 = torch.float32
M2 = Mesh(dp=2)
HSDP = Mesh(replica=2, shard=2)


def kinds(p):
    return [(c.kind, c.axes, c.dims) for c in p]


def test_plan_between_equal_layouts_is_empty():
    for s in [Spec("dp", None), Spec(None, None), Spec(None, partial=("dp",)), Spec()]:
        assert plan(s, s, (4, 3)[: s.ndim], M2) == []
    assert cost([]) == {"send_bytes": 0, "recv_bytes": 0}


# [4, 3] fp32 on 2 ranks: 48 bytes in full, 24 per shard.
@pytest.mark.parametrize(
    "src, dst, expect, buffer, send",
    [
        (Spec("dp", None), Spec(None, None), [("all_gather", ("dp",), (0,))], 48, 24),
        (Spec(None, None, partial="dp"), Spec("dp", None), [("reduce_scatter", ("dp",), (0,))], 48, 24),
        (Spec(None, None, partial="dp"), Spec(None, None), [("all_reduce", ("dp",), ())], 48, 48),
        # the local [2, 3] block is split along dim 1 (3 -> chunks 2, 1) padded to [2, 4]: 32 bytes
        (Spec("dp", None), Spec(None, "dp"), [("all_to_all", ("dp",), (0, 1))], 32, 16),
        (Spec(None, None), Spec(None, "dp"), [("local_slice", ("dp",), (1,))], 0, 0),
    ],
)
def test_single_axis_transitions_use_one_collective_with_hand_counted_bytes(src, dst, expect, buffer, send):
    p = plan(src, dst, (4, 3), M2, dtype=F32)
    assert kinds(p) == expect
    (c,) = p
    assert (c.src, c.dst) == (src, dst)
    assert (c.buffer_bytes, c.send_bytes, c.recv_bytes) == (buffer, send, send)
    assert cost(p) == {c.kind: buffer, "send_bytes": send, "recv_bytes": send}


def test_hsdp_gradient_reduction_is_reduce_scatter_then_all_reduce_of_the_shard():
    p = plan(Spec(None, None, partial=("replica", "shard")), Spec("shard", None), (4, 3), HSDP, dtype=F32)
    assert kinds(p) == [("reduce_scatter", ("shard",), (0,)), ("all_reduce", ("replica",), ())]
    # RS: full 48-byte input; AR: the 24-byte shard, ring over 2 ranks sends 2*(1)*ceil(6/2)*4 = 24
    assert cost(p) == {"reduce_scatter": 48, "all_reduce": 24, "send_bytes": 24 + 24, "recv_bytes": 48}


def test_bytes_use_padded_chunks_for_uneven_dims_and_dtype_itemsize():
    # 5 rows over 4 ranks: chunks 2,2,1,0; padded block is 2 rows of 3 float64 = 48 bytes
    m = Mesh(dp=4)
    (ag,) = plan(Spec("dp", None), Spec(None, None), (5, 3), m, dtype=torch.float64)
    assert (ag.buffer_bytes, ag.send_bytes) == (4 * 48, 3 * 48)
    (rs,) = plan(Spec(None, None, partial="dp"), Spec("dp", None), (5, 3), m, dtype=torch.float64)
    assert (rs.buffer_bytes, rs.send_bytes) == (4 * 48, 3 * 48)
    (ar,) = plan(Spec(None, partial="dp"), Spec(None), (5,), m, dtype=torch.bfloat16)
    # 5 elements, ring chunks of ceil(5/4) = 2: sends 2*3*2 elements of 2 bytes
    assert (ar.buffer_bytes, ar.send_bytes) == (10, 24)


def test_uneven_chunks_that_do_not_nest_go_through_the_replicated_layout():
    # dim of 5 over (a, b) = 4 flat chunks 2,2,1,0; over a alone 3,2: gathering b alone is wrong
    m = Mesh(a=2, b=2)
    p = plan(Spec(("a", "b")), Spec("a"), (5,), m)
    assert kinds(p) == [("all_gather", ("a", "b"), (0,)), ("local_slice", ("a",), (0,))]
    # 8 rows nest, so the minor axis alone is gathered
    assert kinds(plan(Spec(("a", "b")), Spec("a"), (8,), m)) == [("all_gather", ("b",), (0,))]
    with pytest.raises(ValueError, match="does not match cutting it into 4"):
        Collective("all_gather", ("b",), (0,), Spec(("a", "b")), (5,), m)


def test_collective_rejects_invalid_steps_by_name():
    m = Mesh(a=2, b=2)
    with pytest.raises(ValueError, match="not the minor end of dim 0"):
        Collective("all_gather", ("a",), (0,), Spec(("a", "b")), (4,), m)
    with pytest.raises(ValueError, match="axis 'a' is not partial"):
        Collective("reduce_scatter", ("a",), (0,), Spec(None), (4,), m)
    with pytest.raises(ValueError, match="axis 'a' is not replicated"):
        Collective("local_slice", ("a",), (1,), Spec("a", None), (4, 4), m)
    with pytest.raises(ValueError, match="unknown collective kind 'gather'"):
        Collective("gather", ("a",), (0,), Spec(None), (4,), m)
    with pytest.raises(ValueError, match="unknown mesh axis 'tp'"):
        Collective("all_reduce", ("tp",), (), Spec(None), (4,), m)
    with pytest.raises(ValueError, match="two different dims"):
        Collective("all_to_all", ("a",), (0, 0), Spec("a"), (4,), m)
    with pytest.raises(ValueError, match=r"has 1 dims but shape \(4, 4\) has 2"):
        Collective("all_reduce", ("a",), (), Spec(None, partial="a"), (4, 4), m)


def test_plan_refuses_to_create_a_partial_axis_and_validates_both_specs():
    with pytest.raises(ValueError, match="axis 'dp' would become partial"):
        plan(Spec(None), Spec(None, partial="dp"), (4,), M2)
    with pytest.raises(ValueError, match="unknown mesh axis 'tp'"):
        plan(Spec("tp"), Spec(None), (4,), M2)
    with pytest.raises(ValueError, match=r"has 1 dims but shape \(4, 3\) has 2"):
        plan(Spec(None, None), Spec("dp"), (4, 3), M2)


def test_adjoint_pairs_gather_with_reduce_scatter_and_is_an_involution():
    (ag,) = plan(Spec("dp", None), Spec(None, None), (4, 3), M2)
    rs = adjoint(ag)
    assert (rs.kind, rs.src, rs.dst) == ("reduce_scatter", Spec(None, None, partial="dp"), Spec("dp", None))
    assert adjoint(rs) == ag
    (a2a,) = plan(Spec("dp", None), Spec(None, "dp"), (4, 3), M2)
    assert adjoint(a2a).dims == (1, 0) and adjoint(a2a).dst == Spec("dp", None)
    (sl,) = plan(Spec(None, None), Spec("dp", None), (4, 3), M2)
    assert adjoint(sl).kind == "local_pad" and adjoint(sl).dst == Spec(None, None, partial="dp")


# ---- the simulated mesh -----------------------------------------------------------------------


def test_simulated_primitives_on_hand_examples():
    sim = SimulatedMesh(HSDP)
    xs = [torch.tensor([float(r)]) for r in range(4)]
    assert [x.tolist() for x in sim.all_gather(xs, "shard", 0)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [x.tolist() for x in sim.all_gather(xs, ("shard", "replica"), 0)] == [[0, 2, 1, 3]] * 4
    assert [x.tolist() for x in sim.all_reduce(xs, "replica")] == [[2], [4], [2], [4]]
    ys = [torch.tensor([1.0, 2.0, 3.0]) * (r + 1) for r in range(4)]
    # shard group [0, 1]: sum [3, 6, 9] cut 2,1 ; group [2, 3]: [7, 14, 21]
    assert [y.tolist() for y in sim.reduce_scatter(ys, "shard", 0)] == [[3, 6], [9], [7, 14], [21]]
    # group (shard, replica) is ordered [0, 2, 1, 3]: sum [10, 20, 30] cut 1,1,1,0 in that order
    assert [y.tolist() for y in sim.reduce_scatter(ys, ("shard", "replica"), 0)] == [[10], [30], [20], []]
    assert [y.tolist() for y in sim.broadcast(ys, "replica", src=1)] == [[3, 6, 9], [4, 8, 12], [3, 6, 9], [4, 8, 12]]
    zs = [torch.arange(4.0).reshape(2, 2) + 10 * r for r in range(4)]
    out = sim.all_to_all(zs, "shard", split_dim=1, concat_dim=0)
    assert out[0].tolist() == [[0], [2], [10], [12]]
    assert out[1].tolist() == [[1], [3], [11], [13]]
    assert [t.tolist() for t in sim.local_slice(ys[:1] * 4, "shard", 0)] == [[1, 2], [3], [1, 2], [3]]
    padded = sim.local_pad([torch.tensor([1.0, 2.0]), torch.tensor([3.0])] * 2, "shard", 0, size=3)
    assert [t.tolist() for t in padded] == [[1, 2, 0], [0, 0, 3]] * 2


def test_simulated_reductions_sum_left_to_right_in_group_order():
    # (1e16 + 1) - 1e16 == 0 but 1e16 + (1 - 1e16) == 1 in float64: order is observable
    sim = SimulatedMesh(Mesh(dp=3))
    xs = [torch.tensor([1e16], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64), torch.tensor([-1e16], dtype=torch.float64)]
    assert [x.item() for x in sim.all_reduce(xs, "dp")] == [0.0, 0.0, 0.0]
    assert sim.reduce_scatter(xs, "dp", 0)[0].item() == 0.0
    assert unshard(xs, Spec(None, partial="dp"), Mesh(dp=3)).item() == 0.0


def test_simulated_outputs_never_alias_inputs_or_each_other():
    sim = SimulatedMesh(M2)
    xs = [torch.ones(2), torch.ones(2)]
    out = sim.all_reduce(xs, "dp")
    out[0].add_(1)
    assert out[1].tolist() == [2, 2] and xs[0].tolist() == [1, 1]


def test_simulated_counts_follow_the_cost_conventions_and_reset():
    sim = SimulatedMesh(M2)
    t = torch.zeros(4, 3)
    p = plan(Spec(None, None, partial="dp"), Spec("dp", None), (4, 3), M2) + plan(Spec("dp", None), Spec(None, None), (4, 3), M2)
    sim.run(p, shard(t, Spec(None, None, partial="dp"), M2))
    assert sim.counts == cost(p) == {"reduce_scatter": 48, "all_gather": 48, "send_bytes": 48, "recv_bytes": 48}
    sim.reset_counts()
    assert sim.counts == {"send_bytes": 0, "recv_bytes": 0}


def test_simulated_run_checks_mesh_list_length_and_local_shapes():
    sim = SimulatedMesh(M2)
    (ag,) = plan(Spec("dp", None), Spec(None, None), (4, 3), M2)
    with pytest.raises(ValueError, match="one tensor per rank of Mesh\\(dp=2\\) \\(2\\), got 1"):
        sim.run(ag, [torch.zeros(2, 3)])
    with pytest.raises(ValueError, match="rank 1 holds shape \\(3, 3\\)"):
        sim.run(ag, [torch.zeros(2, 3), torch.zeros(3, 3)])
    with pytest.raises(ValueError, match="collective for Mesh\\(dp=2\\) run on Mesh\\(dp=4\\)"):
        SimulatedMesh(Mesh(dp=4)).run(ag, [torch.zeros(1, 3)] * 4)
    with pytest.raises(ValueError, match="incompatible shapes"):
        sim.all_reduce([torch.zeros(2), torch.zeros(3)], "dp")
