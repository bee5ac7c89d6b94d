"""Memory and communication per rank, checked against numbers worked out by hand."""

import pytest
import torch

from fsdpx import Mesh, SimulatedMesh, comm_per_step, memory_by_rank, memory_per_rank, peak_gathered_bytes
from fsdpx.sharding.cost_model import step_collectives
from fsdpx.sharding.layout import local_shape
from fsdpx.sharding.strategies import ddp, hsdp, zero1, zero2, zero3

M2 = Mesh(dp=2)
W = {"w": (4, 3)}  # 12 fp32 = 48 bytes; a dp=2 shard is 2 rows = 24 bytes


@pytest.mark.parametrize(
    "strategy, expected",
    [
        # param + grad + 2 AdamW moments
        (ddp(), 48 + 48 + 2 * 48),
        (zero1(), 48 + 48 + 2 * 24),
        (zero2(), 48 + 24 + 2 * 24),
        (zero3(), 24 + 24 + 2 * 24),
    ],
    ids=lambda x: getattr(x, "name", ""),
)
def test_memory_per_rank_hand_checked_two_ranks_one_4x3_param(strategy, expected):
    assert memory_per_rank(strategy, W, M2) == expected
    assert memory_by_rank(strategy, W, M2) == [expected, expected]


def test_memory_counts_optimizer_states_and_dtype():
    assert memory_per_rank(zero3(), W, M2, optimizer="sgd") == 24 + 24
    assert memory_per_rank(zero3(), W, M2, optimizer="sgd_momentum") == 24 + 24 + 24
    assert memory_per_rank(ddp(), W, M2, optimizer="sgd", dtype=torch.bfloat16) == 24 + 24
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        memory_per_rank(ddp(), W, M2, optimizer="lion")


def test_memory_differs_across_ranks_for_uneven_shards_and_the_worst_is_reported():
    # [3, 2] over 2 ranks: rows 2 and 1 -> 16 and 8 bytes per tensor, 4 tensors each
    assert memory_by_rank(zero3(), {"w": (3, 2)}, M2) == [64, 32]
    assert memory_per_rank(zero3(), {"w": (3, 2)}, M2) == 64
    # [1, 2] over 4 ranks: three ranks hold empty shards
    assert memory_by_rank(zero3(), {"w": (1, 2)}, Mesh(dp=4)) == [32, 0, 0, 0]
    # a scalar is replicated: 4 tensors of 4 bytes on every rank
    assert memory_by_rank(zero3(), {"s": ()}, M2) == [16, 16]


def test_hsdp_memory_shards_over_shard_only():
    # [4, 3] over shard=2: 2 rows (24 bytes) on every rank, whatever the replica
    assert memory_by_rank(hsdp(), W, Mesh(replica=2, shard=2)) == [96] * 4


@pytest.mark.parametrize(
    "strategy, mesh, expected",
    [
        (ddp(), M2, {"all_reduce": 48, "send_bytes": 48, "recv_bytes": 48}),
        # AR grads (ring: 2 * 1 * 24 sent), slice locally, AG the updated shard (24 sent)
        (zero1(), M2, {"all_reduce": 48, "local_slice": 0, "all_gather": 48, "send_bytes": 72, "recv_bytes": 72}),
        (zero2(), M2, {"reduce_scatter": 48, "local_slice": 0, "all_gather": 48, "send_bytes": 48, "recv_bytes": 48}),
        # AG forward + AG backward (48 each), RS grads 48; each sends 24
        (zero3(), M2, {"all_gather": 96, "reduce_scatter": 48, "send_bytes": 72, "recv_bytes": 72}),
        (zero3(reshard_after_forward=False), M2, {"all_gather": 48, "reduce_scatter": 48, "send_bytes": 48, "recv_bytes": 48}),
        # AG over shard twice (48 each, 24 sent), RS over shard 48 (24 sent), AR over replica of the 24-byte shard (24 sent)
        (hsdp(), Mesh(replica=2, shard=2), {"all_gather": 96, "reduce_scatter": 48, "all_reduce": 24, "send_bytes": 96, "recv_bytes": 96}),
    ],
    ids=["ddp", "zero1", "zero2", "zero3", "zero3_no_reshard", "hsdp"],
)
def test_comm_per_step_hand_checked_two_ranks_one_4x3_param(strategy, mesh, expected):
    assert comm_per_step(strategy, W, mesh, units=[["w"]]) == expected


