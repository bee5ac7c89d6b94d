"""Fine-tune what users bring (issue 29, items 1 and 7): a transformers save (safetensors, whole or
sharded) is the run's starting point under every layout, each rank reading only its blocks; a
pickled file or keys that do not match are refused by name; the end's sample never fails a run.

Tiny GPT-2 and Llama models are saved with ``save_pretrained`` into ``tmp_path`` (nothing is
downloaded). A run with ``--lr 0 --non-private`` must keep exactly the saved weights (read back
from its last checkpoint), and its first loss must be the one transformers' own
``from_pretrained`` model gives on the same batch: that proves loading, not initialisation.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_leaves

from fsdpx.sharding.layout import local_box
from fsdpx.train import ConfigError, Layout, RunConfig
from fsdpx.train import data
from fsdpx.train.cli import main
from fsdpx.train.parallel import resolve_plan
from fsdpx.train.pretrained import (PickleWeightsError, WeightKeysError, find_weights, parameters_on_meta,
                                    read_block)

from support.finetune import ROOT, SMALL, tiny  # a tiny tied GPT-2 and a Llama


def save(model, path: Path, **kwargs) -> Path:
    model.save_pretrained(str(path), **kwargs)
    return path


def saved_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a save, whole (the test's own reading, by safetensors' load_file)."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def trained_params(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """The parameters of a run's last checkpoint, whole, in one process."""
    from fsdpx.train.resume import resume_from

    last = max(ckpt_dir.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    state, _ = resume_from(last)
    return state.params


def first_batch_loss(model_path: Path) -> float:
    """transformers' ``from_pretrained`` model's mean loss on the run's first Poisson batch."""
    import transformers
    from privacy.sampling import PoissonSampler
    from privacy.step import sample_batch

    from fsdpx.train.build import resolve_sample_rate
    from fsdpx.train.sources import build_source, lm_loss

    config = RunConfig.of(model="transformers", model_path=str(model_path), corpus_chars=2000, block_size=8,
                          batch_size=8.0, private=False, lr=0.0, steps=2)
    source = build_source(config, read="none")
    rate = resolve_sample_rate(config, len(source.inputs))
    x, y = sample_batch((source.inputs, source.targets), PoissonSampler(len(source.inputs), rate, key=0), 0)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_path), local_files_only=True,
                                                              dtype=torch.float32)
    with torch.no_grad():
        return float(lm_loss(model(x), y).mean())


def cli(args: list[str], nproc: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    extra = ["--nproc", str(nproc)] if nproc else []
    return subprocess.run([sys.executable, "-m", "fsdpx", "train", *args, *extra], env=env, capture_output=True,
                          text=True, timeout=600)


def errors(capsys) -> list[str]:
    """The error lines the CLI printed (the run's announcement line aside)."""
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("fsdpx train: error")]


def assert_keeps(run_dir: Path, ckpt_dir: Path, model_path: Path) -> None:
    saved = saved_tensors(model_path)
    params = trained_params(ckpt_dir)
    assert set(params) <= set(saved) and len(params) >= len(saved) - 1  # a tied head is absent from both
    for name, value in params.items():
        assert torch.equal(value, saved[name].float()), name
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] == pytest.approx(first_batch_loss(model_path), rel=1e-5)


