"""``fsdpx train --config run.toml``: one file for the run, flags over it, and the model and data a
researcher brings (a transformers model from a local config, a text file with a tokenizer built
here, ``.npy``/``.bin`` token files, a ``datasets`` dataset saved on disk). Nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from fsdpx.models.gpt import GPT
from fsdpx.train import RunConfig, cli, data
from fsdpx.train.config import ConfigError, ConfigFileError, parse, read_file, to_toml
from fsdpx.train.build import check_layout
from fsdpx.train.segments import DataChangeError
from fsdpx.train.sources import VocabularyError, build_source

transformers = pytest.importorskip("transformers")

TEXT = data.corpus(6000, seed=7)
GPT2 = {"model_type": "gpt2", "vocab_size": 256, "n_positions": 16, "n_embd": 8, "n_layer": 1, "n_head": 2,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": True,
        "bos_token_id": 0, "eos_token_id": 0}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A text file, a word-level tokenizer trained on it here (saved as a user saves one), and a
    tiny GPT-2 config directory, as a researcher brings them."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("own")
    (root / "notes.txt").write_text(TEXT)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([TEXT], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(root / "tok")
    (root / "gpt2").mkdir()
    (root / "gpt2" / "config.json").write_text(json.dumps(GPT2))
    return {"text": root / "notes.txt", "tokenizer": root / "tok", "gpt2": root / "gpt2", "root": root}


def _toml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _config(argv: list[str]) -> RunConfig:
    """The RunConfig ``fsdpx train <argv>`` resolves (the CLI's own path, without training)."""
    parser = cli.build_parser()
    args = parser.parse_args(["train", *argv])
    file = read_file(args.config, checks=cli.file_checks(args.command_parser)) if args.config else {}
    return cli.config_from_args(args, cli.explicit_flags(["train", *argv]), file)


# --------------------------------------------------------------------------- the file and the flags


def test_flags_typed_on_the_command_line_override_the_file_and_the_file_overrides_defaults(tmp_path):
    path = _toml(tmp_path / "run.toml", """
steps = 7
lr = 0.003
[model]
n_layer = 3
[data]
block_size = 12
[privacy]
noise_multiplier = 1.5
sample_rate = 0.1
[offload]
kind = "zenflow"
topk = 0.25
[checkpoints]
every = 5
""")
    from_file = _config(["--config", str(path)])
    f = from_file.flat()
    assert (f["steps"], f["lr"], f["n_layer"], f["block_size"]) == (7, 0.003, 3, 12)
    assert (f["noise_multiplier"], f["target_epsilon"], f["sample_rate"]) == (1.5, None, 0.1)
    assert (from_file.offload.kind, from_file.offload.offload_topk, from_file.checkpoints.ckpt_every) == \
        ("zenflow", 0.25, 5)
    assert from_file.model.n_embd == RunConfig().model.n_embd and from_file.config_file == str(path.resolve())
    # a flag wins over the file; the other half of an exclusive pair in the file is dropped
    flagged = _config(["--config", str(path), "--steps", "9", "--target-epsilon", "3", "--batch-size", "20",
                       "--offload-topk", "0.5"])
    assert (flagged.run.steps, flagged.run.lr, flagged.model.n_layer) == (9, 0.003, 3)
    assert (flagged.privacy.target_epsilon, flagged.privacy.noise_multiplier) == (3.0, None)
    assert (flagged.privacy.batch_size, flagged.privacy.sample_rate) == (20.0, None)
    assert (flagged.offload.kind, flagged.offload.offload_topk) == ("zenflow", 0.5)
    # a flag left at its default does not override the file
    assert _config(["--config", str(path), "--n-layer", "2"]).model.n_layer == 2
    assert _config(["--config", str(path), "--lr", "0.01"]).run.lr == 0.01
    # without a file, the flags alone (today's command line)
    assert _config(["--steps", "4"]) == RunConfig.of(steps=4)


def test_full_field_names_work_in_their_section_and_top_level_keys_are_the_run_section(tmp_path):
    short = _config(["--config", str(_toml(tmp_path / "a.toml", "[offload]\nkind = 'zero'\n[logging]\nname = 'x'"))])
    full = _config(["--config", str(_toml(tmp_path / "b.toml", "[offload]\noffload = 'zero'\n[run]\nseed = 2"))])
    assert (short.offload.kind, short.logging.name, full.offload.kind, full.run.seed) == ("zero", "x", "zero", 2)


@pytest.mark.parametrize("text, message", [
    ("[model]\nn_layers = 2", "unknown key [model] n_layers; did you mean n_layer?"),
    ("[modle]\nn_layer = 2", "unknown section [modle]; did you mean model?"),
    ("[model]\nsteps = 2", "[model] steps belongs in [run]"),
    ("strategy = 'zero2'", "strategy belongs in [parallelism]"),
    ("stepz = 2", "unknown key stepz; did you mean steps?"),
    ("[run]\nsteps = '10'", "steps must be an integer, got '10'"),
    ("[privacy]\nclip_norm = true", "[privacy] clip_norm must be a number, got True"),
    ("[privacy]\nprivate = 1", "[privacy] private must be true or false, got 1"),
    ("[model]\nfields = 3", "[model] fields must be a table, got 3"),
    ("[run]\nsteps = 0", "[run] steps: must be an integer >= 1, got 0"),
    ("[privacy]\ndelta = 2", "[privacy] delta: must be in (0, 1), got 2"),
    ("[privacy]\nmethod = 'magic'", "[privacy] method: invalid choice 'magic'"),
    ("[parallelism]\nstrategy = 'zero9'", "invalid choice 'zero9'"),
    ("[offload]\nkind = 'zenflow'\noffload = 'zero'", "sets offload a second time"),
    ("model = 3", "model belongs in [model]"),
    ("logging = 3", "logging must be a table: [logging]"),
    ("[data\npath = 'x'", "not valid TOML"),
    ("[model]\nkind = 'transformers'", "a transformers model needs one of [model] path"),
    ("[privacy]\nbuffers = 2", "--buffers 2 is for --noise-mechanism blt, not 'independent'"),
    ("[privacy]\nnoise_mechanism = 'blt'\nbuffers = 0", "[privacy] buffers: must be an integer >= 1, got 0"),
    ("[model]\nclass = 'GPT2Config'",
     "[model] class describe a transformers model: add [model] kind = \"transformers\""),
])
def test_a_bad_config_file_is_one_named_error_and_exit_2(tmp_path, capsys, text, message):
    path = _toml(tmp_path / "run.toml", text)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--config", str(path), "--out", str(tmp_path / "runs")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert err.count("\n") == 1 and "fsdpx train: error:" in err
    assert not (tmp_path / "runs").exists()


def test_a_missing_config_file_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--config", str(tmp_path / "nope.toml")])
    assert "cannot read config file" in capsys.readouterr().err


@pytest.mark.parametrize("config", [
    RunConfig(),
    RunConfig.of(steps=5, noise_multiplier=1.25, sample_rate=0.03, offload="zenflow", ckpt_dir="ck", name="x"),
    RunConfig.of(target_epsilon=2.0, noise_mechanism="blt", buffers=2, min_separation=3),
    RunConfig.of(private=False, model="transformers", model_class="GPT2Config",
              model_fields={"n_embd": 8, "n_head": 2, "layer_norm_epsilon": 1e-6, "architectures": ["GPT2LMHeadModel"],
                            "nested": {"a b": "c\"d"}}, data_path="notes.txt", tokenizer="bytes"),
])
def test_the_resolved_file_reads_back_as_the_same_config(config):
    assert RunConfig.of(**parse(tomllib.loads(to_toml(config)))) == config


def test_a_run_from_a_file_writes_the_resolved_file_and_the_file_path(tmp_path):
    path = _toml(tmp_path / "run.toml", f"""
steps = 2
[model]
n_layer = 1
n_embd = 16
n_head = 2
[data]
block_size = 16
corpus_chars = 20000
[privacy]
batch_size = 16
target_epsilon = 4
[logging]
out = "{tmp_path / 'runs'}"
name = "from-file"
progress = false
""")
    cli.main(["train", "--config", str(path), "--steps", "3"])
    run_dir = tmp_path / "runs" / "from-file"
    assert [r["step"] for r in _metrics(run_dir)] == [1, 2, 3]
    written = json.loads((run_dir / "config.json").read_text())
    assert written["config_file"] == str(path.resolve()) and written["run"]["steps"] == 3
    assert written["derived"]["model"] == "GPT 1x16" and "embedded corpus" in written["derived"]["data"]
    resolved = RunConfig.of(**read_file(run_dir / "config.toml"), config_file=str(path.resolve()))
    assert resolved == _config(["--config", str(path), "--steps", "3"])
    assert f"# read from {path.resolve()}" in (run_dir / "config.toml").read_text()


# --------------------------------------------------------------------------- models and data


def test_the_default_source_is_the_corpus_and_gpt_of_before():
    """Runs and checkpoints from before config files continue bit for bit."""
    config = RunConfig.of(n_layer=1, n_embd=16, n_head=2, corpus_chars=5000, seed=3)
    source = build_source(config)
    inputs, targets = data.make_examples(data.corpus(5000), config.data.block_size)
    assert torch.equal(source.inputs, inputs) and torch.equal(source.targets, targets)
    torch.manual_seed(3)
    model = GPT(config.model_config())
    assert source.params.keys() == dict(model.named_parameters()).keys()
    assert all(torch.equal(source.params[k], v) for k, v in model.named_parameters())


def test_a_transformers_model_from_a_local_config_is_the_users_model_seeded(files):
    config = RunConfig.of(model="transformers", model_path=str(files["gpt2"]), data_path=str(files["text"]),
                       tokenizer=str(files["tokenizer"]), block_size=8, seed=5)
    source = build_source(config)
    assert type(source.model) is transformers.GPT2LMHeadModel  # unmodified: no wrapper
    assert source.model.lm_head.weight is source.model.transformer.wte.weight
    torch.manual_seed(5)
    mine = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(files["gpt2"]))
    assert all(torch.equal(source.params[k], v) for k, v in mine.named_parameters())
    tok = transformers.AutoTokenizer.from_pretrained(files["tokenizer"])
    ids = torch.tensor(tok(TEXT, add_special_tokens=False)["input_ids"])
    assert torch.equal(source.inputs, data.windows(ids, 8)[0]) and torch.equal(source.targets, data.windows(ids, 8)[1])
    # the config file's own path works too, and by class name + fields gives the same model
    same = build_source(config.replace(model_path=str(files["gpt2"] / "config.json")))
    assert all(torch.equal(same.params[k], v) for k, v in source.params.items())
    fields = {k: v for k, v in GPT2.items() if k != "model_type"}
    by_class = build_source(config.replace(model_path=None, model_class="GPT2Config", model_fields=fields))
    assert all(torch.equal(by_class.params[k], v) for k, v in source.params.items())


