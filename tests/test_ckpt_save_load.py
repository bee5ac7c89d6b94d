"""save / load on simulated meshes (``ckpt.saving``, ``ckpt.loading``)."""

import os

import pytest
import torch
from safetensors import safe_open

import ckpt
from fsdpx import Mesh, Spec, shard, strategies, unshard


def _global_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    params = {"wte.weight": torch.randn(11, 4, generator=g), "ln.bias": torch.randn(4, generator=g),
              "scale": torch.tensor(0.5), "w16": torch.randn(5, 3, generator=g).to(torch.bfloat16)}
    return {"params": params, "opt_state": {"count": 7, "mu": {k: v * 2 for k, v in params.items()}},
            "step": 7, "key": 3, "ids": torch.arange(6), "empty": torch.zeros(0, 3)}


def _shard_state(state: dict, mesh: Mesh, strategy) -> list[dict]:
    rule = ckpt.strategy_rule(strategy)
    tree, tensors = ckpt.flatten(state)
    pieces = {p: shard(t, rule(p, t.dim()), mesh) for p, t in tensors.items()}
    return [ckpt.unflatten(tree, lambda p, r=r: pieces[p][r]) for r in range(mesh.size)]


def _unshard_state(locals_: list[dict], mesh: Mesh, strategy) -> dict:
    rule = ckpt.strategy_rule(strategy)
    flat = [ckpt.flatten(s) for s in locals_]
    tree = flat[0][0]
    return ckpt.unflatten(tree, lambda p: unshard([f[1][p] for f in flat], rule(p, flat[0][1][p].dim()), mesh))


def _assert_same(a: dict, b: dict) -> None:
    ta, fa = ckpt.flatten(a)
    tb, fb = ckpt.flatten(b)
    assert ta == tb and fa.keys() == fb.keys()
    for p in fa:
        assert fa[p].dtype == fb[p].dtype and torch.equal(fa[p], fb[p]), p


@pytest.mark.parametrize("src, dst", [
    ((Mesh(dp=3), strategies.zero3()), (Mesh(dp=2), strategies.zero2())),
    ((Mesh(dp=3), strategies.zero3()), (Mesh(dp=1), None)),
    ((Mesh(dp=2), strategies.zero1()), (Mesh(dp=4), strategies.zero3())),
    ((Mesh(replica=2, shard=2), strategies.hsdp()), (Mesh(dp=3), strategies.zero3())),
    ((Mesh(dp=1), strategies.ddp()), (Mesh(replica=2, shard=2), strategies.hsdp())),
])
def test_save_in_one_layout_load_in_another(tmp_path, src, dst):
    state = _global_state()
    path = ckpt.save_ranks(tmp_path / "step_7", _shard_state(state, *src), mesh=src[0], strategy=src[1])
    assert path == tmp_path / "step_7"
    loaded = ckpt.load_ranks(path, mesh=dst[0], strategy=dst[1])
    for r, local in enumerate(_shard_state(state, *dst)):
        _assert_same(loaded[r], local)
    _assert_same(_unshard_state(loaded, *dst), state)


def test_shard_files_open_with_safetensors(tmp_path):
    state = _global_state()
    mesh = Mesh(dp=3)
    path = ckpt.save_ranks(tmp_path / "s", _shard_state(state, mesh, strategies.zero3()), mesh=mesh,
                           strategy=strategies.zero3())
    manifest = ckpt.read_manifest(path)
    for name in manifest.files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                box = next(b.box for b in manifest.tensors[key].boxes if b.file == name)
                full = ckpt.flatten(state)[1][key]
                assert torch.equal(f.get_tensor(key), full[tuple(slice(s, e) for s, e in box)])


def test_replicated_tensors_are_written_once(tmp_path):
    mesh = Mesh(dp=4)
    state = {"params": {"w": torch.randn(64, 64)}}
    path = ckpt.save_ranks(tmp_path / "s", [state] * 4, mesh=mesh, strategy=strategies.ddp())
    manifest = ckpt.read_manifest(path)
    assert list(manifest.files) == ["rank_00000.safetensors"]
    assert [b.box for b in manifest.tensors["params/w"].boxes] == [((0, 64), (0, 64))]


