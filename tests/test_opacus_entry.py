"""``privacy.opacus``: Opacus' ``PrivacyEngine`` over fsdpx's core, run against Opacus itself.

The same script runs twice, once with ``opacus.PrivacyEngine`` and once with
``privacy.opacus.PrivacyEngine``, on the same model, data and seed: with ``noise_multiplier=0``
(clipping only; the noise of the two libraries is drawn differently) the parameters after
several SGD steps agree (float64: 1e-10); with noise, the epsilon of the same sampling and steps
agrees with Opacus' accountant of the same kind within 1%.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from privacy import PoissonSampler
from privacy.errors import PrivacyError
from privacy.opacus import BatchMemoryManager, PrivacyEngine

opacus = pytest.importorskip("opacus")


def mlp(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)).to(dtype)


def data(n: int = 48, dtype: torch.dtype = torch.float64) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 6, generator=g, dtype=dtype) * 3, torch.randint(0, 3, (n,), generator=g))


def train(engine_class, model: nn.Module, *, mode: str, reduction: str, steps: int = 3,
          max_grad_norm: float = 0.5) -> nn.Module:
    """The Opacus tutorial's loop, fixed batches (no Poisson sampling), no noise."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    criterion = nn.CrossEntropyLoss(reduction=reduction)
    loader = DataLoader(data(), batch_size=16)
    out = engine_class().make_private(module=model, optimizer=optimizer, data_loader=loader, criterion=criterion,
                                      noise_multiplier=0.0, max_grad_norm=max_grad_norm, poisson_sampling=False,
                                      grad_sample_mode=mode, loss_reduction=reduction)
    private, optimizer, loader = (out[0], out[1], out[3]) if mode == "ghost" else out
    criterion = out[2] if mode == "ghost" else criterion
    for _, (x, y) in zip(range(steps), loader):
        optimizer.zero_grad()
        loss = criterion(private(x), y)
        loss.backward()
        optimizer.step()
    return model


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_clipping_only_steps_equal_opacus(mode, reduction):
    """An MLP in float64 whose examples are clipped (max_grad_norm below most norms): three SGD
    steps give Opacus' parameters within 1e-10."""
    ours = train(PrivacyEngine, mlp(), mode=mode, reduction=reduction)
    theirs = train(opacus.PrivacyEngine, mlp(), mode=mode, reduction=reduction)
    start = mlp()
    moved = max(float((a - b).abs().max()) for a, b in zip(ours.parameters(), start.parameters()))
    assert moved > 1e-3  # the steps did something
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-10), (name, float((a - b).abs().max()))


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_epsilon_agrees_with_opacus_accountant_of_the_same_kind(accountant):
    """Same sampling rate, noise and steps: epsilon within 1% of Opacus' ("prv" is fsdpx's PLD
    accountant, an upper bound of the same kind as Opacus' PRV)."""
    ours, theirs = PrivacyEngine(accountant=accountant), opacus.PrivacyEngine(accountant=accountant)
    for engine in (ours, theirs):
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(data(), batch_size=8)  # sample rate 1/6
        model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                       noise_multiplier=1.1, max_grad_norm=1.0)
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    a, b = ours.get_epsilon(1e-5), theirs.get_epsilon(1e-5)
    assert a > 0 and abs(a - b) <= 0.01 * b, (a, b)
    assert ours.accountant.history == [tuple(h) for h in theirs.accountant.history] == [(1.1, 1 / 6, 6)]


def test_batches_are_the_poisson_sampler_s():
    """The private loader's batch ``t`` is ``PoissonSampler(n, 1/len(loader), key).indices(t)``,
    ``len(loader)`` batches an epoch, the second epoch continuing the steps; an empty draw is a
    batch of zero rows."""
    dataset = TensorDataset(torch.arange(40.0).unsqueeze(1), torch.arange(40))
    model = nn.Linear(1, 2)
    _, _, loader = PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                data_loader=DataLoader(dataset, batch_size=4), noise_multiplier=1.0,
                                                max_grad_norm=1.0, key=7)
    sampler = PoissonSampler(40, 0.1, key=7)
    got = [y for _ in range(2) for _, y in loader]
    assert len(got) == 20
    for t, y in enumerate(got):
        assert torch.equal(y, sampler.indices(t))


