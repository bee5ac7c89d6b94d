"""Data larger than memory (issue 29, item 4): token files mapped as stored and cut into examples
on demand, the batches and losses of the same tokens held in memory, a peak RSS that does not
grow with the file, and a Poisson draw without an array of the dataset's size. Tiny models."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import privacy.sampling as sampling
from fsdpx.train import RunConfig, data, loop, run
from fsdpx.train.segments import DataChangeError, data_digest
from fsdpx.train.sources import build_source
from privacy.sampling import PoissonSampler
from privacy.step import sample_batch
from support.threads import one_thread  # noqa: F401 - autouse fixture

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(n_layer=1, n_embd=8, n_head=1, block_size=8, batch_size=16.0, target_epsilon=4.0, steps=4)




def _tokens(n: int = 4001, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 60, n).astype(np.uint16)


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("step_seconds", "elapsed_seconds")} for r in rows]


def _in_memory(monkeypatch) -> None:
    """The run's source as it was before files were mapped: the whole stream read as int64 and
    cut by :func:`data.windows` into tensors."""
    real = loop.build_source

    def build(config, **kw):
        source = real(config, **kw)
        stream = source.inputs.stream
        ids = torch.from_numpy(np.asarray(stream[0:len(stream)], dtype=np.int64).copy())
        inputs, targets = data.windows(ids, config.data.block_size)
        return source._replace(inputs=inputs, targets=targets)

    monkeypatch.setattr(loop, "build_source", build)


# --------------------------------------------------------------------------- examples cut on demand


def test_windows_give_the_rows_of_the_in_memory_examples_for_any_index():
    ids = _tokens(1003)
    want_x, want_y = data.windows(torch.from_numpy(ids.astype(np.int64)), 10)
    x, y = data.mapped_windows(ids, 10)
    assert x.shape == tuple(want_x.shape) == (100, 10) and len(y) == 100
    rows = torch.tensor([0, 99, 5, 5, 42])
    for key in (rows, rows.numpy(), [3, 1], slice(None), slice(7, 20, 3), 0, -1, 57, np.int64(4), torch.tensor(9)):
        assert torch.equal(x[key], want_x[key]) and torch.equal(y[key], want_y[key]), key
        assert x[key].dtype == torch.int64
    assert torch.equal(x[0, :1], want_x[0, :1]) and torch.equal(x[:1], want_x[:1]) and torch.equal(x[2:5, 3], want_x[2:5, 3])
    assert torch.equal(x[torch.tensor([], dtype=torch.int64)], want_x[:0])
    for bad in (100, -101, torch.tensor([100])):
        with pytest.raises(IndexError):
            x[bad]


def test_mapped_bin_and_npy_sources_hold_no_int64_stream(tmp_path):
    ids = _tokens()
    ids.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", ids)
    for name in ("t.bin", "t.npy"):
        source = build_source(RunConfig.of(data_path=str(tmp_path / name), **TINY))
        assert isinstance(source.inputs, data.Windows) and isinstance(source.inputs.stream, np.memmap)
        assert source.inputs.stream.dtype == np.uint16, name  # as stored: never widened whole
        assert source.vocab_size == int(ids.max()) + 1
    assert data.id_range(np.memmap(tmp_path / "t.bin", np.uint16, mode="r")) == (int(ids.min()), int(ids.max()))
    assert data.id_range(np.zeros(0, np.uint16)) == (0, -1)


def test_streaming_passes_read_in_chunks_the_values_of_the_whole_file(tmp_path):
    ids = _tokens(10_007)
    ids.tofile(tmp_path / "t.bin")
    mapped = np.memmap(tmp_path / "t.bin", np.uint16, mode="r")
    for start, stop, size in ((0, None, 1000), (1, 9999, 4096), (5, 5, 7), (0, 10_007, 1 << 22)):
        got = [c.copy() for c in data.stream_chunks(mapped, start, stop, size=size)]
        assert all(len(c) <= size for c in got)
        assert np.array_equal(np.concatenate(got) if got else ids[:0], ids[start:stop])


def test_a_mapped_digest_names_the_tokens_and_its_legacy_digest_is_the_int64_one(tmp_path):
    ids = _tokens()
    ids.tofile(tmp_path / "t.bin")
    mapped = data.mapped_windows(np.memmap(tmp_path / "t.bin", np.uint16, mode="r"), 8)
    held = data.windows(torch.from_numpy(ids.astype(np.int64)), 8)
    digest = data_digest(*mapped)
    assert digest.startswith("v2:") and digest == data_digest(*data.mapped_windows(ids.copy(), 8))
    assert digest.legacy() == data_digest(*held)  # how checkpoints from before mapping are recognised
    other = ids.copy()
    other[-2] += 1  # a token of the last example's target
    assert data_digest(*data.mapped_windows(other, 8)) != digest
    assert data_digest(*data.mapped_windows(ids, 9)) != digest
    assert data_digest(*data.mapped_windows(ids[:-7], 8)) != digest  # 3995 tokens: one example fewer
    source = build_source(RunConfig.of(data_path=str(tmp_path / "t.bin"), **TINY))
    assert source.inputs.digest() == digest  # hashed by the source's background thread


def test_the_mapped_digest_does_not_depend_on_the_threads_and_sees_every_segment(tmp_path, monkeypatch):
    ids = _tokens(10_001)
    ids.tofile(tmp_path / "t.bin")
    mapped = np.memmap(tmp_path / "t.bin", np.uint16, mode="r")
    monkeypatch.setattr(data, "DIGEST_SEGMENT", 999)
    monkeypatch.setattr(data, "CHUNK_TOKENS", 250)
    digests = set()
    for threads in (1, 3, 8):
        monkeypatch.setattr(data, "DIGEST_THREADS", threads)
        digests.add(data.mapped_windows(mapped, 8)[0].digest())
        assert data.scan(mapped, 10_001, "(1250, 8)") == (int(ids.min()), int(ids.max()), *digests)
    assert len(digests) == 1
    for at in (0, 998, 999, 5000, 10_000):  # segment edges and the last token a target holds
        other = ids.copy()
        other[at] += 1
        assert data.mapped_windows(other, 8)[0].digest() not in digests, at


# --------------------------------------------------------------------------- runs


@pytest.mark.parametrize("name", ["t.bin", "t.npy", "t32.bin"])
def test_a_mapped_token_file_trains_the_batches_and_losses_of_the_tokens_in_memory(tmp_path, monkeypatch, name):
    ids = _tokens()
    ids.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", ids)
    ids.astype(np.uint32).tofile(tmp_path / "t32.bin")
    config = RunConfig.of(data_path=str(tmp_path / name), data_dtype="uint32" if "32" in name else "uint16",
                          out=str(tmp_path), name="mapped", **TINY)
    source = build_source(config)
    sampler = PoissonSampler(len(source.inputs), 0.03, key=1)
    held = data.windows(torch.from_numpy(ids.astype(np.int64)), 8)
    for step in range(3):
        got, want = sample_batch((source.inputs, source.targets), sampler, step), sample_batch(held, sampler, step)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    run(config, progress=False)
    _in_memory(monkeypatch)
    run(config.replace(name="held"), progress=False)
    mapped, before = _rows(tmp_path / "mapped"), _rows(tmp_path / "held")
    assert len(mapped) == 4 and mapped == before


def test_a_saved_datasets_token_column_is_read_through_arrows_map_and_trains_the_same(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    ids = _tokens(4001)
    rows = [ids[i: i + n].tolist() for i, n in zip(range(0, 4001, 7), [7] * 572)]  # rows of 7 (the last of 3)
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(tmp_path / "ds"), max_shard_size="8KB")
    config = RunConfig.of(data_path=str(tmp_path / "ds"), out=str(tmp_path), name="mapped", **TINY)
    source = build_source(config)
    stream = source.inputs.stream
    assert isinstance(stream, data.ChunkedStream) and len(stream.pieces) > 1  # one piece per Arrow chunk
    assert not any(p.flags.owndata for p in stream.pieces)  # views of the map, not copies
    held = data.windows(torch.from_numpy(ids.astype(np.int64)), 8)
    assert torch.equal(source.inputs[:], held[0]) and torch.equal(source.targets[:], held[1])
    assert np.array_equal(stream[5:3000], ids[5:3000]) and np.array_equal(stream[[[0, 4000], [7, 8]]], ids[[[0, 4000], [7, 8]]])
    run(config, progress=False)
    _in_memory(monkeypatch)
    run(config.replace(name="held"), progress=False)
    assert _rows(tmp_path / "mapped") == _rows(tmp_path / "held")


def test_a_checkpoint_from_before_mapping_resumes_on_the_mapped_file(tmp_path, monkeypatch):
    ids = _tokens()
    ids.tofile(tmp_path / "t.bin")
    fixed = {**TINY, "target_epsilon": None, "noise_multiplier": 1.0}  # the noise of 4 steps, in any segment
    base = RunConfig.of(data_path=str(tmp_path / "t.bin"), out=str(tmp_path), **fixed)
    run(base.replace(name="whole"), progress=False)
    with monkeypatch.context() as m:
        _in_memory(m)  # the checkpoint records the int64 digest of the examples
        run(base.replace(name="old", steps=2, ckpt_dir=str(tmp_path / "ck"), ckpt_every=2), progress=False)
    record = json.loads((tmp_path / "ck" / "run.json").read_text())
    assert not record["segments"][0]["fingerprint"]["data"].startswith("v2:")
    run(base.replace(name="old", resume=True, overwrite=True, ckpt_dir=str(tmp_path / "ck"), ckpt_every=2),
        progress=False)
    assert _rows(tmp_path / "old") == _rows(tmp_path / "whole")  # resumed bit for bit, no new-data refusal
    _tokens(seed=1).tofile(tmp_path / "t.bin")
    with pytest.raises(DataChangeError):  # other tokens are still refused
        run(base.replace(name="old", steps=6, resume=True, overwrite=True, ckpt_dir=str(tmp_path / "ck")),
            progress=False)


PEAK = textwrap.dedent("""
    import resource, sys
    import torch
    torch.set_num_threads(1)
    from fsdpx.train import RunConfig, run
    for path in sys.argv[2:]:  # the tiny file first: the peak it sets is the baseline
        run(RunConfig.of(data_path=path, out=sys.argv[1], name=path.split("/")[-1] + ".run", n_layer=1, n_embd=8, n_head=1,
                         block_size=2, batch_size=64.0, noise_multiplier=1.0, steps=3), progress=False)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
