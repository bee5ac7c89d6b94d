"""``ckpt.CheckpointManager``: cadence, retention, latest/restore, leftovers."""


import pytest
import torch

import ckpt
from ckpt.async_save import saver_for
from ckpt.manager import to_delete


def _state(step):
    return {"params": {"w": torch.full((4,), float(step))}, "step": step}


def test_retention_keeps_last_n_and_never_the_newest(tmp_path):
    m = ckpt.CheckpointManager(tmp_path, keep_last=2)
    for step in range(6):
        m.save(step, _state(step))
        assert m.steps() == list(range(max(0, step - 1), step + 1))
    one = ckpt.CheckpointManager(tmp_path / "one", keep_last=1)
    for step in range(3):
        one.save(step, _state(step))
        assert one.steps() == [step]


def test_retention_rule_is_pure_and_leaves_newer_steps():
    assert to_delete([1, 2, 3, 4], just_saved=4, keep_last=3) == [1]
    assert to_delete([1, 2, 9], just_saved=2, keep_last=1) == [1]  # 9: an abandoned branch, left alone
    assert to_delete([5], just_saved=5, keep_last=1) == []


def test_every_n_steps(tmp_path):
    m = ckpt.CheckpointManager(tmp_path, every_n_steps=3)
    handles = [m.save(step, _state(step)) for step in range(7)]
    assert [h is not None for h in handles] == [True, False, False, True, False, False, True]
    assert m.steps() == [0, 3, 6]
    assert m.save(7, _state(7), force=True) is not None


def test_latest_and_restore(tmp_path):
    m = ckpt.CheckpointManager(tmp_path, keep_last=5)
    assert m.latest() is None and m.restore() is None
    for step in (10, 20):
        m.save(step, _state(step), blocking=False)
    m.wait()
    assert m.latest() == tmp_path / "step_20"
    assert torch.equal(m.restore()["params"]["w"], torch.full((4,), 20.0))


def test_leftovers_are_ignored_then_cleaned(tmp_path):
    m = ckpt.CheckpointManager(tmp_path)
    m.save(1, _state(1))
    (tmp_path / ".step_2.tmp-abcd").mkdir()
    (tmp_path / ".step_2.tmp-abcd" / "rank_00000.safetensors").write_bytes(b"partial")
    assert m.latest() == tmp_path / "step_1"
    m.save(2, _state(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_2"]


def test_a_corrupt_checkpoint_at_the_same_step_is_set_aside(tmp_path):
    m = ckpt.CheckpointManager(tmp_path)
    m.save(1, _state(1))
    with pytest.raises(ckpt.CheckpointExistsError):
        m.save(1, _state(1))
    (tmp_path / "step_1" / "rank_00000.safetensors").unlink()
    with pytest.warns(ckpt.CorruptCheckpointWarning, match="moved to .step_1.corrupt-"):
        m.save(1, _state(1))
    assert m.latest() == tmp_path / "step_1"
    assert any(p.name.startswith(".step_1.corrupt-") for p in tmp_path.iterdir())


def test_private_manager_refuses_state_without_accountant(tmp_path):
    m = ckpt.CheckpointManager(tmp_path, private=True)
    with pytest.raises(ckpt.MissingAccountantError):
        m.save(1, _state(1))
    assert m.steps() == []


def test_retention_deletes_only_its_own_run_s_checkpoints(tmp_path):
    """Another run's checkpoints (another run id), a checkpoint without a run id and a user's
    folder named like a step are never deleted, nor counted among ``keep_last``."""
    other = ckpt.CheckpointManager(tmp_path, keep_last=5)
    for step in (3, 6):
        other.save(step, _state(step))
    anonymous = tmp_path / "step_4"
    ckpt.save(anonymous, _state(4), mesh=other.mesh, strategy=None)
    assert ckpt.read_manifest(anonymous).run_id is None
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / "important.txt").write_text("mine")
    m = ckpt.CheckpointManager(tmp_path, keep_last=2)
    assert m.run_id != other.run_id
    for step in (7, 8, 9):
        m.save(step, _state(step))
    assert m.steps() == [1, 3, 4, 6, 8, 9]  # its own 7 went; nothing else did
    assert (tmp_path / "step_1" / "important.txt").read_text() == "mine"
    assert ckpt.read_manifest(tmp_path / "step_9").run_id == m.run_id
    again = ckpt.CheckpointManager(tmp_path, keep_last=1, run_id=m.run_id)  # the run, continued by a new process
    again.save(10, _state(10))
    assert again.steps() == [1, 3, 4, 6, 10]



def test_a_failed_async_save_surfaces_at_the_next_save(tmp_path, monkeypatch):
    """A background save that fails (its commit raises ENOSPC; the real full disk is
    ``tests/test_fault_injection.py``'s) is reported by the next ``save``, before that one writes
    anything, and only once; ``wait`` answers each save once."""
    m = ckpt.CheckpointManager(tmp_path, keep_last=5)
    m.save(1, _state(1), blocking=False)
    assert m.wait() == tmp_path / "step_1" and m.wait() is None

    def full(tmp, directory, manifest):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(ckpt.commit, "commit", full)
        m.save(2, _state(2), blocking=False)
        saver_for(m.coordinator).wait_idle()
    with pytest.raises(ckpt.SaveError, match=r"step_2 not saved: .*No space left on device"):
        m.save(3, _state(3), blocking=False)
    assert m.steps() == [1]  # step 3 was not started
    m.save(3, _state(3), blocking=False)  # raised once: the next save goes on
    assert m.wait() == tmp_path / "step_3" and m.steps() == [1, 3]


def test_step_of_inverts_step_dir(tmp_path):
    from ckpt.manager import step_dir, step_of
    for step in (0, 7, 1200):
        assert step_of(step_dir(tmp_path, step)) == step
        assert step_of(str(step_dir(tmp_path, step))) == step
    for name in ("step_x", "step_-1", "steps_3", "step_3.tmp", "run_3", "step_"):
        assert step_of(tmp_path / name) is None, name
