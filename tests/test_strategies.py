"""Strategies are data: layout rules per tensor, one code path for every ZeRO stage."""

import dataclasses

import pytest

from fsdpx import Spec
from fsdpx.sharding.strategies import REPLICATED, ShardDim0, Strategy, ddp, hsdp, zero1, zero2, zero3

ALL = [ddp(), zero1(), zero2(), zero3(), hsdp()]


def test_layout_rules_shard_dim0_and_replicate_scalars():
    rule = ShardDim0(("dp",))
    assert rule(2) == Spec("dp", None) and rule(1) == Spec("dp") and rule(0) == Spec()
    assert ShardDim0(("replica", "shard"))(2) == Spec(("replica", "shard"), None)
    assert REPLICATED(3) == Spec(None, None, None)


@pytest.mark.parametrize("s", ALL, ids=lambda s: s.name)
def test_every_strategy_replicates_scalars_and_keeps_opt_state_with_its_owner(s):
    for field in ("param_at_rest", "param_in_compute", "grad", "opt_state"):
        assert getattr(s, field)(0) == Spec()
    # the optimizer steps where its state lives: on the reduced gradient's shard or a slice of it
    assert s.opt_state(2).axes(0)[: len(s.grad(2).axes(0))] == s.grad(2).axes(0)


def test_zero_stages_are_the_table_of_the_module_docstring():
    rep, sh = Spec(None, None), Spec("dp", None)
    table = {  # at rest, in compute, grad, opt state, reshard after forward
        "ddp": (rep, rep, rep, rep, False),
        "zero1": (rep, rep, rep, sh, False),
        "zero2": (rep, rep, sh, sh, False),
        "zero3": (sh, rep, sh, sh, True),
    }
    for s in ALL[:4]:
        assert (s.param_at_rest(2), s.param_in_compute(2), s.grad(2), s.opt_state(2), s.reshard_after_forward) == table[s.name]
        assert s.raw_grad(2) == Spec(None, None, partial=("dp",))


def test_zero_stages_differ_only_in_data():
    z2 = zero2()
    assert type(z2) is type(zero3()) is Strategy
    rebuilt = dataclasses.replace(z2, name="zero3", param_at_rest=ShardDim0(("dp",)), reshard_after_forward=True)
    assert rebuilt == zero3()
    assert dataclasses.replace(zero1(), name="ddp", opt_state=REPLICATED) == ddp()


def test_zero3_opt_state_has_the_parameter_spec_and_grads_reduce_scatter_to_it():
    z = zero3("fsdp")
    assert z.opt_state(2) == z.param_at_rest(2) == z.grad(2) == Spec("fsdp", None)
    (t,) = [t for t in z.backward_transitions(2) if t.phase == "reduce_grad"]
    assert (t.src, t.dst) == (Spec(None, None, partial=("fsdp",)), Spec("fsdp", None))
    assert [t.phase for t in z.backward_transitions(2)] == ["gather_for_backward", "reduce_grad"]
    assert [t.phase for t in zero3(reshard_after_forward=False).backward_transitions(2)] == ["reduce_grad"]
    assert z.update_transitions(2) == []


def test_hsdp_shards_over_shard_and_reduces_over_both_axes():
    h = hsdp()
    assert h.param_at_rest(2) == Spec("shard", None) and h.param_in_compute(2) == Spec(None, None)
    assert h.raw_grad(2) == Spec(None, None, partial=("replica", "shard"))
    assert h.grad(2) == Spec("shard", None)
    assert hsdp("r", "s").param_at_rest(1) == Spec("s")


def test_zero1_and_zero2_slice_locally_and_gather_the_updated_parameter():
    for s in (zero1(), zero2()):
        phases = {t.phase: (t.src, t.dst) for t in s.update_transitions(2)}
        assert phases["param_from_update"] == (Spec("dp", None), Spec(None, None))
        assert phases["param_to_update"] == (Spec(None, None), Spec("dp", None))
    assert "grad_to_update" in {t.phase for t in zero1().update_transitions(2)}
    assert ddp().update_transitions(2) == [] and ddp().forward_transitions(2) == []