@pytest.mark.parametrize("family, how", [("gpt2", "one file"), ("llama", "sharded"), ("llama", "bf16")])
def test_a_run_with_lr_0_keeps_the_saved_weights(tmp_path, family, how):
    """One process, through the CLI: the parameters after 2 steps at lr 0 are the file's (a bf16
    file cast to fp32), and the first loss is transformers' from_pretrained model's."""
    model = tiny(family)
    if how == "bf16":
        model = model.to(torch.bfloat16)
    kwargs = {"max_shard_size": "4KB"} if how == "sharded" else {}
    path = save(model, tmp_path / "model", **kwargs)
    if how == "sharded":
        assert (path / "model.safetensors.index.json").is_file()
    run = ["--model", "transformers", "--model-path", str(path), "--lr", "0", "--non-private", "--steps", "2",
           "--out", str(tmp_path / "runs"), "--name", "ft", "--ckpt-dir", str(tmp_path / "ckpt"), *SMALL]
    main(["train", *run])
    assert_keeps(tmp_path / "runs" / "ft", tmp_path / "ckpt", path)
    derived = json.loads((tmp_path / "runs" / "ft" / "config.json").read_text())["derived"]
    assert derived["model"].endswith(f"(weights of {path}" + (", BF16 cast to fp32)" if how == "bf16" else ")"))


def test_a_config_file_names_the_model_directory(tmp_path):
    """``[model] path`` in a TOML file loads the weights as the flag does."""
    path = save(tiny("gpt2"), tmp_path / "model")
    toml = tmp_path / "run.toml"
    toml.write_text(f'[model]\nkind = "transformers"\npath = "{path}"\n[run]\nsteps = 2\nlr = 0.0\n'
                    '[privacy]\nprivate = false\n')
    main(["train", "--config", str(toml), "--out", str(tmp_path / "runs"), "--name", "ft", "--ckpt-dir",
          str(tmp_path / "ckpt"), *SMALL])
    assert_keeps(tmp_path / "runs" / "ft", tmp_path / "ckpt", path)


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", [("gpt2", ["--strategy", "zero3"]),
                                            ("llama", ["--strategy", "zero2", "--tp", "2"]),
                                            ("gpt2", ["--strategy", "ddp", "--pp", "2", "--microbatches", "2"])],
                         ids=["zero3", "tp2", "pp2"])