def test_comm_per_step_counts_padded_chunks_for_uneven_params():
    # [5] over 4 ranks: chunk 2 padded -> AG buffer 4 * 2 * 4 bytes, twice; RS the same once
    got = comm_per_step(zero3(), {"b": (5,)}, Mesh(dp=4), units=[["b"]])
    assert got["all_gather"] == 2 * 32 and got["reduce_scatter"] == 32


def test_peak_gathered_bytes_is_the_largest_gathered_unit():
    shapes = {"a": (4, 3), "b": (8, 3), "c": ()}
    units = [["a"], ["b", "c"]]
    assert peak_gathered_bytes(zero3(), shapes, M2, units) == 96  # b in full; c is never sharded
    assert peak_gathered_bytes(zero2(), shapes, M2, units) == 0


def test_units_must_partition_the_parameters():
    shapes = {"a": (4,), "b": (4,)}
    with pytest.raises(ValueError, match=r"parameters in no unit: \['b'\]"):
        comm_per_step(zero3(), shapes, M2, units=[["a"]])
    with pytest.raises(ValueError, match="'a' is in more than one unit"):
        comm_per_step(zero3(), shapes, M2, units=[["a"], ["a", "b"]])
    with pytest.raises(ValueError, match="'z' is not in param_shapes"):
        comm_per_step(zero3(), shapes, M2, units=[["a", "b", "z"]])


def test_mesh_without_the_strategy_axis_is_rejected_by_name():
    with pytest.raises(ValueError, match="unknown mesh axis 'dp'"):
        comm_per_step(zero3(), W, Mesh(fsdp=2), units=[["w"]])


@pytest.mark.parametrize("strategy, mesh", [(zero3(), Mesh(dp=3)), (zero1(), Mesh(dp=3)), (hsdp(), Mesh(replica=2, shard=3))])
def test_simulating_a_train_step_counts_exactly_comm_per_step(strategy, mesh):
    shapes = {"w": (5, 2), "b": (2,), "s": ()}
    units = [["w", "b"], ["s"]]
    sim = SimulatedMesh(mesh)
    for step in step_collectives(strategy, shapes, mesh, units):
        c = step.collective
        sim.run(c, [torch.zeros(local_shape(c.shape, c.src, mesh, r)) for r in range(mesh.size)])
    assert sim.counts == comm_per_step(strategy, shapes, mesh, units)


def gpt_like_49m() -> tuple[dict[str, tuple[int, ...]], list[list[str]]]:
    """10 pre-norm blocks of width 512 (no biases) and a 34072 x 512 embedding: 48,912,896 params."""
    d, vocab = 512, 34072
    shapes: dict[str, tuple[int, ...]] = {"embed": (vocab, d), "norm_f": (d,)}
    units = [["embed"]]
    for i in range(10):
        block = {f"h{i}.norm1": (d,), f"h{i}.qkv": (3 * d, d), f"h{i}.proj": (d, d),
                 f"h{i}.norm2": (d,), f"h{i}.fc": (4 * d, d), f"h{i}.out": (d, 4 * d)}
        shapes.update(block)
        units.append(list(block))
    units.append(["norm_f"])
    return shapes, units


def test_fsdp2_anchor_49m_params_two_ranks():
    shapes, units = gpt_like_49m()
    n = sum(torch.Size(s).numel() for s in shapes.values())
    assert n == 48_912_896
    zero3_comm = comm_per_step(zero3(), shapes, M2, units)
    ddp_comm = comm_per_step(ddp(), shapes, M2, units)
    assert zero3_comm["all_gather"] == 2 * 4 * n  # every dim 0 is even: no padding
    assert zero3_comm["reduce_scatter"] == ddp_comm["all_reduce"] == 4 * n
    assert round(zero3_comm["all_gather"] / 1e6, 1) == 391.3
    assert round(zero3_comm["reduce_scatter"] / 1e6, 1) == 195.7
    assert round(ddp_comm["all_reduce"] / 1e6, 1) == 195.7
    assert memory_per_rank(zero3(), shapes, M2) == 4 * 4 * n // 2
