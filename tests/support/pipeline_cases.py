"""Random pipelines for the property tests: every schedule kind on random small GPTs, over the
meshes of ``MESHES`` (pipeline alone and with data and tensor parallelism)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from fsdpx.models.gpt import GPT, GPTConfig
from fsdpx.models.tp_plans import gpt_plan
from fsdpx.sharding import Mesh, strategies
from fsdpx.sharding.pipeline import PipelineParallel, resolve_pipeline
from fsdpx.sharding.schedule import KINDS
from fsdpx.sharding.tensor_parallel import resolve

MESHES = [  # (strategy, mesh)
    ("ddp", Mesh(dp=1, pp=2)), ("ddp", Mesh(dp=1, pp=3)), ("ddp", Mesh(dp=1, pp=4)), ("ddp", Mesh(dp=1, pp=1)),
    ("zero3", Mesh(dp=2, pp=2)), ("zero2", Mesh(dp=2, pp=2)), ("ddp", Mesh(dp=2, pp=2)),
    ("zero3", Mesh(dp=1, tp=2, pp=2)), ("zero3", Mesh(dp=2, tp=2, pp=2)), ("hsdp", Mesh(replica=1, shard=2, pp=2)),
]


@st.composite
def pipelines(draw):
    """``(model, batches, plan, mesh)``: a random GPT (float64, tied or not, ``p * v`` to ``p * v + 2``
    blocks), two batches of one random size (0 to 6), and its resolved pipeline plan on a mesh of
    ``MESHES`` (a random kind, microbatch count and virtual stages)."""
    strategy, mesh = draw(st.sampled_from(MESHES))
    p = mesh.axis_size("pp")
    tp = mesh.axis_size("tp") if "tp" in mesh.axis_names else 1
    kind = draw(st.sampled_from(KINDS))
    v = draw(st.integers(1, 2)) if kind == "interleaved_1f1b" else 1
    m = p * draw(st.integers(1, 2)) if kind == "interleaved_1f1b" else draw(st.integers(1, 5))
    heads = tp * draw(st.integers(1, 2))
    vocab = draw(st.integers(5, 13).filter(lambda n: tp == 1 or -(-n // tp) * (tp - 1) < n))
    config = GPTConfig(vocab_size=vocab, block_size=draw(st.integers(2, 4)),
                       n_layer=draw(st.integers(p * v, p * v + 2)), n_head=heads, n_embd=heads * draw(st.integers(1, 2)),
                       bias=draw(st.booleans()), tie_weights=draw(st.booleans()))
    torch.manual_seed(draw(st.integers(0, 2**31)))
    model = GPT(config).double()
    B = draw(st.integers(0, 6))
    batches = [(torch.randint(0, vocab, (B, config.block_size)), torch.randint(0, vocab, (B, config.block_size)))
               for _ in range(2)]
    base = resolve(model, gpt_plan(config) if tp > 1 else None, strategies.ALL[strategy](), mesh)
    plan = resolve_pipeline(model, base, PipelineParallel(schedule=kind, microbatches=m, virtual_stages=v), mesh)
    return model, batches, plan, mesh
