"""The manifest schema and checksums (``ckpt.format``, ``ckpt.checksum``)."""

import json

import pytest
import torch

from ckpt import checksum
from ckpt import format as fmt
from ckpt.errors import ManifestError, UnsupportedVersionError
from fsdpx import Mesh, Spec


def _manifest() -> fmt.Manifest:
    boxes = (fmt.BoxRecord(((0, 2), (0, 3)), "rank_00000.safetensors", 128, 24, "00aa"),
             fmt.BoxRecord(((2, 3), (0, 3)), "rank_00001.safetensors", 128, 12, "00bb"))
    files = {"rank_00000.safetensors": fmt.FileRecord(0, 152, "11"), "rank_00001.safetensors": fmt.FileRecord(1, 140, "22")}
    return fmt.Manifest(library_version="0.1.0", mesh=Mesh(dp=2), strategy="zero3", files=files,
                        tensors={"params/w": fmt.TensorRecord((3, 3), "float32", Spec("dp", None), boxes)},
                        state={"$dict": [["w", {"$tensor": "params/w"}], ["step", 4]]}, private=True, step=4)


def test_manifest_round_trips():
    m = _manifest()
    assert fmt.decode(fmt.encode(m)) == m
    assert fmt.encode(m) == fmt.encode(fmt.decode(fmt.encode(m)))


def test_streamed_checksum_equals_one_shot():
    data = bytes(range(256)) * 1000
    h = checksum.new_hasher()
    for i in range(0, len(data), 777):
        h.update(data[i:i + 777])
    assert h.hexdigest() == checksum.hex_digest(data)


def test_every_dtype_has_a_name_and_a_safetensors_code():
    for dtype, (name, code) in fmt.DTYPES.items():
        assert fmt.dtype_of(name) is dtype and fmt.itemsize(name) == torch.empty((), dtype=dtype).element_size()
    with pytest.raises(ValueError, match="complex64"):
        fmt.dtype_name(torch.complex64)






@pytest.mark.parametrize("edit, message", [
    ({"tensors.params/w.boxes.1.box": [[1, 3], [0, 3]]}, "needs 24 bytes|overlap|cover"),
    ({"tensors.params/w.boxes.1.box": [[2, 4], [0, 3]]}, "outside"),
    ({"tensors.params/w.boxes.1.file": "rank_00007.safetensors"}, "unlisted"),
    ({"tensors.params/w.boxes.1.nbytes": 16}, "needs 12 bytes"),
    ({"tensors.params/w.shape": [4, 3]}, "cover"),
    ({"tensors.params/w.spec": "Spec(__import__('os'))"}, "literals|cannot parse"),
    ({"tensors.params/w.dtype": "float128"}, "unknown dtype"),
    ({"files.rank_00001.safetensors.size": 100}, "past the end"),
])
def test_a_manifest_breaking_the_schema_is_a_manifest_error(edit, message):
    # Paths with dots in keys: edit through the raw dict directly.
    raw = json.loads(fmt.encode(_manifest()))
    (path, value), = edit.items()
    target = {
        "tensors.params/w.boxes.1.box": lambda r: r["tensors"]["params/w"]["boxes"][1].__setitem__("box", value),
        "tensors.params/w.boxes.1.file": lambda r: r["tensors"]["params/w"]["boxes"][1].__setitem__("file", value),
        "tensors.params/w.boxes.1.nbytes": lambda r: r["tensors"]["params/w"]["boxes"][1].__setitem__("nbytes", value),
        "tensors.params/w.shape": lambda r: r["tensors"]["params/w"].__setitem__("shape", value),
        "tensors.params/w.spec": lambda r: r["tensors"]["params/w"].__setitem__("spec", value),
        "tensors.params/w.dtype": lambda r: r["tensors"]["params/w"].__setitem__("dtype", value),
        "files.rank_00001.safetensors.size": lambda r: r["files"]["rank_00001.safetensors"].__setitem__("size", value),
    }[path]
    target(raw)
    body = {k: v for k, v in raw.items() if k != "manifest_checksum"}
    raw["manifest_checksum"] = checksum.hex_digest(fmt._canonical(body))
    with pytest.raises(ManifestError, match=message) as info:
        fmt.decode(json.dumps(raw).encode(), "ck/step_4/manifest.json")
    assert info.value.path == "ck/step_4/manifest.json"


def test_garbage_and_newer_versions_are_refused():
    with pytest.raises(ManifestError, match="not valid JSON"):
        fmt.decode(b"{nope", "m.json")
    raw = json.loads(fmt.encode(_manifest()))
    raw["format_version"] = fmt.FORMAT_VERSION + 1
    with pytest.raises(UnsupportedVersionError, match="format version 2"):
        fmt.decode(json.dumps(raw).encode(), "m.json")


def test_an_edited_manifest_fails_its_own_checksum():
    raw = json.loads(fmt.encode(_manifest()))
    raw["step"] = 5
    with pytest.raises(ManifestError, match="own checksum"):
        fmt.decode(json.dumps(raw).encode(), "x/manifest.json")