def test_a_llama_by_model_class_and_fields(files):
    fields = {"vocab_size": 300, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}
    source = build_source(RunConfig.of(model="transformers", model_class="LlamaForCausalLM", model_fields=fields,
                                    data_path=str(files["text"]), block_size=16))
    assert type(source.model) is transformers.LlamaForCausalLM and source.vocab_size == 300
    assert source.loss_fn(source.model(source.inputs[:3]), source.targets[:3]).shape == (3,)


def test_token_files_npy_and_bin_are_cut_into_the_same_examples(tmp_path):
    ids = np.random.default_rng(0).integers(0, 500, 2001).astype(np.uint16)
    np.save(tmp_path / "t.npy", ids)
    ids.tofile(tmp_path / "t.bin")
    ids.astype(np.int32).tofile(tmp_path / "t32.bin")
    want = data.windows(torch.from_numpy(ids.astype(np.int64)), 16)
    for path, dtype in (("t.npy", "uint16"), ("t.bin", "uint16"), ("t32.bin", "int32")):
        source = build_source(RunConfig.of(data_path=str(tmp_path / path), data_dtype=dtype, block_size=16,
                                        n_layer=1, n_embd=8, n_head=2))
        assert torch.equal(source.inputs[:], want[0]) and torch.equal(source.targets[:], want[1]), path
        assert source.inputs.shape == want[0].shape and source.inputs.shape[0] == len(source.targets)
        assert source.vocab_size == int(ids.max()) + 1  # the built-in GPT sized to the data
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 5)
    with pytest.raises(ConfigError, match="not a whole number of uint16 tokens"):
        build_source(RunConfig.of(data_path=str(tmp_path / "odd.bin")))
    np.save(tmp_path / "f.npy", np.zeros((4, 4), np.float32))
    with pytest.raises(ConfigError, match="1-D of integers"):
        build_source(RunConfig.of(data_path=str(tmp_path / "f.npy")))


