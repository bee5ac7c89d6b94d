"""LoRA from the command line (issue 29, item 6): ``fsdpx train --lora 'r = 4, alpha = 8, targets =
["q_proj", "v_proj"]'`` on a transformers model saved with ``save_pretrained`` in ``tmp_path``
(nothing downloaded), private by default, in one process and sharded; the run's export is the
adapter in peft's format, or with ``merge`` the merged model ``from_pretrained`` loads.

The judges are the user's own tools: ``peft.PeftModel.from_pretrained`` on the unmodified base,
``transformers.AutoModelForCausalLM.from_pretrained`` on the merged export, each compared with
the logits of fsdpx's final parameters read back from the run's last checkpoint; the base weights
are compared bit for bit with the saved file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from support.threads import one_thread  # noqa: E402,F401

from fsdpx.cli import main  # noqa: E402
from support import finetune  # noqa: E402
from support.finetune import (checkpoint_params, cli_side_by_side, final_logits, hf_logits,  # noqa: E402
                              last_checkpoint, tensors, tiny, tokens, train)

QV = 'r = 4, alpha = 8, targets = ["q_proj", "v_proj"]'


def saved(family: str, path: Path) -> Path:
    return finetune.saved(tiny(family), path)


def peft_logits(base: Path, adapter: Path, x: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), local_files_only=True, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, str(adapter)).eval()
    with torch.no_grad():
        return model(x).logits


def errors(capsys) -> list[str]:
    """The error lines the CLI printed (the run's announcement line aside)."""
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("fsdpx train: error")]


def test_a_private_lora_run_trains_the_adapters_alone_and_exports_them(tmp_path):
    """Llama, private (the default), 3 steps: the base weights leave the run bit for bit as saved
    and their optimizer state untouched (zero), the adapters trained; ``runs/NAME/model`` is the
    adapter in peft's format, naming the base, and ``PeftModel.from_pretrained`` on the unmodified
    base gives fsdpx's final logits; ``fsdpx export`` of the checkpoint writes the same files."""
    base = saved("llama", tmp_path / "base")
    main(train(tmp_path, "a", "--model", "transformers", "--model-path", str(base), "--lora", QV, "--steps", "3"))
    from fsdpx.train.resume import resume_from

    params, mu = checkpoint_params(tmp_path / "a"), resume_from(last_checkpoint(tmp_path / "a"))[0].opt_state["mu"]
    adapters = sorted(n for n in params if ".lora_" in n)
    assert len(adapters) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    original = tensors(base / "model.safetensors")
    bases = {n: n.replace(".base_layer.", ".") for n in params if n not in adapters}
    assert sorted(bases.values()) == sorted(original)
    for name, saved_name in bases.items():
        assert torch.equal(params[name], original[saved_name]), name
        assert not mu[name].any(), name  # no gradient ever reached the optimizer
    assert all(params[n].any() and mu[n].any() for n in adapters if ".lora_B." in n)  # B starts at zero: trained
    out = tmp_path / "runs" / "a" / "model"
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8, ["q_proj", "v_proj"])
    assert config["base_model_name_or_path"] == str(base.resolve())
    x = tokens()
    want = final_logits(tmp_path / "a", x)
    assert not torch.allclose(want, hf_logits(base, x), atol=1e-4)  # the adapters changed the model
    torch.testing.assert_close(peft_logits(base, out, x), want, rtol=0, atol=1e-6)
    main(["export", str(tmp_path / "a"), "--to", str(tmp_path / "again")])
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes(), name