def test_virtual_steps_equal_one_step_on_the_logical_batch():
    """Cut into physical batches of 5, each Poisson batch moves the parameters once, by what one
    step on the whole batch gives (the same noise: it is a function of the step)."""
    def run(physical: int | None) -> nn.Module:
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        private, optimizer, loader = PrivacyEngine().make_private(
            module=model, optimizer=optimizer, data_loader=DataLoader(data(), batch_size=16), noise_multiplier=0.7,
            max_grad_norm=0.5, key=3)
        if physical is None:
            batches = iter(loader)
        else:
            manager = BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=optimizer)
            batches = manager.__enter__()
        for x, y in batches:
            optimizer.zero_grad()
            nn.functional.cross_entropy(private(x), y).backward()  # a mean over the physical batch
            optimizer.step()
        assert optimizer.steps == 3
        return model

    for a, b in zip(run(None).parameters(), run(5).parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), float((a - b).abs().max())


@pytest.mark.parametrize("batch_size, physical", [(16, 5), (16, 4), (12, 8)])
def test_batch_memory_manager_cuts_and_counts_as_opacus_s(batch_size, physical):
    """Fixed batches (no Poisson sampling): the physical batches have Opacus' sizes
    (``np.array_split``) and ``len()`` is Opacus' ``len()``; on a Poisson loader ``len()`` is the
    expected count, as Opacus'."""
    def physical_sizes(engine_class, manager_class, poisson: bool) -> tuple[list[int], int]:
        model = mlp()
        _, optimizer, loader = engine_class().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data(), batch_size=batch_size), noise_multiplier=1.0, max_grad_norm=1.0,
            poisson_sampling=poisson)
        with manager_class(data_loader=loader, max_physical_batch_size=physical, optimizer=optimizer) as batches:
            return ([len(y) for _, y in batches] if not poisson else []), len(batches)

    from opacus.utils.batch_memory_manager import BatchMemoryManager as OpacusManager
    assert physical_sizes(PrivacyEngine, BatchMemoryManager, False) == physical_sizes(
        opacus.PrivacyEngine, OpacusManager, False)
    assert physical_sizes(PrivacyEngine, BatchMemoryManager, True)[1] == physical_sizes(
        opacus.PrivacyEngine, OpacusManager, True)[1]


def test_unkeyed_runs_take_their_randomness_from_torch_seeds_as_opacus_does():
    """Without ``key``: two runs differ (noise and batches are not a fixed default), equal
    ``torch.manual_seed`` before the loop gives equal runs, a seeded ``noise_generator`` and a
    seeded loader ``generator`` give equal runs whatever the global seed; an int ``key`` is
    fsdpx's (equal keys, equal runs)."""
    def run(seed: int | None = None, noise_seed: int | None = None, data_seed: int | None = None,
            key: int | None = None) -> Tensor:
        model = nn.Linear(6, 3).double()
        nn.init.zeros_(model.weight), nn.init.zeros_(model.bias)
        generator = torch.Generator().manual_seed(data_seed) if data_seed is not None else None
        noise = torch.Generator().manual_seed(noise_seed) if noise_seed is not None else None
        private, optimizer, loader = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(data(), batch_size=16, generator=generator), noise_multiplier=1.0,
            max_grad_norm=1.0, noise_generator=noise, key=key)
        if seed is not None:
            torch.manual_seed(seed)
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(private(x), y).backward()
            optimizer.step()
        return model.weight.detach().clone()

    assert not torch.equal(run(), run())
    assert torch.equal(run(seed=5), run(seed=5))
    torch.manual_seed(1)
    first = run(noise_seed=17, data_seed=96)
    torch.manual_seed(2)
    assert torch.equal(first, run(noise_seed=17, data_seed=96))
    assert torch.equal(run(key=3), run(key=3))
    assert not torch.equal(run(noise_seed=17, data_seed=96), run(noise_seed=18, data_seed=96))


