"""Which side of the block list a parameter is on, for a model registered in another order than
its forward runs.

transformers' OPT registers its final LayerNorm before its layers, and runs it after them. Taken
by registration order, the final norm went to stage 0 and the last stage ran it on its
stand-in zeros: every logit 0, the loss ``log(vocabulary)`` at every step, nothing trained, no
error. Now ``traced_prologue`` reads the side from one forward, ``fsdpx train`` passes it, and
a plan that puts a parameter on the wrong side is refused at the first forward, naming the
module.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdpx.runtime.stages import traced_prologue
from fsdpx.sharding import Mesh, strategies
from fsdpx.sharding.pipeline import PipelineParallel, PipelinePlanError, find_blocks, resolve_pipeline
from fsdpx.sharding.tensor_parallel import resolve
from privacy.step import DPConfig

pytest.importorskip("transformers")
from support import hf_sharded  # noqa: E402
from support.hf import causal_lm, gpt2, lm_loss, padded_batch  # noqa: E402

MESH = Mesh(dp=2, pp=2)


def _plan(model, prologue):
    base = resolve(model, None, strategies.zero3(), MESH)
    return resolve_pipeline(model, base, PipelineParallel(schedule="1f1b", microbatches=2, prologue=prologue), MESH)


def _example_prologue(model):
    inputs, _ = padded_batch([3], causal=True)
    return traced_prologue(model, find_blocks(model), **inputs)


def test_opt_traced_prologue_puts_its_final_norm_on_the_last_stage():
    model = causal_lm("opt")
    prologue = _example_prologue(model)
    assert prologue == ("model.decoder.embed_tokens.weight", "model.decoder.embed_positions.weight")
    stages = _plan(model, prologue).pipeline.param_stages
    assert stages["model.decoder.final_layer_norm.weight"] == (1,)
    assert stages["model.decoder.embed_positions.weight"] == (0,)
    assert stages["model.decoder.embed_tokens.weight"] == (0, 1)  # tied to the LM head: both ends


@pytest.mark.parametrize("private", [True, False], ids=["private", "plain"])
def test_opt_pipelined_with_its_traced_prologue_equals_the_unsharded_run(private):
    """Unmodified OPT (feed-forward on flattened rows, learned positions, tied head), 1F1B over
    pp=2 x ZeRO-3 over dp=2: the trained parameters and each step's loss equal the unsharded
    run's (float64, rel 1e-9); private under ``method="auto"``."""
    model = causal_lm("opt")
    config = DPConfig(clip_norm=0.3, noise_multiplier=0.7, sample_rate=0.1, method="auto") if private else None
    hf_sharded.check_plan(model, lm_loss, _plan(model, _example_prologue(model)), MESH, private, causal=True,
                          config=config)


def test_registration_order_on_opt_is_refused_at_the_first_forward_naming_the_module():
    """Without a prologue the final norm lands on stage 0; the last stage would run it on
    stand-in zeros. It raises instead."""
    model = causal_lm("opt")
    with pytest.raises(PipelinePlanError, match="'model.decoder.final_layer_norm' runs after the block list"):
        hf_sharded.check_plan(model, lm_loss, _plan(model, None), MESH, False, causal=True)


def test_a_traced_prologue_agrees_with_registration_order_where_that_is_right():
    model = gpt2()
    traced = _plan(model, _example_prologue(model)).pipeline.param_stages
    assert traced == _plan(model, None).pipeline.param_stages
    assert traced["transformer.wte.weight"] == (0, 1)  # tied: used before (wte) and after (lm_head)


def test_tracing_leaves_the_model_mode_and_the_random_streams_as_they_were():
    model = causal_lm("opt", dropout=0.5).train()
    model.model.decoder.layers[1].eval()  # a part the user keeps in eval mode stays there
    modes = [m.training for m in model.modules()]
    params = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(3)
    want = torch.rand(4)
    torch.manual_seed(3)
    _example_prologue(model)
    assert [m.training for m in model.modules()] == modes and not model.model.decoder.layers[1].training
    assert torch.equal(torch.rand(4), want)
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())