def test_a_saved_datasets_dataset_by_text_or_token_column(tmp_path, files):
    datasets = pytest.importorskip("datasets")
    lines = TEXT.splitlines()
    datasets.Dataset.from_dict({"text": lines}).save_to_disk(str(tmp_path / "text"))
    source = build_source(RunConfig.of(data_path=str(tmp_path / "text"), block_size=16, tokenizer=str(files["tokenizer"])))
    tok = transformers.AutoTokenizer.from_pretrained(files["tokenizer"])
    ids = torch.tensor(tok("\n".join(lines), add_special_tokens=False)["input_ids"])
    assert torch.equal(source.inputs, data.windows(ids, 16)[0])
    rows = [[i % 50, (3 * i) % 50, 7] for i in range(300)]
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": rows, "n": list(range(300))}),
                                   "test": datasets.Dataset.from_dict({"input_ids": rows[:10], "n": [0] * 10})})
    splits.save_to_disk(str(tmp_path / "ids"))
    source = build_source(RunConfig.of(data_path=str(tmp_path / "ids"), block_size=8))
    flat = torch.tensor([t for r in rows for t in r])
    assert torch.equal(source.inputs[:], data.windows(flat, 8)[0]) and source.vocab_size == 50
    with pytest.raises(ConfigError, match=r"has splits \['test', 'train'\], not data_split 'valid'"):
        build_source(RunConfig.of(data_path=str(tmp_path / "ids"), data_split="valid"))
    with pytest.raises(ConfigError, match="has columns"):
        build_source(RunConfig.of(data_path=str(tmp_path / "ids"), data_column="label"))