def test_pre_step_then_the_original_step_is_step():
    """Opacus users who drive the two halves (``optimizer.pre_step()`` then
    ``optimizer.original_optimizer.step()``) get what ``step()`` gives, noise included; the
    engine's accountant counts the step either way."""
    def run(split: bool) -> tuple[nn.Module, PrivacyEngine]:
        model, engine = mlp(), PrivacyEngine(accountant="rdp")
        private, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(data(), batch_size=16), noise_multiplier=0.7, max_grad_norm=0.5, key=2)
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(private(x), y).backward()
            if split:
                assert optimizer.pre_step()
                optimizer.original_optimizer.step()
            else:
                optimizer.step()
        return model, engine

    (a, ea), (b, eb) = run(False), run(True)
    assert ea.accountant.history == eb.accountant.history == [(0.7, 1 / 3, 3)]
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_evaluation_under_no_grad_is_not_recorded_and_a_forward_without_backward_is_dropped():
    model = mlp()
    private, optimizer, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(data(), batch_size=16), noise_multiplier=0.0, max_grad_norm=0.5,
        poisson_sampling=False)
    x, y = next(iter(loader))
    with torch.no_grad():
        assert torch.equal(private(x), copy.deepcopy(model)(x))
    private(x)  # never backpropagated
    optimizer.zero_grad()
    nn.functional.cross_entropy(private(x), y).backward()
    assert len(private.take()) == 1


@pytest.mark.parametrize("argument, says", [
    ({"grad_sample_mode": "ghost_fsdp"}, "grad_sample_mode='ghost_fsdp' on a model not wrapped by FSDP2Wrapper"),
    ({"clipping": "per_layer"}, "clipping='per_layer' is not supported"),
    ({"batch_first": False}, "batch_first=False is not supported"),
    ({"loss_reduction": "none"}, "loss_reduction='none' is not supported"),
    ({"poisson": True}, "argument 'poisson' is not supported"),
])
def test_what_this_entry_does_not_do_is_refused_by_name(argument, says):
    model = mlp()
    with pytest.raises(PrivacyError, match=says.replace("(", r"\(").replace(")", r"\)")):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=DataLoader(data(), batch_size=16), noise_multiplier=1.0,
                                     max_grad_norm=1.0, **argument)
    with pytest.raises(PrivacyError, match="secure_mode=True is not supported"):
        PrivacyEngine(secure_mode=True)
    with pytest.raises(PrivacyError, match="accountant='gdp' is not supported"):
        PrivacyEngine(accountant="gdp")