class _SharedNorm(nn.Module):
    """A norm called both before and after the blocks."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        x = self.norm(x)
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


def test_a_module_on_both_sides_of_the_blocks_is_refused():
    with pytest.raises(PipelinePlanError, match=r"\['norm'\] run both before and after"):
        traced_prologue(_SharedNorm(), "blocks", torch.randn(2, 4))


def test_the_train_loop_traces_the_prologue_of_the_model_it_builds():
    """``fsdpx train --pp 2`` resolves its plan through ``resolve_parallel``, which traces on one of
    the run's inputs (without one, registration order: the runtime's checks then name OPT's
    final norm)."""
    from fsdpx.train.layout import Layout
    from fsdpx.train.parallel import resolve_parallel

    model = causal_lm("opt")
    layout = Layout(strategy="zero3", pp=2, microbatches=2)
    stages = resolve_parallel(layout, model, MESH, torch.ones((1, 4), dtype=torch.long)).plan.pipeline.param_stages
    assert stages["model.decoder.final_layer_norm.bias"] == (1,)
    untraced = resolve_parallel(layout, model, MESH).plan.pipeline.param_stages
    assert untraced["model.decoder.final_layer_norm.bias"] == (0,)


def test_a_stand_in_feeding_the_blocks_is_refused():
    """DeBERTa-v2 reads its relative position embeddings' weight directly (no module call) and
    feeds them to every layer, besides the hidden state: a stage that lacks them cannot compute
    its blocks. Stand-ins are NaN, so its first output is not finite and the step raises, naming
    the parameter, with either side chosen for it (before, with zeros as stand-ins, it trained
    on wrong values without a word)."""
    import transformers

    from support.hf import PAD, VOCAB, cls_loss

    torch.manual_seed(0)
    config = transformers.DebertaV2Config(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                          intermediate_size=24, max_position_embeddings=32, num_labels=3, pad_token_id=PAD,
                                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                          relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"])
    model = transformers.DebertaV2ForSequenceClassification(config).double()
    inputs, _ = padded_batch([3], causal=False)
    for prologue in (None, traced_prologue(model, find_blocks(model), **inputs)):
        mesh = Mesh(dp=1, pp=2)
        plan = resolve_pipeline(model, resolve(model, None, strategies.zero3(), mesh),
                                PipelineParallel(schedule="1f1b", microbatches=2, prologue=prologue), mesh)
        with pytest.raises(PipelinePlanError, match=r"stage 0 .*'deberta.encoder.rel_embeddings.weight'"):
            hf_sharded.check_plan(model, cls_loss, plan, mesh, False, causal=False)


class _BiasPassing(nn.Module):
    """Blocks that hand each other a bias besides the hidden state (as T5's layers hand on their
    position bias): block 0 makes it, the others take it from the block before."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.blocks = nn.ModuleList([_Block(first=i == 0) for i in range(4)])
        self.head = nn.Linear(4, 11)

    def forward(self, ids):
        h, bias = self.embed(ids), None
        for b in self.blocks:
            h, bias = b(h, bias)
        return self.head(h)


class _Block(nn.Module):
    def __init__(self, first: bool):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bias = nn.Parameter(torch.randn(4)) if first else None

    def forward(self, h, bias):
        bias = self.bias if bias is None and self.bias is not None else bias
        return torch.tanh(self.lin(h)) + (bias if bias is not None else 0), bias


def test_blocks_that_pass_state_besides_the_hidden_state_are_refused():
    """A later stage would run its blocks without the bias: ``check_stages`` compares each stage
    run alone with the whole model and names the first that differs; ``fsdpx train`` checks
    before any step (``train.parallel.check_pipeline``). Transformers' T5, its decoder's blocks cut
    into stages, is refused the same way. GPT-2, Llama and OPT pass."""
    import transformers

    from fsdpx.runtime.stages import check_stages
    from fsdpx.train.config import ConfigError
    from fsdpx.train.parallel import check_pipeline
    from support.hf import PAD, VOCAB, llama

    torch.manual_seed(0)
    model, ids = _BiasPassing(), torch.randint(0, 11, (1, 5))
    plan = _plan(model, traced_prologue(model, "blocks", ids))
    with pytest.raises(PipelinePlanError, match="stage 1 .*besides the hidden state"):
        check_stages(model, plan.pipeline, ids)
    with pytest.raises(ConfigError, match="stage 1"):
        check_pipeline(model, plan, ids)

    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_decoder_layers=2, num_heads=2,
        pad_token_id=PAD, decoder_start_token_id=PAD, dropout_rate=0.0)).double()
    inputs, _ = padded_batch([3], causal=True)
    inputs["decoder_input_ids"] = inputs["input_ids"]
    assert find_blocks(t5) == "decoder.block"
    with pytest.raises(PipelinePlanError, match="stage 1"):
        check_stages(t5, _plan(t5, traced_prologue(t5, "decoder.block", **inputs)).pipeline, **inputs)

    for fits in (gpt2(), llama(), causal_lm("opt")):
        inputs, _ = padded_batch([3], causal=True)
        check_stages(fits, _plan(fits, _example_prologue(fits)).pipeline, **inputs)


