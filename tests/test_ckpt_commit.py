"""The atomic commit protocol (``ckpt.commit``, ``ckpt.saving``, ``ckpt.coordinator``)."""

import os
import threading
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import commit, saving
from fsdpx import Mesh, shard, strategies


def test_commit_order_is_fsync_files_manifest_dir_rename_parent(tmp_path, monkeypatch):
    events, lock = [], threading.Lock()
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        real_fsync(fd)
        with lock:
            events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    def rename(src, dst):
        real_rename(src, dst)
        with lock:
            events.append(("rename", str(src), str(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    mesh = Mesh(dp=3)
    w = shard(torch.randn(9, 2), strategies.zero3().param_at_rest(2), mesh)
    final = tmp_path / "step_1"
    ckpt.save_ranks(final, [{"params": {"w": w[r]}} for r in range(3)], mesh=mesh, strategy=strategies.zero3())

    kinds = [(e[0], os.path.basename(e[1])) for e in events]
    rename_at = next(i for i, e in enumerate(events) if e[0] == "rename")
    tmp = events[rename_at][1]
    assert os.path.basename(tmp).startswith(".step_1.tmp-") and events[rename_at][2] == str(final)
    shard_syncs = [i for i, (k, n) in enumerate(kinds) if k == "fsync" and n.startswith("rank_")]
    manifest_sync = kinds.index(("fsync", "manifest.json"))
    tmp_sync = events.index(("fsync", tmp))
    parent_sync = events.index(("fsync", str(tmp_path)))
    assert len(shard_syncs) == 3
    assert max(shard_syncs) < manifest_sync < tmp_sync < rename_at < parent_sync
    assert all(os.path.dirname(e[1]) == tmp for i, e in enumerate(events) if i in shard_syncs)


def test_commit_never_replaces_an_existing_checkpoint(tmp_path):
    (tmp_path / "step_1").mkdir()  # even an EMPTY directory, which rename() would replace
    tmp = tmp_path / ".step_1.tmp-00"
    tmp.mkdir()
    with pytest.raises(ckpt.CheckpointExistsError):
        commit.commit(tmp, tmp_path / "step_1", b"{}")
    assert list((tmp_path / "step_1").iterdir()) == []


def test_a_failing_rank_commits_nothing_and_every_rank_raises(tmp_path, monkeypatch):
    real = saving.write_shard

    def failing(path, blocks):
        if path.name == "rank_00001.safetensors":
            raise OSError(28, "No space left on device")
        return real(path, blocks)

    monkeypatch.setattr(saving, "write_shard", failing)
    mesh = Mesh(dp=3)
    group = ckpt.ThreadGroup(3)
    errors = [None] * 3

    def run(r):
        try:
            ckpt.save(tmp_path / "step_2", {"params": {"w": torch.ones(1)}}, mesh=mesh, strategy=strategies.zero3(),
                      coordinator=group.member(r))
        except ckpt.SaveError as e:
            errors[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert all(e is not None and "rank 1: OSError" in str(e) for e in errors)
    assert isinstance(errors[1].__cause__, OSError)
    assert list(tmp_path.iterdir()) == []


def test_thread_group_gathers_in_rank_order():
    group = ckpt.ThreadGroup(4)
    out = [None] * 4

    def run(r):
        c = group.member(r)
        out[r] = (c.gather({"r": r}), c.broadcast({"from": r}))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert out[0][0] == [{"r": r} for r in range(4)]
    assert all(o[0] is None for o in out[1:]) and all(o[1] == {"from": 0} for o in out)


def test_stale_temporaries_are_the_dot_named_leftovers(tmp_path):
    for name in [".step_3.tmp-ab12", ".step_2.deleting-ff", "step_1", ".hidden", ".step_4.corrupt-aa"]:
        (tmp_path / name).mkdir()
    assert [p.name for p in commit.stale_temporaries(tmp_path)] == [".step_2.deleting-ff", ".step_3.tmp-ab12"]


def test_no_commit_publishes_after_hold_commits(tmp_path):
    """``hold_commits`` (the grace-period watchdog's, before it names the newest checkpoint and
    exits): a commit that starts later never publishes; it holds the whole process, so it runs in
    one of its own."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import threading, time
        from pathlib import Path
        from ckpt import commit
        root = Path({str(tmp_path)!r})
        commit.commit(commit.prepare(root / "step_1"), root / "step_1", b"{{}}")
        assert commit.hold_commits()
        late = threading.Thread(target=commit.commit, args=(commit.prepare(root / "step_2"), root / "step_2", b"{{}}"),
                                daemon=True)
        late.start()
        late.join(1.0)
        print(late.is_alive(), sorted(p.name for p in root.iterdir() if not p.name.startswith(".")))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "['step_1']"]
