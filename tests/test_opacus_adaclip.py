"""``privacy.opacus`` adaptive clipping (``clipping="adaptive"``) run against Opacus'
``AdaClipDPOptimizer``: the same loop, the same MLP and data; without gradient noise and with a
count noise far below one example (1e-9), the clip bounds and the parameters follow Opacus' to
the float32 rounding of Opacus' bound."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privacy.errors import PrivacyError
from privacy.opacus import AdaClipDPOptimizer, PrivacyEngine

opacus = pytest.importorskip("opacus")

ADAPTIVE = dict(target_unclipped_quantile=0.5, clipbound_learning_rate=0.7, max_clipbound=5.0, min_clipbound=0.05,
                unclipped_num_std=1e-9)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def train(engine_class, model: nn.Module, steps: int = 6, **overrides) -> tuple[nn.Module, list[float]]:
    """Opacus' loop with fixed batches; the clip bound after each step."""
    g = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(64, 6, generator=g, dtype=torch.float64) * 3,
                            torch.randint(0, 3, (64,), generator=g))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    criterion = nn.CrossEntropyLoss()
    private, optimizer, loader = engine_class().make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(dataset, batch_size=16), noise_multiplier=0.0,
        max_grad_norm=0.2, poisson_sampling=False, clipping="adaptive", **(ADAPTIVE | overrides))
    bounds = []
    for _ in range(steps // 4 + 1):
        for x, y in loader:
            if len(bounds) == steps:
                break
            optimizer.zero_grad()
            criterion(private(x), y).backward()
            optimizer.step()
            bounds.append(float(optimizer.max_grad_norm))
    return model, bounds


def test_adaptive_clipping_follows_opacus():
    ours, our_bounds = train(PrivacyEngine, mlp())
    theirs, their_bounds = train(opacus.PrivacyEngine, mlp())
    # Opacus keeps the bound as a float32 tensor (torch.exp of its float32 count): its rounding
    assert our_bounds == pytest.approx(their_bounds, rel=1e-6, abs=0)
    assert max(our_bounds) / min(our_bounds) > 1.5  # the bound moved
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (name, float((a - b).abs().max()))


def test_the_count_noise_is_fsdpx_noise_of_the_key():
    """With a real count noise, two runs of one key take the same bounds; another key others."""
    def bounds(key: int) -> list[float]:
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        g = torch.Generator().manual_seed(1)
        dataset = TensorDataset(torch.randn(64, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (64,)))
        private, optimizer, loader = PrivacyEngine().make_private(
            module=model, optimizer=optimizer, data_loader=DataLoader(dataset, batch_size=16), noise_multiplier=1.0,
            max_grad_norm=0.2, poisson_sampling=False, clipping="adaptive", key=key, **(ADAPTIVE | {"unclipped_num_std": 2.0}))
        out = []
        for x, y in loader:
            optimizer.zero_grad()
            nn.CrossEntropyLoss()(private(x), y).backward()
            optimizer.step()
            out.append(optimizer.max_grad_norm)
        assert isinstance(optimizer, AdaClipDPOptimizer)
        return out

    assert bounds(3) == bounds(3) != bounds(4)


@pytest.mark.parametrize("overrides,says", [
    (dict(unclipped_num_std=0.1, noise_multiplier=1.0), "smaller than 2 \\* unclipped_num_std"),
    (dict(max_clipbound=0.01), "max_clipbound=0.01 must be larger"),
])
def test_adaptive_settings_opacus_rejects_are_named_errors(overrides, says):
    sigma = overrides.pop("noise_multiplier", 0.0)
    model = mlp()
    dataset = TensorDataset(torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,)))
    with pytest.raises(PrivacyError, match=says):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=DataLoader(dataset, batch_size=4), noise_multiplier=sigma,
                                     max_grad_norm=1.0, clipping="adaptive", **(ADAPTIVE | overrides))


def test_adaptive_clipping_without_its_arguments_is_refused_by_name():
    model = mlp()
    dataset = TensorDataset(torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,)))
    with pytest.raises(PrivacyError, match="without clipbound_learning_rate"):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=DataLoader(dataset, batch_size=4), noise_multiplier=0.0,
                                     max_grad_norm=1.0, clipping="adaptive",
                                     **{k: v for k, v in ADAPTIVE.items() if k != "clipbound_learning_rate"})