def test_a_sharded_run_with_lr_0_keeps_the_saved_weights(tmp_path, family, layout):
    """Two gloo processes under torchrun: each rank reads its blocks (ZeRO-3, tp) or, in a
    pipeline, its stage's tensors; the run keeps the file's weights and starts at its loss."""
    path = save(tiny(family), tmp_path / "model", max_shard_size="4KB")
    done = cli(["--model", "transformers", "--model-path", str(path), "--lr", "0", "--non-private", "--steps", "2",
                "--out", str(tmp_path / "runs"), "--name", "ft", "--ckpt-dir", str(tmp_path / "ckpt"), *SMALL,
                *layout], nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_keeps(tmp_path / "runs" / "ft", tmp_path / "ckpt", path)


@pytest.mark.slow
def test_a_sharded_fine_tune_resumes_from_its_checkpoint(tmp_path):
    """ZeRO-3 on 2 processes, private: 2 steps from the file, then a resume to 3 continues from
    the checkpoint (the ranks read their blocks, then the checkpoint replaces them)."""
    path = save(tiny("gpt2"), tmp_path / "model")
    run = ["--model", "transformers", "--model-path", str(path), "--steps", "2", "--out", str(tmp_path / "runs"),
           "--name", "ft", "--ckpt-dir", str(tmp_path / "ckpt"), "--strategy", "zero3", *SMALL]
    first = cli(run, nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    again = cli([*run, "--steps", "3", "--resume"], nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming at step 2" in again.stderr
    steps = [json.loads(line)["step"] for line in (tmp_path / "runs" / "ft" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


@pytest.mark.parametrize("layout", [[], ["--strategy", "zero3", "--nproc", "2"]], ids=["one", "launcher"])
def test_pickled_weights_are_refused_by_name(tmp_path, capsys, layout):
    """A ``pytorch_model.bin`` alone: exit 2, one line naming the file and how to convert it, in
    one process and in the launcher before torchrun starts."""
    model, path = tiny("gpt2"), tmp_path / "model"
    model.config.save_pretrained(str(path))  # transformers 5 saves no pickle: written as older releases did
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--model", "transformers", "--model-path", str(path), "--non-private", "--steps", "1",
              "--out", str(tmp_path / "runs"), *SMALL, *layout])
    assert exit_.value.code == 2
    err = errors(capsys)
    assert len(err) == 1 and "pytorch_model.bin" in err[0] and "safe_serialization=True" in err[0], err
    with pytest.raises(PickleWeightsError):
        find_weights(path)
    assert not (tmp_path / "runs").exists()


def test_a_missing_and_an_unexpected_key_are_named(tmp_path, capsys):
    """A file without one parameter and with a stray tensor: exit 2, both keys named; more than
    three of a kind are counted ("and N more")."""
    from safetensors.torch import save_file

    path = save(tiny("llama"), tmp_path / "model")
    tensors = saved_tensors(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.7.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--model", "transformers", "--model-path", str(path), "--non-private", "--steps", "1",
              "--out", str(tmp_path / "runs"), *SMALL])
    assert exit_.value.code == 2
    err = errors(capsys)
    assert len(err) == 1, err
    assert "1 missing from the file: model.layers.1.mlp.up_proj.weight" in err[0]
    assert "1 in the file but not in the model: model.layers.7.extra.weight" in err[0]

    for i in range(5):
        tensors[f"stray.{i}"] = torch.zeros(1)
    tensors["model.norm.weight"] = torch.zeros(3)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightKeysError, match=r"6 in the file but not in the model: .* and 3 more; 1 of another shape:"
                                              r" model.norm.weight \(file \[3\], model \[16\]\)"):
        from fsdpx.train.sources import build_source
        build_source(RunConfig.of(model="transformers", model_path=str(path), corpus_chars=2000, block_size=8))


def test_a_base_models_save_loads_and_old_masks_are_ignored(tmp_path):
    """The hub's GPT-2 layout: a ``GPT2Model`` save (no ``transformer.`` prefix), with the
    ``attn.bias`` masks older releases stored, loads into the causal LM (head tied to ``wte``)."""
    import transformers
    from safetensors.torch import save_file

    from fsdpx.train.sources import build_source

    lm = tiny("gpt2")
    path = tmp_path / "model"
    lm.config.save_pretrained(str(path))
    base = {k: v.contiguous() for k, v in lm.transformer.state_dict().items()}
    save_file({**base, "h.0.attn.bias": torch.ones(1, 1, 16, 16)}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    source = build_source(RunConfig.of(model="transformers", model_path=str(path), corpus_chars=2000, block_size=8))
    assert isinstance(source.model, transformers.GPT2LMHeadModel)
    assert set(source.params) == {f"transformer.{k}" for k in base}
    assert all(torch.equal(v, base[k.removeprefix("transformer.")]) for k, v in source.params.items())
    assert source.model.lm_head.weight is source.model.transformer.wte.weight


def test_a_meta_build_draws_nothing(tmp_path):
    """The model of a save is built with its parameters on meta (its buffers real) and nothing
    is drawn from torch's generator; reading the weights whole gives the file's tensors."""
    from fsdpx.train.sources import build_source

    path = save(tiny("llama"), tmp_path / "model")
    config = RunConfig.of(model="transformers", model_path=str(path), corpus_chars=2000, block_size=8)
    before = torch.random.get_rng_state()
    with parameters_on_meta():
        import transformers
        transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(str(path)))
    assert torch.equal(before, torch.random.get_rng_state())
    lazy = build_source(config, read="none")
    assert all(p.is_meta for p in lazy.model.parameters()) and not any(b.is_meta for b in lazy.model.buffers())
    whole = build_source(config)
    saved = saved_tensors(path)
    assert all(torch.equal(v, saved[k]) for k, v in whole.params.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_blocks_equal_blocks_of_the_whole_tensor(tmp_path, dtype):
    """Every box (empty ones too) of a tensor, and of a fused view, read by slices equals the same
    box of the whole tensor cast to fp32, bit for bit."""
    from safetensors.torch import save_file

    whole = torch.randn(6, 5).to(dtype)
    save_file({"w": whole}, str(tmp_path / "model.safetensors"))
    weights = find_weights(tmp_path)
    spans = [(a, b) for a in range(7) for b in range(a, 7)]
    for rows, cols in itertools.product(spans, [(0, 5), (1, 4), (2, 2)]):
        got = read_block(weights, "w", (rows, cols))
        assert torch.equal(got, whole[rows[0]:rows[1], cols[0]:cols[1]].float())
    view = whole.view(3, 2, 5)  # dim 0 as (3 groups, 2 rows): q | k | v
    for groups, within in itertools.product([(0, 3), (1, 3), (0, 1), (2, 2)], [(0, 2), (1, 2), (0, 1)]):
        box = (groups, within, (1, 5))
        got = read_block(weights, "w", box, fused=(0, 3))
        assert torch.equal(got, view[slice(*groups), slice(*within), 1:5].float())


def test_a_block_owns_its_bytes_and_not_the_file_s(tmp_path):
    """A block read from the file (a rank's slice, or a whole tensor) holds exactly its own
    bytes, not a view into the file's memory map: a rank's resident state is its blocks, and a
    file rewritten (here: truncated to nothing) after the read changes nothing it read."""
    from safetensors.torch import save_file

    whole = torch.randn(64, 32)
    path = tmp_path / "model.safetensors"
    save_file({"w": whole}, str(path))
    weights = find_weights(tmp_path)
    block, full = read_block(weights, "w", ((8, 16), (0, 32))), read_block(weights, "w")
    for t in (block, full):
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    path.write_bytes(b"")
    assert torch.equal(block, whole[8:16]) and torch.equal(full, whole)


class Rank:
    """The part of a communicator ``init_sharded`` reads."""

    def __init__(self, mesh, rank):
        self.mesh, self.rank = mesh, rank


LAYOUTS = {"ddp": (Layout("ddp"), 2), "zero1": (Layout("zero1"), 3), "zero2": (Layout("zero2"), 2),
           "zero3": (Layout("zero3"), 3), "hsdp": (Layout("hsdp"), 4), "tp2": (Layout("zero3", tp=2), 4),
           "pp2": (Layout("ddp", pp=2), 2), "3d": (Layout("zero3", tp=2, pp=2), 8)}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_blocks_read_by_each_rank_equal_the_sharded_whole_model(tmp_path, family, name):
    """Property, every layout: the state a rank builds from the blocks it reads (parameters on
    meta) equals the state cut from the fully loaded model, parameters and optimizer state."""
    from fsdpx.optim import Optimizer, adamw
    from fsdpx.runtime import init_sharded
    from fsdpx.train.build import rank_reader
    from fsdpx.train.sources import build_source

    path = save(tiny(family).to(torch.bfloat16), tmp_path / "model", max_shard_size="4KB")
    config = RunConfig.of(model="transformers", model_path=str(path), corpus_chars=2000, block_size=8)
    whole, lazy = build_source(config), build_source(config, read="blocks")
    layout, world = LAYOUTS[name]
    mesh = layout.mesh(world)
    plan = resolve_plan(lazy.model, mesh, layout)
    read = rank_reader(lazy.model, lazy.params, lazy.weights, None)
    assert read is not None and rank_reader(whole.model, whole.params, whole.weights, None) is None
    boxes = set()
    keep = Optimizer(init=lambda at_opt: {k: v.clone() for k, v in at_opt.items()}, update=None)  # the values
    for rank, optimizer in itertools.product(range(world), [adamw(1e-3), keep]):
        want = init_sharded(whole.params, optimizer, plan, Rank(mesh, rank), key=0)
        got = init_sharded(lazy.params, optimizer, plan, Rank(mesh, rank), key=0, read=read)
        assert want.params.keys() == got.params.keys()
        for k in want.params:
            assert torch.equal(want.params[k], got.params[k]), (rank, k)
        leaves = zip(tree_leaves(want.opt_state), tree_leaves(got.opt_state), strict=True)
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in leaves)
        boxes |= {(k, local_box(plan.params[k].shape, plan.params[k].at_rest, mesh, rank)) for k in got.params}
    if name in ("zero3", "hsdp", "tp2", "3d"):  # somebody holds a part, never the whole, of some tensor
        assert any(b != tuple((0, n) for n in plan.params[k].shape) for k, b in boxes)


def test_an_optimizer_that_keeps_its_input_gets_a_copy(tmp_path):
    """A DDP rank's optimizer-state block is a view of its block at rest (no second copy of the
    whole parameters while loading); an optimizer whose ``init`` keeps what it is given (here:
    the tensors themselves) gets copies, equal in value, sharing no memory with the parameters
    the step updates in place."""
    from fsdpx.optim import Optimizer
    from fsdpx.runtime import init_sharded
    from fsdpx.train.build import rank_reader
    from fsdpx.train.sources import build_source

    path = save(tiny("gpt2"), tmp_path / "model")
    lazy = build_source(RunConfig.of(model="transformers", model_path=str(path), corpus_chars=2000, block_size=8),
                        read="blocks")
    layout = Layout("ddp")
    mesh = layout.mesh(2)
    plan = resolve_plan(lazy.model, mesh, layout)
    keep = Optimizer(init=lambda at_opt: {"kept": dict(at_opt)}, update=None)
    state = init_sharded(lazy.params, keep, plan, Rank(mesh, 1), key=0,
                         read=rank_reader(lazy.model, lazy.params, lazy.weights, None))
    storages = {p.untyped_storage().data_ptr() for p in state.params.values()}
    for name, kept in state.opt_state["kept"].items():
        assert torch.equal(kept, state.params[name]) and kept.untyped_storage().data_ptr() not in storages, name


def test_a_vocabulary_larger_than_the_alphabet_samples_and_finishes(tmp_path, capsys):
    """Item 7: a Llama of 256 ids on the embedded corpus (69 characters) samples ids the
    alphabet lacks; they are written U+FFFD and the run finishes (it raised IndexError)."""
    assert data.decode([data.VOCAB_SIZE, 0, 300]) == data.UNKNOWN + data.ALPHABET[0] + data.UNKNOWN
    main(["train", "--model", "transformers", "--model-class", "LlamaForCausalLM", "--model-fields",
          "hidden_size = 16, intermediate_size = 24, num_hidden_layers = 1, num_attention_heads = 2,"
          " num_key_value_heads = 2, vocab_size = 256", "--steps", "2", "--non-private",
          "--out", str(tmp_path / "runs"), "--name", "v256", *SMALL])
    assert "sample" in capsys.readouterr().out

    from fsdpx.train.sources import build_source, sample_text

    source = build_source(RunConfig.of(corpus_chars=2000, block_size=8, n_layer=1, n_embd=8, n_head=2))
    broken = source._replace(params={k: v[:1] for k, v in source.params.items()})  # shapes no forward takes
    assert sample_text(broken, broken.params, 5, seed=0).startswith("(no sample: ")


def test_a_config_directory_alone_still_starts_from_the_seed(tmp_path):
    """No weights beside config.json: no loading, the seeded init of before (nothing on meta)."""
    from fsdpx.train.sources import build_source

    path = tmp_path / "model"
    tiny("gpt2").config.save_pretrained(str(path))
    source = build_source(RunConfig.of(model="transformers", model_path=str(path), corpus_chars=2000, block_size=8))
    assert source.weights is None and not any(p.is_meta for p in source.params.values())
    with pytest.raises(ConfigError):
        build_source(RunConfig.of(model="transformers", model_path=str(tmp_path / "nowhere"), corpus_chars=2000))
