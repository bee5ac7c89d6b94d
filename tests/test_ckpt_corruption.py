"""Damaged checkpoints give named errors that name the file; ``latest()`` skips them."""

import json
import warnings

import pytest
import torch

import ckpt
from fsdpx import Mesh, shard, strategies

MESH, ZERO3 = Mesh(dp=2), strategies.zero3()


def _save(root, step):
    w = shard(torch.arange(40, dtype=torch.float32).reshape(10, 4) + step, ZERO3.param_at_rest(2), MESH)
    return ckpt.save_ranks(root / f"step_{step}", [{"params": {"w": w[r]}, "step": step} for r in range(2)],
                           mesh=MESH, strategy=ZERO3)


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _damage(kind, d):
    shard_file = d / "rank_00001.safetensors"
    if kind == "flipped data byte":
        _flip(shard_file, shard_file.stat().st_size - 3)
    elif kind == "flipped header byte":
        _flip(shard_file, 12)
    elif kind == "truncated":
        shard_file.write_bytes(shard_file.read_bytes()[:-4])
    elif kind == "missing":
        shard_file.unlink()
    elif kind == "extra file":
        (d / "rank_00009.safetensors").write_bytes(b"x")
    elif kind == "edited manifest":
        raw = json.loads((d / "manifest.json").read_bytes())
        raw["step"] = 99
        (d / "manifest.json").write_text(json.dumps(raw))
    elif kind == "missing manifest":
        (d / "manifest.json").unlink()
    return shard_file


CASES = {
    "flipped data byte": (ckpt.ChecksumMismatchError, "rank_00001"),
    "flipped header byte": (ckpt.ChecksumMismatchError, "rank_00001"),
    "truncated": (ckpt.TruncatedShardError, "rank_00001"),
    "missing": (ckpt.MissingShardError, "rank_00001"),
    "extra file": (ckpt.ManifestError, "manifest.json"),
    "edited manifest": (ckpt.ManifestError, "manifest.json"),
    "missing manifest": (ckpt.ManifestError, "manifest.json"),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_verify_names_the_damaged_file(tmp_path, kind):
    d = _save(tmp_path, 1)
    _damage(kind, d)
    error, name = CASES[kind]
    with pytest.raises(error) as info:
        ckpt.verify(d)
    assert name in info.value.path and name in str(info.value)
    assert isinstance(info.value, ckpt.CorruptCheckpointError)


@pytest.mark.parametrize("kind", ["flipped data byte", "truncated", "missing", "edited manifest"])
def test_load_raises_the_named_error(tmp_path, kind):
    d = _save(tmp_path, 1)
    _damage(kind, d)
    error, name = CASES[kind]
    with pytest.raises(error, match=name):
        ckpt.load(d, mesh=Mesh(), strategy=None)


def test_edited_manifest_is_a_manifest_error(tmp_path):
    d = _save(tmp_path, 1)
    raw = json.loads((d / "manifest.json").read_bytes())
    raw["tensors"]["params/w"]["shape"] = [12, 4]  # a different model, checksum "fixed" by hand
    body = {k: v for k, v in raw.items() if k != "manifest_checksum"}
    raw["manifest_checksum"] = ckpt.checksum.hex_digest(ckpt.format._canonical(body))
    (d / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ckpt.ManifestError, match="manifest.json.*cover 40 of 48"):
        ckpt.verify(d)


@pytest.mark.parametrize("kind", list(CASES))
def test_latest_skips_a_corrupt_checkpoint_with_a_warning(tmp_path, kind):
    _save(tmp_path, 1)
    d2 = _save(tmp_path, 2)
    _damage(kind, d2)
    manager = ckpt.CheckpointManager(tmp_path, mesh=MESH, strategy=ZERO3)
    with pytest.warns(ckpt.CorruptCheckpointWarning, match="step_2"):
        assert manager.latest() == tmp_path / "step_1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckpt.CorruptCheckpointWarning)
        assert manager.restore(mesh=Mesh(), strategy=None)["step"] == 1