""")


def test_a_token_file_larger_than_the_run_needs_leaves_the_peak_rss_where_a_tiny_file_has_it(tmp_path):
    """128 MiB of uint16 tokens, cut into 2-token examples: 32 M examples (above the sampler's
    threshold, so the draw is by skips). Held as int64 before, with a mask of a uniform per
    example: over 1 GiB more than a tiny file's run in the same process; now within 32 MiB and the
    scan's read buffers."""
    big, small = tmp_path / "big.bin", tmp_path / "small.bin"
    rng = np.random.default_rng(0)
    with open(big, "wb") as f:
        for _ in range(16):  # 16 x 8 MiB
            rng.integers(0, 60, 1 << 22).astype(np.uint16).tofile(f)
    _tokens(5001).tofile(small)
    assert len(np.memmap(big, np.uint16, mode="r")) // 2 > sampling.SKIP_ABOVE
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path), str(small), str(big)], capture_output=True,
                          text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    tiny, peak = map(int, done.stdout.split()[-2:])
    grew = peak - tiny
    buffers = min(data.DIGEST_THREADS, os.cpu_count() or 1) * data.CHUNK_TOKENS * 2  # the scan's read buffers
    assert grew < 32 * 2**20 + buffers, f"peak RSS grew by {grew / 2**20:.0f} MiB for a {big.stat().st_size >> 20} MiB file"