def test_a_vocabulary_that_does_not_cover_the_data_is_a_named_error(tmp_path, files, capsys):
    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({**GPT2, "vocab_size": 50}))
    with pytest.raises(VocabularyError, match="holds token id 1[0-9]{2}, but the model's vocabulary has 50 ids"):
        build_source(RunConfig.of(model="transformers", model_path=str(small), data_path=str(files["text"])))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--data-path", str(files["text"]), "--vocab-size", "100", "--out", str(tmp_path / "r")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "give the model a --vocab-size of at least" in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("config, message", [
    (dict(data_path="/nonexistent/x.txt"), "does not exist"),
    (dict(data_path="{text}", tokenizer="gpt2"), "nothing is downloaded"),
    (dict(model="transformers", model_path="/nonexistent"), "no config.json there"),
    (dict(model="transformers", model_class="NotAClass"), "neither a transformers config class"),
    (dict(model="transformers", model_path="{gpt2}", block_size=32), "block_size 32 exceeds the model's 16 positions"),
    (dict(data_path="{text}", block_size=8000), "give no example of block_size 8000"),
])
def test_sources_that_cannot_be_built_are_named(files, config, message):
    config = {k: v.format(**files) if isinstance(v, str) else v for k, v in config.items()}
    with pytest.raises(ConfigError, match=message):
        build_source(RunConfig.of(**config))