def _on_meta(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every parameter on ``meta`` (tied ones stay tied), its buffers
    real: what a pipeline rank of a pretrained save builds before it reads its stages."""
    import copy

    meta, made = copy.deepcopy(model), {}
    for module in meta.modules():
        for key, p in module._parameters.items():
            if p is not None:
                module._parameters[key] = made.setdefault(id(p), nn.Parameter(p.to("meta"), requires_grad=False))
    return meta


def test_blocks_that_pass_state_are_refused_on_meta():
    """Every parameter on meta (a pipeline rank that reads only its stages): no value to
    compare, so ``check_stage_links`` finds by identity what a block of one stage hands a block
    of a later one, and refuses the models ``check_stages`` refuses (the bias-passing blocks,
    T5's position bias); ``check_pipeline`` turns it into a ConfigError. GPT-2, Llama and OPT
    pass, and their prologue traced on one-element zeros is the one traced on real values."""
    import transformers

    from fsdpx.runtime.stage_links import check_stage_links, zero_parameters
    from fsdpx.train.config import ConfigError
    from fsdpx.train.parallel import check_pipeline, pipeline_prologue
    from support.hf import PAD, VOCAB, llama

    torch.manual_seed(0)
    model, ids = _BiasPassing(), torch.randint(0, 11, (1, 5))
    plan = _plan(model, traced_prologue(model, "blocks", ids))
    meta = _on_meta(model)
    with zero_parameters(meta, ids.device), pytest.raises(PipelinePlanError, match="stage 1 .*argument 1.*block 0"):
        check_stage_links(meta, plan.pipeline, ids)
    with pytest.raises(ConfigError, match="stage 1 .*besides the hidden state"):
        check_pipeline(meta, plan, ids)
    assert all(p.is_meta for p in meta.parameters())  # the zeros are gone again

    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_decoder_layers=2, num_heads=2,
        pad_token_id=PAD, decoder_start_token_id=PAD, dropout_rate=0.0))
    inputs, _ = padded_batch([3], causal=True)
    inputs["decoder_input_ids"] = inputs["input_ids"]
    plan = _plan(t5, traced_prologue(t5, "decoder.block", **inputs))
    meta = _on_meta(t5)
    with zero_parameters(meta, torch.device("cpu")), pytest.raises(PipelinePlanError, match="stage 1 .*block 0"):
        check_stage_links(meta, plan.pipeline, **inputs)

    for fits in (gpt2(), llama(), causal_lm("opt")):
        example = torch.randint(1, VOCAB, (1, 6))
        meta = _on_meta(fits)
        prologue = pipeline_prologue(meta, example)
        assert prologue == pipeline_prologue(fits, example)
        check_pipeline(meta, _plan(meta, prologue), example)


class _NeedsItsWeights(nn.Module):
    """A forward that reads a parameter's value to decide what to run (zeros make it fail)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        x = x / self.scale if bool(self.scale != 0) else torch.full((), float("nan")).log().item()
        for b in self.blocks:
            x = b(x)
        return x


def test_a_meta_model_whose_forward_fails_on_zeros_is_refused_naming_pp():
    """A pipeline rank's model on meta is cut and checked on one-element zeros; a forward that
    cannot run on them is a ConfigError naming ``--pp`` and the error, not a traceback."""
    from fsdpx.train.config import ConfigError
    from fsdpx.train.parallel import pipeline_prologue

    meta = _on_meta(_NeedsItsWeights())
    with pytest.raises(ConfigError, match=r"--pp: _NeedsItsWeights's forward does not run with its parameters as zeros"):
        pipeline_prologue(meta, torch.randn(1, 4))
    assert pipeline_prologue(_NeedsItsWeights(), torch.randn(1, 4)) == ()  # real values: it runs
