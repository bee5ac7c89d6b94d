"""A model with a layer that mixes examples is refused by name before any private step runs
(issue 14, section 1): ``privacy.validate.check_model``."""

import pytest
import torch
from torch import nn

from fsdpx.optim import adamw
from fsdpx.runtime import make_sharded_step
from fsdpx.sharding import Mesh, strategies
from fsdpx import run_threads
from privacy import DPConfig, clipped_grad, make_private_step, per_sample_norms
from privacy.errors import PerExampleError
from privacy.validate import check_model


def _net(norm: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.Sequential(norm, nn.ReLU()), nn.Linear(6, 2))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y, reduction="none")


CONFIG = DPConfig(clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.5)
BATCH = (torch.randn(4, 4), torch.tensor([0, 1, 0, 1]))


@pytest.mark.parametrize("norm", [nn.BatchNorm1d(6), nn.SyncBatchNorm(6)])
def test_batch_norm_in_training_mode_is_named_before_any_step(norm):
    model = _net(norm)
    with pytest.raises(PerExampleError, match=r"module '1.0' \((Sync)?BatchNorm(1d)?\).*whole batch") as err:
        make_private_step(model, _loss, adamw(1e-3), CONFIG, num_examples=8)
    assert err.value.module == "1.0"
    params = dict(model.named_parameters())
    for call in (lambda: clipped_grad(model, params, BATCH, _loss, clip_norm=1.0),
                 lambda: per_sample_norms(model, params, BATCH, _loss, method="vmap")):
        with pytest.raises(PerExampleError, match="1.0"):
            call()


def test_a_sharded_private_step_refuses_batch_norm_before_its_first_step():
    model = _net(nn.BatchNorm1d(6))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}

    def build(comm):
        with pytest.raises(PerExampleError, match="BatchNorm"):
            make_sharded_step(model, _loss, adamw(1e-3), strategies.ddp(), comm, param_shapes=shapes, config=CONFIG,
                              num_examples=8)
        return True

    assert run_threads(Mesh(dp=2), build) == [True, True]


@pytest.mark.parametrize("norm", [nn.LayerNorm(6), nn.GroupNorm(2, 6), nn.InstanceNorm1d(6), nn.Identity()])
def test_per_example_layers_pass(norm):
    check_model(_net(norm))


def test_batch_norm_in_eval_mode_passes_and_gives_per_example_norms():
    model = _net(nn.BatchNorm1d(6)).eval()
    check_model(model)
    params = dict(model.named_parameters())
    ghost = per_sample_norms(model, params, BATCH, _loss, method="vmap")
    assert ghost.shape == (4,) and torch.isfinite(ghost).all()