def test_tensor_parallelism_of_a_transformers_model_without_a_plan_is_refused_before_launch(files):
    bloom = RunConfig.of(model="transformers", model_class="BloomConfig", strategy="zero3", tp=2,
                      model_fields={"vocab_size": 300, "hidden_size": 8, "n_layer": 1, "n_head": 2},
                      data_path=str(files["text"]), block_size=8)
    with pytest.raises(ConfigError, match="no tensor-parallel plan for BloomForCausalLM"):
        check_layout(bloom, 4)
    gpt2 = RunConfig.of(model="transformers", model_path=str(files["gpt2"]), strategy="zero3", tp=2,
                     model_fields={"n_head": 1}, data_path=str(files["text"]), tokenizer=str(files["tokenizer"]),
                     block_size=8)
    with pytest.raises(ConfigError, match="n_head=1 does not divide by tp=2"):
        check_layout(gpt2, 4)
    check_layout(gpt2.replace(model_fields=None), 4)  # the GPT-2 plan applies


def test_new_data_on_resume_is_named_unless_allowed(tmp_path, files):
    other = tmp_path / "other.txt"
    other.write_text(data.corpus(6000, seed=8))
    base = dict(out=str(tmp_path), name="r", n_layer=1, n_embd=8, n_head=1, block_size=8, batch_size=16.0,
                noise_multiplier=1.0, ckpt_dir=str(tmp_path / "ck"), ckpt_every=1, data_path=str(files["text"]))
    from fsdpx.train import run

    run(RunConfig.of(**base, steps=1), progress=False)
    with pytest.raises(DataChangeError, match=r"text .*notes.txt, bytes -> text .*other.txt, bytes"):
        run(RunConfig.of(**{**base, "data_path": str(other)}, steps=2, resume=True), progress=False)
    resumed = run(RunConfig.of(**{**base, "data_path": str(other)}, steps=2, resume=True, allow_new_data=True),
                  progress=False)
    assert resumed["steps"] == 2


# --------------------------------------------------------------------------- transformers runs, end to end


def _hf_run_file(tmp_path: Path, files: dict[str, Path]) -> Path:
    return _toml(tmp_path / "run.toml", f"""
steps = 3
seed = 1
[model]
kind = "transformers"
path = "{files['gpt2']}"
[data]
path = "{files['text']}"
tokenizer = "{files['tokenizer']}"
block_size = 8
[privacy]
batch_size = 24
target_epsilon = 4
[logging]
progress = false
""")


def test_a_transformers_gpt2_trains_privately_from_a_config_file(tmp_path, files, capsys):
    path = _hf_run_file(tmp_path, files)
    cli.main(["train", "--config", str(path), "--out", str(tmp_path / "runs")])
    rows = _metrics(tmp_path / "runs" / "private")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["mean_norm"] > 0 for r in rows)
    assert 0 < rows[-1]["epsilon"] <= 4.0
    derived = json.loads((tmp_path / "runs" / "private" / "config.json").read_text())["derived"]
    assert derived["model"] == "GPT2LMHeadModel" and derived["vocab_size"] == 256
    assert derived["num_params"] == sum(p.numel() for p in transformers.GPT2LMHeadModel(
        transformers.AutoConfig.from_pretrained(files["gpt2"])).parameters())
    assert "transformers" in capsys.readouterr().err


