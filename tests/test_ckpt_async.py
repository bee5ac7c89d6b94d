"""Background saves (``ckpt.async_save``)."""

import time

import pytest
import torch

import ckpt
from ckpt import saving
from fsdpx import Mesh


def _slow_writer(monkeypatch, delay, log=None):
    real = saving.write_shard

    def slow(path, blocks):
        if log is not None:
            log.append(("start", path.parent.name, time.monotonic()))
        time.sleep(delay)
        out = real(path, blocks)
        if log is not None:
            log.append(("end", path.parent.name, time.monotonic()))
        return out

    monkeypatch.setattr(saving, "write_shard", slow)


def test_async_snapshot_is_taken_before_save_returns(tmp_path, monkeypatch):
    _slow_writer(monkeypatch, 0.3)
    w = torch.zeros(1000)
    state = {"params": {"w": w}, "step": 1, "log": [1]}
    handle = ckpt.save(tmp_path / "s", state, mesh=Mesh(), strategy=None, blocking=False)
    assert not handle.done()
    w.add_(1.0)  # training continues in place
    state["log"].append(2)
    state["step"] = 2
    assert handle.wait() == tmp_path / "s"
    back = ckpt.load(tmp_path / "s", mesh=Mesh(), strategy=None)
    assert torch.equal(back["params"]["w"], torch.zeros(1000)) and back["step"] == 1 and back["log"] == [1]


def test_async_wait_reraises_the_writer_error(tmp_path, monkeypatch):
    def broken(path, blocks):
        raise OSError(27, "File too large")

    monkeypatch.setattr(saving, "write_shard", broken)
    handle = ckpt.save(tmp_path / "s", {"w": torch.ones(3)}, mesh=Mesh(), strategy=None, blocking=False)
    with pytest.raises(ckpt.SaveError, match="File too large") as info:
        handle.wait()
    assert isinstance(info.value.__cause__, OSError)
    assert list(tmp_path.iterdir()) == []


def test_at_most_one_save_in_flight(tmp_path, monkeypatch):
    log = []
    _slow_writer(monkeypatch, 0.2, log)
    coord = ckpt.SingleProcess()
    h1 = ckpt.save(tmp_path / "a", {"w": torch.ones(3)}, mesh=Mesh(), strategy=None, coordinator=coord, blocking=False)
    h2 = ckpt.save(tmp_path / "b", {"w": torch.ones(3)}, mesh=Mesh(), strategy=None, coordinator=coord, blocking=False)
    assert h1.done()  # the second call waited for the first before snapshotting
    h2.wait()
    (s1, _, t_s1), (e1, _, t_e1), (s2, _, t_s2), (e2, _, _) = log
    assert [s1, e1, s2, e2] == ["start", "end", "start", "end"] and t_s2 >= t_e1


def test_blocking_save_raises_directly(tmp_path):
    with pytest.raises(ckpt.UnsupportedStateError, match="w"):
        ckpt.save(tmp_path / "s", {"w": object()}, mesh=Mesh(), strategy=None)


def test_reused_snapshot_buffers_never_mix_two_saves(tmp_path, monkeypatch):
    _slow_writer(monkeypatch, 0.05)
    coord = ckpt.SingleProcess()
    w = torch.zeros(256)
    handles = []
    for step in range(3):
        w.fill_(step)
        handles.append(ckpt.save(tmp_path / f"s{step}", {"w": w, "step": step}, mesh=Mesh(), strategy=None,
                                 coordinator=coord, blocking=False))
    [h.wait() for h in handles]
    for step in range(3):
        back = ckpt.load(tmp_path / f"s{step}", mesh=Mesh(), strategy=None)
        assert back["step"] == step and torch.equal(back["w"], torch.full((256,), float(step)))