def test_dropout_in_training_mode_is_refused_by_name():
    model = nn.Sequential(nn.Linear(6, 4), nn.Dropout(0.1), nn.Linear(4, 3)).double()
    private, _, _ = PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                 data_loader=DataLoader(data(), batch_size=16), noise_multiplier=1.0,
                                                 max_grad_norm=1.0)
    with pytest.raises(PrivacyError, match="dropout layer '1'"):
        private(data()[:4][0])


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_an_untied_gpt2_steps_as_with_opacus(mode):
    """transformers' GPT-2 (untied head: Opacus refuses tied parameters; dropout 0), the user's
    loop on ``.logits``, float32: three clipping-only SGD steps within 1e-5. The loop passes
    ``position_ids`` per example, as Opacus needs: transformers' default ``(1, T)`` positions
    give the position embedding a per-sample gradient of batch 1 in Opacus, which then fails
    (fsdpx takes either)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                     tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 40, (24, 9), generator=g)
    dataset = TensorDataset(ids[:, :-1], ids[:, 1:])

    def run(engine_class) -> nn.Module:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        private, optimizer, loader = engine_class().make_private(
            module=model, optimizer=optimizer, data_loader=DataLoader(dataset, batch_size=8), noise_multiplier=0.0,
            max_grad_norm=0.1, poisson_sampling=False, grad_sample_mode=mode)
        for x, y in loader:
            optimizer.zero_grad()
            positions = torch.arange(x.shape[1]).expand_as(x)  # per example: Opacus needs them so
            logits = private(input_ids=x, position_ids=positions).logits
            nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
            optimizer.step()
        return model

    ours, theirs = run(PrivacyEngine), run(opacus.PrivacyEngine)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-5), (name, float((a - b).abs().max()))


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_bert_classifier_steps_as_with_opacus(mode):
    """transformers' BertForSequenceClassification from a tiny config (dropout 0), the user's loop
    on ``.logits``, float32: three clipping-only SGD steps within 1e-5 of Opacus' (hooks, and
    ghost with the criterion ``make_private`` returns). ``position_ids`` per example, as Opacus
    needs (see the GPT-2 test), and ``position_ids`` and ``token_type_ids`` contiguous: Opacus'
    ghost norm of an embedding calls ``.view`` on its indices, which fails on transformers'
    default expanded ``token_type_ids`` (fsdpx takes the defaults)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
    g = torch.Generator().manual_seed(4)
    dataset = TensorDataset(torch.randint(0, 40, (24, 8), generator=g), torch.randint(0, 3, (24,), generator=g))

    def run(engine_class, defaults: bool = False) -> nn.Module:
        torch.manual_seed(0)
        model = transformers.BertForSequenceClassification(config)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        out = engine_class().make_private(
            module=model, optimizer=optimizer, data_loader=DataLoader(dataset, batch_size=8), noise_multiplier=0.0,
            max_grad_norm=0.1, poisson_sampling=False, grad_sample_mode=mode, criterion=nn.CrossEntropyLoss())
        private, optimizer, loader = (out[0], out[1], out[3]) if mode == "ghost" else out
        criterion = out[2] if mode == "ghost" else nn.CrossEntropyLoss()
        for x, y in loader:
            optimizer.zero_grad()
            positions = torch.arange(x.shape[1]).repeat(x.shape[0], 1)  # contiguous: Opacus' ghost views them
            given = {} if defaults else {"position_ids": positions, "token_type_ids": torch.zeros_like(x)}
            criterion(private(input_ids=x, **given).logits, y).backward()
            optimizer.step()
        return model

    ours, theirs = run(PrivacyEngine), run(opacus.PrivacyEngine)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-5), (name, float((a - b).abs().max()))
    for a, b in zip(ours.parameters(), run(PrivacyEngine, defaults=True).parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)  # fsdpx takes transformers' default positions too
    torch.manual_seed(0)
    start = transformers.BertForSequenceClassification(config)
    assert max(float((a - b).abs().max()) for a, b in zip(ours.parameters(), start.parameters())) > 1e-3