@pytest.mark.slow
def test_a_sharded_transformers_run_follows_the_single_process_run(tmp_path, files):
    """``--strategy zero2 --nproc 2`` (gloo) on the same file: the same batches and noise as one
    process, so the same losses (float32, rel 1e-5) at every step."""
    path = _hf_run_file(tmp_path, files)
    cli.main(["train", "--config", str(path), "--out", str(tmp_path / "one")])
    done = subprocess.run([sys.executable, "-m", "fsdpx", "train", "--config", str(path), "--strategy", "zero2",
                           "--nproc", "2", "--out", str(tmp_path / "two")], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "zero2 on Mesh(dp=2)" in done.stderr
    one, two = _metrics(tmp_path / "one" / "private"), _metrics(tmp_path / "two" / "private")
    assert [r["step"] for r in two] == [1, 2, 3]
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert [r["epsilon"] for r in two] == pytest.approx([r["epsilon"] for r in one], rel=1e-9)


def test_the_shipped_example_config_builds_its_model_and_data():
    root = Path(__file__).resolve().parent.parent
    values = read_file(root / "examples" / "run.toml", checks=cli.file_checks(
        cli.build_parser()._subparsers._group_actions[0].choices["train"]))
    fields = {k: v for k, v in values.items() if k not in ("nproc", "progress")}
    fields["model_path"] = str(root / fields["model_path"])
    fields["data_path"] = str(root / fields["data_path"])
    source = build_source(RunConfig.of(**fields))
    assert type(source.model) is transformers.GPT2LMHeadModel and source.inputs.shape[1] == 64


def test_runs_building_their_models_at_once_get_the_same_parameters():
    """Ranks run as threads build their models at the same time from one seed: each gets the
    parameters a lone build gets (module initialisation draws from torch's process-wide RNG,
    which ``sources.seeded`` holds for one build at a time)."""
    import threading

    config = RunConfig.of(n_layer=2, n_embd=16, n_head=2, block_size=8, corpus_chars=3000, private=False)
    alone = build_source(config).params
    for _ in range(5):
        out: list = [None] * 6
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, build_source(config).params)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(torch.equal(p[k], alone[k]) for p in out for k in alone)


def test_a_model_built_while_another_rank_checks_its_stages_is_the_same():
    """A pipelined rank checks its stages (a forward with the global RNG forked, which puts the
    state back on exit) while another rank's thread builds its model: the build gets the
    parameters a lone build gets. Before both went through ``fsdpx.runtime.global_rng``, the
    check's exit rewound the build's stream mid-way and the pipeline's tied embedding trained
    apart (``tests/test_train_layout.py::test_a_run_resolves_its_plan_once[pp2]`` in the suite)."""
    import threading

    from fsdpx.runtime.stages import check_stages
    from fsdpx.sharding import Mesh, strategies
    from fsdpx.sharding.pipeline import PipelineParallel, resolve_pipeline
    from fsdpx.sharding.tensor_parallel import resolve

    config = RunConfig.of(n_layer=2, n_embd=16, n_head=2, block_size=8, corpus_chars=3000, private=False)
    alone = build_source(config)
    mesh = Mesh(pp=2, dp=1)
    plan = resolve_pipeline(alone.model, resolve(alone.model, None, strategies.ddp(), mesh),
                            PipelineParallel(schedule="1f1b", microbatches=2), mesh)
    example = alone.inputs[:1]
    stop = threading.Event()
    errors: list[BaseException] = []

    def check_forever(model) -> None:  # each rank checks its own model, as in a run
        try:
            while not stop.is_set():
                check_stages(model, plan.pipeline, example)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    checkers = [threading.Thread(target=check_forever, args=(build_source(config).model,)) for _ in range(2)]
    for t in checkers:
        t.start()
    try:
        built = [build_source(config).params for _ in range(20)]
    finally:
        stop.set()
        for t in checkers:
            t.join()
    assert not errors, errors[0]
    assert all(torch.equal(p[k], alone.params[k]) for p in built for k in alone.params)