def test_the_merged_export_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path, capsys):
    """GPT-2 (fused ``c_attn``, a ``Conv1D``: peft's fan-in-fan-out; tied head), non-private,
    ``merge = true``: ``runs/NAME/model`` is a plain GPT-2 ``from_pretrained`` loads, with
    fsdpx's final logits, and ``fsdpx export --merge`` of the checkpoint writes the same tensors.
    ``--merge`` of a model without adapters is refused (exit 2, nothing written)."""
    base = saved("gpt2", tmp_path / "base")
    main(train(tmp_path, "m", "--model", "transformers", "--model-path", str(base), "--non-private",
               "--lora", "r = 2, alpha = 4, merge = true", "--steps", "2"))
    out = tmp_path / "runs" / "m" / "model"
    assert "model.safetensors" in {p.name for p in out.iterdir()}
    merged = tensors(out / "model.safetensors")
    assert sorted(merged) == sorted(tensors(base / "model.safetensors"))  # the base's names, no adapter
    x = tokens()
    torch.testing.assert_close(hf_logits(out, x), final_logits(tmp_path / "m", x), rtol=0, atol=1e-5)
    main(["export", str(tmp_path / "m"), "--to", str(tmp_path / "again"), "--merge"])
    again = tensors(tmp_path / "again" / "model.safetensors")
    assert sorted(again) == sorted(merged) and all(torch.equal(again[k], merged[k]) for k in merged)
    main(train(tmp_path, "w", "--model", "transformers", "--model-path", str(base), "--steps", "1", "--no-export"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(tmp_path / "w"), "--to", str(tmp_path / "none"), "--merge"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "--merge" in err[0], err
    assert not (tmp_path / "none").exists()


def test_a_resume_keeps_the_adapters_and_refuses_another_lora(tmp_path, capsys):
    """A resume without ``--lora`` continues the checkpoint's adapters (its export is the
    adapter again); one with another ``--lora`` is refused by name before anything is written."""
    base = saved("gpt2", tmp_path / "base")
    start = train(tmp_path, "r", "--model", "transformers", "--model-path", str(base), "--ckpt-every", "1")
    main([*start, "--lora", "r = 2", "--steps", "2", "--non-private"])
    capsys.readouterr()
    metrics = (tmp_path / "runs" / "r" / "metrics.jsonl").read_text()
    with pytest.raises(SystemExit) as exit_:
        main([*start, "--lora", "r = 4", "--steps", "3", "--resume"])
    err = errors(capsys)
    assert exit_.value.code == 2 and len(err) == 1 and "--lora" in err[0], err
    assert (tmp_path / "runs" / "r" / "metrics.jsonl").read_text() == metrics
    assert last_checkpoint(tmp_path / "r").name == "step_2"
    main([*start, "--steps", "3", "--resume"])
    assert last_checkpoint(tmp_path / "r").name == "step_3"
    assert (tmp_path / "runs" / "r" / "model" / "adapter_model.safetensors").is_file()
    params = checkpoint_params(tmp_path / "r")
    assert sum(".lora_" in n for n in params) == 2 * 2  # 2 layers x c_attn x (A, B), rank 2
    assert all(v.shape[0] == 2 for n, v in params.items() if ".lora_A." in n)


@pytest.mark.slow
def test_a_sharded_lora_run_equals_one_process(tmp_path):
    """``--strategy zero3`` and ``ddp`` on 2 processes (gloo), private, same seed and batches:
    each exported adapter equals the one-process run's within fp32 rounding (atol 1e-6; a sum
    over two ranks is added in another order), the base weights bit for bit as saved."""
    base = saved("llama", tmp_path / "base")
    run = ["--model", "transformers", "--model-path", str(base), "--lora", QV, "--steps", "2"]
    one, *twos = cli_side_by_side((train(tmp_path, "one", *run), None),  # independent runs: all at once
                                  *[(train(tmp_path, s, *run, "--strategy", s), 2) for s in ("zero3", "ddp")])
    assert one.returncode == 0, one.stderr[-2000:]
    a = tensors(tmp_path / "runs" / "one" / "model" / "adapter_model.safetensors")
    original = tensors(base / "model.safetensors")
    for strategy, two in zip(("zero3", "ddp"), twos):
        assert two.returncode == 0, (strategy, two.stderr[-3000:])
        b = tensors(tmp_path / "runs" / strategy / "model" / "adapter_model.safetensors")
        assert sorted(a) == sorted(b) and len(a) == 8
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=f"{strategy} {k}")
        for name, tensor in checkpoint_params(tmp_path / strategy).items():
            if ".lora_" not in name:
                assert torch.equal(tensor, original[name.replace(".base_layer.", ".")]), (strategy, name)


REFUSALS = {
    "built-in GPT": ["--lora", QV],
    "no such module": ["--model", "transformers", "--model-path", "{base}", "--lora", 'targets = ["q_prj"]'],
    "offload": ["--model", "transformers", "--model-path", "{base}", "--lora", QV, "--offload", "zero"],
    "tensor parallel": ["--model", "transformers", "--model-path", "{base}", "--lora", QV, "--strategy", "zero2",
                        "--tp", "2", "--nproc", "2"],
    "pipeline": ["--model", "transformers", "--model-path", "{base}", "--lora", QV, "--strategy", "zero2",
                 "--pp", "2", "--nproc", "2"],
    "dropout": ["--model", "transformers", "--model-path", "{base}", "--lora", "r = 4, dropout = 0.1"],
    "unknown key": ["--model", "transformers", "--model-path", "{base}", "--lora", "r = 4, alhpa = 8"],
    "peft's name": ["--model", "transformers", "--model-path", "{base}", "--lora", "lora_alpha = 8"],
    "freeze": ["--model", "transformers", "--model-path", "{base}", "--lora", QV, "--freeze", "model.embed_tokens"],
}


def test_lora_values_are_refused_by_name(tmp_path, capsys):
    """Each mistake: exit 2, one line naming ``--lora`` (the unknown key with the closest known
    one, the target with some of the model's modules), nothing written."""
    base = saved("llama", tmp_path / "base")
    capsys.readouterr()  # transformers' progress bar
    lines = {}
    for case, args in REFUSALS.items():
        with pytest.raises(SystemExit) as exit_:
            main(train(tmp_path, "x", *[a.replace("{base}", str(base)) for a in args]))
        err = errors(capsys)
        assert exit_.value.code == 2 and len(err) == 1 and "--lora" in err[0], (case, err)
        lines[case] = err[0]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "x").exists()
    assert "did you mean alpha?" in lines["unknown key"] and "did you mean alpha?" in lines["peft's name"]
    assert "q_prj" in lines["no such module"] and "q_proj" in lines["no such module"]


def test_a_config_file_lora_table_is_the_flag(tmp_path):
    """``[model.lora]`` in a config file (a table of its own, or inline) is ``--lora``'s value;
    the resolved file writes it back."""
    from fsdpx.train.config import RunConfig, read_file, to_toml

    flag = RunConfig.of(model="transformers", model_path="m", lora={"r": 4, "alpha": 8, "targets": ["q_proj"]})
    table = tmp_path / "table.toml"
    table.write_text('[model]\nkind = "transformers"\npath = "m"\n[model.lora]\nr = 4\nalpha = 8\n'
                     'targets = ["q_proj"]\n')
    inline = tmp_path / "inline.toml"
    inline.write_text('[model]\nkind = "transformers"\npath = "m"\nlora = {r = 4, alpha = 8, targets = ["q_proj"]}\n')
    for path in (table, inline):
        assert RunConfig.of(**read_file(path)) == flag and RunConfig.of(**read_file(path)).model.lora == flag.model.lora
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(to_toml(flag))
    assert RunConfig.of(**read_file(resolved)).model.lora == flag.model.lora
    assert flag.model.lora == {"r": 4, "alpha": 8, "targets": ["q_proj"], "dropout": 0.0, "merge": False}