def test_ghost_sequence_loss_with_shape_steps_as_with_opacus():
    """Opacus' language-model loop under ghost clipping: ``criterion(logits.flatten(0, 1),
    targets.flatten(), shape=logits.shape)``, the privacy unit a sequence, padding targets
    ``-100`` (different counts per sequence, so the per-sequence mean differs from the flat
    mean): transformers' GPT-2 (untied), float32, three clipping-only steps within 1e-5."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                     tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 40, (24, 9), generator=g)
    targets = ids[:, 1:].clone()
    targets[torch.arange(8).unsqueeze(0) >= torch.randint(2, 9, (24, 1), generator=g)] = -100
    dataset = TensorDataset(ids[:, :-1].contiguous(), targets)

    def run(engine_class) -> nn.Module:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        private, optimizer, criterion, loader = engine_class().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), criterion=nn.CrossEntropyLoss(),
            data_loader=DataLoader(dataset, batch_size=8), noise_multiplier=0.0, max_grad_norm=0.1,
            poisson_sampling=False, grad_sample_mode="ghost")
        for x, y in loader:
            optimizer.zero_grad()
            logits = private(input_ids=x, position_ids=torch.arange(x.shape[1]).repeat(x.shape[0], 1)).logits
            criterion(logits.flatten(0, 1), y.flatten(), shape=logits.shape).backward()
            optimizer.step()
        return model

    ours, theirs = run(PrivacyEngine), run(opacus.PrivacyEngine)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-5), (name, float((a - b).abs().max()))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_grad_sample_after_backward_is_opacus_s(reduction):
    """``p.grad_sample`` after ``loss.backward()``, "hooks" mode, an MLP in float64: Opacus'
    per-example gradients within 1e-10 (shape ``[B, *p.shape]``, a mean loss not divided by the
    batch size); two forwards and backwards before ``zero_grad`` stack their rows as Opacus'
    stack; ``None`` after ``zero_grad``, and ``None`` throughout in the ghost mode, as in Opacus."""
    x, y = data()[:10]

    def grad_samples(engine_class, mode: str, backwards: int = 1) -> list:
        model = mlp()
        out = engine_class().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                          data_loader=DataLoader(data(), batch_size=16), noise_multiplier=0.0,
                                          max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode=mode,
                                          loss_reduction=reduction, criterion=nn.CrossEntropyLoss(reduction=reduction))
        private, optimizer = out[0], out[1]
        criterion = out[2] if mode == "ghost" else nn.CrossEntropyLoss(reduction=reduction)
        rows = 10 // backwards
        for k in range(backwards):
            criterion(private(x[rows * k:rows * (k + 1)]), y[rows * k:rows * (k + 1)]).backward()
        samples = [p.grad_sample for p in model.parameters()]
        optimizer.zero_grad()
        assert all(p.grad_sample is None for p in model.parameters())
        return samples

    for backwards in (1, 2):
        ours = grad_samples(PrivacyEngine, "hooks", backwards)
        theirs = grad_samples(opacus.PrivacyEngine, "hooks", backwards)
        for a, b in zip(ours, theirs):
            b = torch.cat(b) if isinstance(b, list) else b
            assert a.shape == b.shape == (10, *a.shape[1:])
            assert torch.allclose(a, b, rtol=0, atol=1e-10), float((a - b).abs().max())
    assert all(g is None for g in grad_samples(PrivacyEngine, "ghost"))
    assert all(g is None for g in grad_samples(opacus.PrivacyEngine, "ghost"))


def test_clipping_the_grad_samples_formed_at_backward_is_clipped_grad_bit_for_bit():
    """``privacy.clipping.clip_per_sample`` of ``per_sample_grads`` equals ``clipped_grad(method=
    "vmap")`` on the same batch bit for bit (sums and norms), Opacus' clip factor included: the
    vmap modes' step clips what ``backward`` formed for ``p.grad_sample`` instead of forming it
    again."""
    from privacy.clipping import clip_per_sample, clipped_grad
    from privacy.per_sample import per_sample_grads

    model = mlp()
    params = {n: p.detach() for n, p in model.named_parameters()}
    x, y = data()[:9]
    loss = lambda out, t: nn.functional.cross_entropy(out, t, reduction="none")  # noqa: E731
    want, want_norms = clipped_grad(model, params, (x, y), loss, clip_norm=2.0, method="vmap", clipping="opacus_flat")
    got, norms = clip_per_sample(per_sample_grads(model, params, (x, y), loss), params, clip_norm=2.0,
                                 clipping="opacus_flat")
    assert torch.equal(norms, want_norms) and (norms > 2.0).any() and (norms < 2.0).any()
    assert all(torch.equal(got[n], want[n]) for n in params)
