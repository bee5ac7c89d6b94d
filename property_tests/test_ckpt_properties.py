"""Any saved layout loads into any layout: random (spec, mesh of 1-4 ranks) on both sides, on
the simulated mesh (threads) and on real gloo processes. Every tensor equal bit for bit, and
each rank reads at most 1.05x the bytes it needs (in fact exactly those bytes)."""

import json
import random
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from fsdpx import Mesh, Spec, shard

from support.layout_gen import meshes, shapes, specs
from support.processes import python_env

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool]


def _tensor(shape, dtype, gen):
    t = torch.randn(shape, generator=gen, dtype=torch.float64) * 100
    return (t > 0) if dtype == torch.bool else t.to(dtype)


def _check_load(path, full, mesh, spec, stats_out=None):
    stats = [ckpt.ReadStats() for _ in range(mesh.size)]
    out = ckpt.load_ranks(path, mesh=mesh, strategy=None, specs={"t": spec}, stats=stats)
    expect = shard(full, spec, mesh)
    for r in range(mesh.size):
        assert out[r]["t"].dtype == full.dtype and torch.equal(out[r]["t"], expect[r]), f"rank {r}"
        assert stats[r].bytes_read <= 1.05 * stats[r].bytes_needed, stats[r]


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_any_save_layout_loads_into_any_layout(data):
    ndim = data.draw(st.integers(0, 3), label="ndim")
    shape = data.draw(shapes(ndim), label="shape")
    src_mesh = data.draw(meshes(max_ranks=4), label="save mesh")
    src_spec = data.draw(specs(src_mesh, ndim, partial=False), label="save spec")
    dst_mesh = data.draw(meshes(max_ranks=4), label="load mesh")
    dst_spec = data.draw(specs(dst_mesh, ndim, partial=False), label="load spec")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    full = _tensor(shape, dtype, torch.Generator().manual_seed(data.draw(st.integers(0, 2**31))))
    with tempfile.TemporaryDirectory() as d:
        locals_ = shard(full, src_spec, src_mesh)
        path = ckpt.save_ranks(Path(d) / "c", [{"t": t, "n": 1} for t in locals_], mesh=src_mesh, strategy=None,
                               specs={"t": src_spec})
        ckpt.verify(path)
        _check_load(path, full, dst_mesh, dst_spec)


# ---- real processes ------------------------------------------------------------------------------


def _random_spec(rng, mesh_axes, ndim):
    entries = [[] for _ in range(ndim)]
    for a in rng.sample(mesh_axes, len(mesh_axes)):
        role = rng.randint(-1, ndim - 1)
        if role >= 0:
            entries[role].append(a)
    return repr(Spec(*[tuple(e) for e in entries]))


SAVE_MESHES = [[["dp", 3]], [["a", 1], ["b", 3]], [["a", 3], ["b", 1]]]
LOAD_MESHES = [[["dp", 2]], [["x", 2], ["y", 1]], [["dp", 1]], [["a", 3]]]


def _cases(n, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ndim = rng.randint(0, 3)
        save_mesh, load_mesh = rng.choice(SAVE_MESHES), rng.choice(LOAD_MESHES)
        out.append({"seed": i, "shape": [rng.randint(0, 7) for _ in range(ndim)],
                    "save": {"mesh": save_mesh, "spec": _random_spec(rng, [a for a, _ in save_mesh], ndim)},
                    "load": {"mesh": load_mesh, "spec": _random_spec(rng, [a for a, _ in load_mesh], ndim)}})
    return out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(directory, world, cases):
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "support.ckpt_worker", "gloo", str(directory), str(r), str(world),
                               str(port), json.dumps(cases)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=python_env())
             for r in range(world)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


@pytest.mark.slow
def test_gloo_processes_save_and_load_in_other_layouts(tmp_path):
    """3 gloo processes save every case on its save mesh (3 ranks), then the first 1 or 2 load it
    on its load mesh; the test process loads each into 1 and 4 simulated ranks as well."""
    cases = _cases(8)
    reports = _spawn(tmp_path, 3, cases)
    loaded = [0] * len(cases)
    for rank, report in enumerate(reports):
        for r in report:
            assert r["ok"], (rank, cases[r["case"]])
            assert r["read"] <= 1.05 * r["needed"], (rank, cases[r["case"]], r)
            loaded[r["case"]] += 1
    assert loaded == [Mesh(**dict(c["load"]["mesh"])).size for c in cases]  # every load rank reported
    for i, case in enumerate(cases):
        full = torch.randn(case["shape"], generator=torch.Generator().manual_seed(case["seed"]), dtype=torch.float64)
        _check_load(tmp_path / f"case_{i}", full, Mesh(), Spec.replicated(len(case["shape"])))
        _check_load(tmp_path / f"case_{i}", full, Mesh(dp=4), Spec(*(["dp"] + [None] * (len(case["shape"]) - 1)))
                    if case["shape"] else Spec())
