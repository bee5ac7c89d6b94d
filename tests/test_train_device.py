"""``fsdpx train --device``: cpu is today's run bit for bit, cuda without a GPU is refused before
anything is written, the backend follows the device, and tensors are put on the device where
they are made (checked on CPU with the ``meta`` device standing in for a GPU)."""

import json

import pytest
import torch
import torch.distributed as dist

import ckpt
from fsdpx.runtime.dist_comm import backend_for, init_from_env, shutdown
from fsdpx.runtime.owned_noise import shard_noise
from fsdpx.sharding import Mesh
from fsdpx.train import ConfigError, RunConfig, run
from fsdpx.cli import main
from fsdpx.train.config import read_file, to_toml
from fsdpx.train.device import DeviceUnavailableError, run_device, to_device
from fsdpx.train.launch import free_port
from fsdpx.train.resume import segment_config
from fsdpx.train.sources import build_source

TINY = dict(corpus_chars=20000, batch_size=32, n_embd=16, n_head=2, seed=3, steps=3)


def _records(path):
    clocks = ("step_seconds", "elapsed_seconds")  # wall time: differs from run to run
    return [{k: v for k, v in json.loads(line).items() if k not in clocks} for line in path.read_text().splitlines()]


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def test_device_cpu_and_auto_without_a_gpu_are_the_default_run_bit_for_bit(tmp_path, no_gpu):
    torch.set_num_threads(1)
    out = {}
    for name, extra in [("default", {}), ("cpu", {"device": "cpu"}), ("auto", {"device": "auto"})]:
        summary = run(RunConfig.of(out=str(tmp_path), name=name, **TINY, **extra), progress=False)
        out[name] = (_records(tmp_path / name / "metrics.jsonl"), summary["sample"], summary["epsilon"])
    assert out["default"] == out["cpu"] == out["auto"]
    assert RunConfig().run.device == "cpu"


def test_cuda_without_a_gpu_is_refused_by_name_before_anything_is_written(tmp_path, no_gpu, capsys):
    with pytest.raises(DeviceUnavailableError, match="device cuda: torch.cuda.is_available"):
        run(RunConfig.of(out=str(tmp_path), device="cuda", ckpt_dir=str(tmp_path / "ck"), **TINY), progress=False)
    for argv in [[], ["--strategy", "zero3", "--nproc", "2"]]:  # one process; before torchrun starts any
        with pytest.raises(SystemExit) as exit_:
            main(["train", "--device", "cuda", "--out", str(tmp_path), "--steps", "1", *argv])
        assert exit_.value.code == 2
        assert "device cuda: torch.cuda.is_available() is False" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_cuda_needs_one_gpu_per_process(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert run_device("cuda") == torch.device("cuda", 0)
    assert run_device("auto", processes=1) == torch.device("cuda", 0)
    assert run_device("auto", processes=2) == torch.device("cpu")  # auto never puts two ranks on one GPU
    with pytest.raises(DeviceUnavailableError, match="2 processes need one GPU each, this machine has 1"):
        run_device("cuda", processes=2)
    with pytest.raises(DeviceUnavailableError, match="one GPU each"):
        run_device("cuda", local_rank=1)


def test_the_backend_is_chosen_from_the_device_not_from_the_machine(monkeypatch):
    assert backend_for("cpu") == "gloo" and backend_for(torch.device("cpu")) == "gloo"
    assert backend_for("cuda") == "nccl" and backend_for(torch.device("cuda", 1)) == "nccl"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine: cpu still means gloo
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    assert not dist.is_initialized()
    comm = init_from_env(Mesh(dp=1), device="cpu", timeout_s=20)
    try:
        assert dist.get_backend() == "gloo" and comm.device == torch.device("cpu")
    finally:
        shutdown()


def test_a_device_that_is_not_a_choice_is_refused_and_the_field_reads_back_from_its_file(tmp_path):
    with pytest.raises(ConfigError, match="device must be one of auto, cpu, cuda"):
        RunConfig.of(device="tpu")
    config = RunConfig.of(device="auto")
    path = tmp_path / "run.toml"
    path.write_text(to_toml(config))
    assert RunConfig.of(**read_file(path)) == config


def test_a_resume_asks_for_its_device_anew():
    base = RunConfig.of(device="cuda", ckpt_dir="ck")
    assert segment_config(base, {"resume": True}).run.device == "cpu"
    assert segment_config(base, {"resume": True, "device": "cuda"}).run.device == "cuda"


# --- the device is put where tensors are made: "meta" stands in for a GPU (no data, any op moves to it)


def test_a_source_moves_its_model_and_params_and_keeps_its_data_on_the_host():
    source = build_source(RunConfig.of(**TINY))
    assert source.to(torch.device("cpu")) is source  # on the CPU: nothing copied
    moved = source.to(torch.device("meta"))
    assert all(p.device.type == "meta" for p in [*moved.params.values(), *moved.model.parameters()])
    assert moved.inputs.device.type == "cpu" and moved.targets.device.type == "cpu"


def test_a_batch_moves_whole_and_a_batch_already_there_is_not_copied():
    x, y = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)
    assert all(t.device.type == "meta" for t in to_device((x, {"ids": y}), torch.device("meta"))[1].values())
    same = to_device((x, y), torch.device("cpu"))
    assert same[0] is x and same[1] is y


def test_sharded_noise_is_made_on_the_shards_device_with_the_host_bits():
    """The device path's bits are the host's: tests/test_noise.py; here, where the shard lives."""
    box = ((0, 3), (1, 5))
    host = shard_noise("w", (4, 6), box, key=3, step=2, std=0.5, dtype=torch.float32)
    assert shard_noise("w", (4, 6), box, key=3, step=2, std=0.5, dtype=torch.float32,
                       device="meta").device.type == "meta"
    assert torch.equal(shard_noise("w", (4, 6), box, key=3, step=2, std=0.5, dtype=torch.float32, device="cpu"), host)


def test_a_checkpoint_loads_each_tensor_onto_the_device_of_the_fresh_states_tensor(tmp_path):
    state = {"params": {"w": torch.arange(6.0).reshape(2, 3)}, "host": {"m": torch.ones(3)}, "extra": torch.zeros(2)}
    ckpt.save(tmp_path / "c", state, mesh=Mesh(dp=1), strategy=None).wait()
    like = {"params": {"w": torch.empty(2, 3, device="meta")}, "host": {"m": torch.empty(3)}}
    loaded = ckpt.load(tmp_path / "c", mesh=Mesh(dp=1), strategy=None, like=like)
    assert loaded["params"]["w"].device.type == "meta"  # the run's device
    assert loaded["host"]["m"].device.type == "cpu"  # an offloaded optimizer's host state stays on the host
    assert loaded["extra"].device.type == "cpu"  # not in the fresh state (a ZenFlow window): the host
    plain = ckpt.load(tmp_path / "c", mesh=Mesh(dp=1), strategy=None)
    assert torch.equal(plain["params"]["w"], state["params"]["w"]) and plain["params"]["w"].device.type == "cpu"