def test_load_of_sharded_dim0_reads_only_its_bytes(tmp_path):
    mesh = Mesh(dp=1)
    state = {"params": {"w": torch.randn(100, 10)}}
    path = ckpt.save_ranks(tmp_path / "s", [state], mesh=mesh, strategy=strategies.zero3())
    stats = [ckpt.ReadStats() for _ in range(4)]
    ckpt.load_ranks(path, mesh=Mesh(dp=4), strategy=strategies.zero3(), stats=stats)
    assert [s.bytes_read for s in stats] == [25 * 10 * 4] * 4
    assert [s.reads for s in stats] == [1] * 4


def test_load_into_a_spec_given_explicitly(tmp_path):
    mesh = Mesh(a=2, b=2)
    w = torch.randn(6, 5)
    spec = Spec("b", "a")
    path = ckpt.save_ranks(tmp_path / "s", [{"w": t} for t in shard(w, spec, mesh)], mesh=mesh, strategy=None,
                           specs={"w": spec})
    out = ckpt.load_ranks(path, mesh=Mesh(dp=3), strategy=None, specs={"w": Spec(None, "dp")})
    assert torch.equal(torch.cat([o["w"] for o in out], dim=1), w)


def test_inconsistent_ranks_are_refused(tmp_path):
    mesh = Mesh(dp=2)
    with pytest.raises(ckpt.SaveError, match="non-tensor state differs"):
        ckpt.save_ranks(tmp_path / "a", [{"step": 1}, {"step": 2}], mesh=mesh, strategy=None)
    with pytest.raises(ckpt.SaveError, match="params/w: rank 0 holds shape"):  # 2 + 3 chunks as 3, 2
        ckpt.save_ranks(tmp_path / "b", [{"params": {"w": torch.zeros(2)}}, {"params": {"w": torch.zeros(3)}}],
                        mesh=mesh, strategy=strategies.zero3())
    assert not any(p.name in ("a", "b") for p in tmp_path.iterdir())
    assert list(tmp_path.iterdir()) == []  # temporaries removed too


def test_never_saves_over_an_existing_checkpoint(tmp_path):
    ckpt.save(tmp_path / "s", {"x": torch.ones(2)}, mesh=Mesh(), strategy=None)
    before = (tmp_path / "s" / "manifest.json").read_bytes()
    with pytest.raises(ckpt.CheckpointExistsError, match="never overwritten"):
        ckpt.save(tmp_path / "s", {"x": torch.zeros(2)}, mesh=Mesh(), strategy=None)
    assert (tmp_path / "s" / "manifest.json").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["s"]


def test_unsupported_dtype_is_refused_before_writing(tmp_path):
    with pytest.raises(ckpt.SaveError, match="complex64"):
        ckpt.save(tmp_path / "s", {"x": torch.zeros(2, dtype=torch.complex64)}, mesh=Mesh(), strategy=None)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("rows", [4, 40])  # 4 runs: one pread each; 40 runs: one strided copy from a mapping
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int8])
def test_column_slices_read_exactly_their_bytes(tmp_path, rows, dtype):
    full = (torch.randn(rows, 6, 3) * 10).to(dtype)
    src, dst = Mesh(dp=2), Mesh(dp=3)
    path = ckpt.save_ranks(tmp_path / "s", [{"t": t} for t in shard(full, Spec("dp", None, None), src)], mesh=src,
                           strategy=None, specs={"t": Spec("dp", None, None)})
    stats = [ckpt.ReadStats() for _ in range(3)]
    out = ckpt.load_ranks(path, mesh=dst, strategy=None, specs={"t": Spec(None, "dp", None)}, stats=stats)
    for r in range(3):
        assert torch.equal(out[r]["t"], full[:, 2 * r:2 * r + 2])
        assert stats[r].bytes_read == stats[r].bytes_needed == rows * 2 * 3 * full.element_size()
        assert stats[r].reads == (rows if rows <= ckpt.reader.MANY_RUNS * 2 else 2)