def test_a_bad_token_id_is_named_at_the_step_that_reads_it(tmp_path, capsys):
    """Nothing reads a mapped file whole before the first step: with ``--vocab-size`` given, ids
    the model does not cover (every 50th token here) are not refused while the source is built
    but as a batch is read: a row names the file, the id and its offset (token and byte), and a
    run stops at its first step with exit 2 and that one line, no step recorded."""
    from fsdpx.train.cli import main
    from fsdpx.train.sources import VocabularyError

    ids = _tokens()
    ids[::50] = 70
    path = tmp_path / "t.bin"
    ids.tofile(path)
    source = build_source(RunConfig.of(data_path=str(path), vocab_size=64, **TINY))  # not refused: nothing read
    assert torch.equal(source.inputs[5], torch.from_numpy(ids[40:48].astype(np.int64)))  # a row without one
    with pytest.raises(VocabularyError, match=r"t\.bin holds token id 70 at token 50 \(byte 100\), but the model's"
                                              r" vocabulary has 64 ids"):
        source.inputs[6]  # tokens 48..55
    with pytest.raises(VocabularyError, match=r"at token 50 \(byte 100\)"):
        source.targets[[5, 6]]  # tokens 41..48 and 49..56
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--data-path", str(path), "--vocab-size", "64", "--n-layer", "1", "--n-embd", "8", "--n-head",
              "1", "--block-size", "8", "--batch-size", "16", "--steps", "2", "--out", str(tmp_path / "runs"),
              "--name", "bad", "--no-progress"])
    assert exit_.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and f"{path} holds token id 70 at token" in err[0], err
    assert (tmp_path / "runs" / "bad" / "metrics.jsonl").read_text() == ""


