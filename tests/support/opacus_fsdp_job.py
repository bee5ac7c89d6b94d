"""An Opacus user's FSDP script, with the imports swapped: run under torchrun it trains each
case with ``FSDP2Wrapper`` and ``grad_sample_mode="ghost_fsdp"``; :func:`run_case` with
``sharded=False`` is the one-process entry (``grad_sample_mode="ghost"``) on the same model,
data and key, which the test compares it with (``tests/test_opacus_fsdp.py``).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/support/opacus_fsdp_job.py OUT

writes ``OUT/<case>.rank<r>.pt`` (the whole parameters after the steps and the epsilon), then
makes rank 1 exit abruptly before a step and writes what rank 0 saw (``OUT/dead.rank0.pt``).
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from privacy.opacus import BatchMemoryManager, PrivacyEngine

STEPS = 3
CASES = {  # name: (model, noise_multiplier, physical batch size of BatchMemoryManager or None)
    "mlp": ("mlp", 0.0, None),
    "mlp_noise": ("mlp", 1.0, None),
    "mlp_virtual": ("mlp", 1.0, 4),  # physical batches of at most 4: at step 1 rank 0 cuts 2, rank 1 one
    "gpt2": ("gpt2", 0.0, None),
}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)).double()


def gpt2() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                     tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def dataset(kind: str) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        return TensorDataset(torch.randn(48, 6, generator=g, dtype=torch.float64) * 3,
                             torch.randint(0, 3, (48,), generator=g))
    ids = torch.randint(0, 40, (24, 9), generator=g)
    return TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def run_case(name: str, *, sharded: bool, steps: int = STEPS) -> tuple[dict[str, torch.Tensor], float]:
    """The user's loop on case ``name`` (Poisson batches of key 7, SGD, Opacus' ghost criterion;
    sharded, a case's physical batches through ``BatchMemoryManager``): ``(whole parameters
    after the steps, epsilon at 1e-5)``."""
    kind, sigma, physical = CASES[name]
    model = mlp() if kind == "mlp" else gpt2()
    if sharded:
        from fsdpx.runtime.opacus_fsdp import FSDP2Wrapper

        model = FSDP2Wrapper(model)
    engine = PrivacyEngine(accountant="rdp")
    private, optimizer, criterion, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(dataset(kind), batch_size=8 if kind == "gpt2" else 16), noise_multiplier=sigma,
        max_grad_norm=0.5 if kind == "mlp" else 0.1, grad_sample_mode="ghost_fsdp" if sharded else "ghost", key=7)
    batches = loader
    if sharded and physical is not None:
        batches = BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical,
                                     optimizer=optimizer).__enter__()
    for x, y in batches:
        optimizer.zero_grad()
        if kind == "mlp":
            loss = criterion(private(x), y)
        else:
            logits = private(input_ids=x).logits
            loss = criterion(logits.flatten(0, 1), y.flatten(), shape=logits.shape)
        loss.backward()
        optimizer.step()
        if optimizer.steps == steps:
            break
    assert optimizer.steps == steps
    params = model.full_parameters() if sharded else {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, engine.get_epsilon(1e-5)


def dead_rank(out: str, rank: int) -> None:
    """Rank 1 leaves without a word before a step; rank 0 records what its step raised, and when."""
    model = mlp()
    from fsdpx.runtime.opacus_fsdp import FSDP2Wrapper

    model = FSDP2Wrapper(model)
    private, optimizer, criterion, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), data_loader=DataLoader(dataset("mlp"),
        batch_size=16), noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost_fsdp", key=7)
    x, y = next(iter(loader))
    if rank == 1:
        os._exit(0)  # exit code 0: torchrun then waits for rank 0 instead of stopping it
    start = time.monotonic()
    try:
        criterion(private(x), y).backward()
        optimizer.step()
        seen = "no error"
    except Exception as e:  # noqa: BLE001 - what rank 0 saw is the result
        seen = f"{type(e).__name__}: {e}"
    torch.save({"seen": seen, "seconds": time.monotonic() - start}, os.path.join(out, f"dead.rank{rank}.pt"))
    os._exit(0)  # the group lost a member: no orderly shutdown


def main(out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for name in CASES:
        params, epsilon = run_case(name, sharded=True)
        torch.save({"params": params, "epsilon": epsilon}, os.path.join(out, f"{name}.rank{rank}.pt"))
    dist.barrier()
    dead_rank(out, rank)


if __name__ == "__main__":
    main(sys.argv[1])