def test_a_fresh_segment_waits_for_the_digest_only_to_record_it(tmp_path):
    """The digest of a mapped file is hashed in the background: a fresh segment's plan takes a
    function for it and never calls it (its fingerprint says "pending"), a resume calls it to
    compare; a run's checkpoint record holds the file's real digest, the one ``data_digest``
    gives."""
    from fsdpx.train.build import build_step, resolve_privacy, resolve_sample_rate
    from fsdpx.train.checkpoints import checkpoint_manager
    from fsdpx.train.resume import plan_segment
    from fsdpx.train.segments import PENDING_DIGEST

    ids = _tokens()
    ids.tofile(tmp_path / "t.bin")
    config = RunConfig.of(data_path=str(tmp_path / "t.bin"), out=str(tmp_path), ckpt_dir=str(tmp_path / "ck"),
                          ckpt_every=2, noise_multiplier=1.0, **{**TINY, "target_epsilon": None})
    source = build_source(config)
    asked = []

    def digest() -> str:
        asked.append(1)
        return data_digest(source.inputs, source.targets)

    assert run(config.replace(name="first", steps=2), progress=False)["steps"] == 2
    want = data_digest(source.inputs, source.targets)
    assert json.loads((tmp_path / "ck" / "run.json").read_text())["segments"][-1]["fingerprint"]["data"] == want
    assert json.loads((tmp_path / "first" / "config.json").read_text())["segments"][-1]["fingerprint"]["data"] == want

    dp = resolve_privacy(config, resolve_sample_rate(config, len(source.inputs)))
    fresh, _ = build_step(config, source.model, source.params, dp, num_examples=len(source.inputs),
                          loss_fn=source.loss_fn)
    for ckpt_dir, resume in ((tmp_path / "ck", True), (tmp_path / "empty", False)):
        c = config.replace(ckpt_dir=str(ckpt_dir), resume=resume, steps=4)
        plan = plan_segment(c, params=source.params, fresh=fresh, dp=dp, digest=digest,
                            manager=checkpoint_manager(c, None, private=True), data=source.description)
        assert plan.start == (2 if resume else 0)
        assert (plan.segments[-1]["fingerprint"]["data"] == PENDING_DIGEST) != resume
    assert asked == [1]  # the resume compared; the fresh segment did not wait
    assert asked == [1] and plan.segments[-1]["fingerprint"]["data"] == PENDING_DIGEST


# --------------------------------------------------------------------------- the Poisson draw


def _one_mask(num_examples: int, rate: float, key: int, step: int) -> np.ndarray:
    """The draw every run made before: one uniform per example, in one array."""
    digest = hashlib.blake2b(f"{key}:{step}".encode(), digest_size=16, person=b"fsdpx.sample.v1").digest()
    gen = np.random.Generator(np.random.SFC64(int.from_bytes(digest, "little")))
    return np.flatnonzero(gen.random(num_examples) < rate)


def test_chunked_mask_is_the_draw_of_one_mask():
    chunk = sampling.MASK_CHUNK
    for n in (1, 17, chunk - 1, chunk, chunk + 1, 3 * chunk + 5):
        for step in (0, 7):
            got = PoissonSampler(n, 0.01, key=3).indices(step).numpy()
            assert np.array_equal(got, _one_mask(n, 0.01, 3, step)), (n, step)


def test_the_draw_changes_method_only_above_the_threshold(monkeypatch):
    monkeypatch.setattr(sampling, "SKIP_ABOVE", 1000)
    at = PoissonSampler(1000, 0.3, key=2)
    assert all(np.array_equal(at.indices(t).numpy(), _one_mask(1000, 0.3, 2, t)) for t in range(5))
    above = PoissonSampler(1001, 0.3, key=2)
    assert not all(np.array_equal(above.indices(t).numpy(), _one_mask(1001, 0.3, 2, t)) for t in range(5))
    assert np.array_equal(above.indices(4).numpy(), PoissonSampler(1001, 0.3, key=2).indices(4).numpy())  # pure


@pytest.mark.parametrize("rate", [0.05, 0.5])
def test_skip_draw_has_the_bernoulli_distribution(rate):
    """Each index is in with probability ``rate`` (every one of them within 6 standard deviations
    over the draws, and their chi-square within 6 of its own), the batch size has the binomial's
    mean and variance, and indices are independent (pairs of neighbours in at rate ** 2)."""
    n, draws = 1500, 3000
    gen = np.random.Generator(np.random.SFC64(12345))
    counts, sizes, pairs = np.zeros(n), [], 0
    for _ in range(draws):
        idx = sampling.skip_draw(gen, n, rate)
        assert idx.dtype == np.int64 and (np.diff(idx) > 0).all() and (idx.size == 0 or 0 <= idx[0] <= idx[-1] < n)
        counts[idx] += 1
        sizes.append(idx.size)
        pairs += int(np.count_nonzero(np.diff(idx) == 1))
    mean, var = draws * rate, draws * rate * (1 - rate)
    assert np.abs(counts - mean).max() < 6 * np.sqrt(var)
    chi2 = float(((counts - mean) ** 2 / var).sum())
    assert abs(chi2 - n) < 6 * np.sqrt(2 * n)
    sizes = np.array(sizes)
    assert abs(sizes.mean() - n * rate) < 6 * np.sqrt(n * rate * (1 - rate) / draws)
    assert abs(sizes.var() / (n * rate * (1 - rate)) - 1) < 6 * np.sqrt(2 / draws)
    want_pairs = draws * (n - 1) * rate ** 2
    assert abs(pairs - want_pairs) < 6 * np.sqrt(want_pairs)


def test_a_huge_dataset_draws_in_time_and_memory_of_the_batch():
    sampler = PoissonSampler(10**11, 2e-7, key=0)  # a uniform per example would be 800 GB
    idx = sampler.indices(3)
    assert 15_000 < idx.numel() < 25_000 and bool((idx[1:] > idx[:-1]).all()) and int(idx[-1]) < 10**11
    assert torch.equal(idx, sampler.indices(3)) and not torch.equal(idx, sampler.indices(4))
