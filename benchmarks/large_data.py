"""Issue 29 item 4's target: a token file of at least 4 GiB trains with a peak RSS no more than
the same run's on a 10 MiB file + 256 MiB, and its first step starts within 10 s of the launch.

    python benchmarks/large_data.py                     # 4 GiB of uint16 tokens, written once
    python benchmarks/large_data.py --size-gib 1 --dir /tmp/tokens

Each run is ``python -m fsdpx train`` on a ``.bin`` of uint16 token ids (the built-in GPT with
``--vocab-size 256``, private, a fixed noise multiplier, a few steps; then once more on the big
file without ``--vocab-size``, the vocabulary taken from the data) launched as its own process: its peak RSS is
the child's ``ru_maxrss`` (``os.wait4``), the first step's start the time from the launch to
the first line of ``metrics.jsonl`` (written when the first step ends: an upper bound). The big
file is written once and kept in ``--dir`` (its first read after writing comes from the page
cache). Nothing reads the file whole before the first step: each batch's ids are checked as read,
the data digest is hashed by a background thread once the first step is done; only a vocabulary taken from the data costs a
pass for the largest id. Prints one JSON object per run and one with the verdict on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import logger  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 1 << 24  # tokens written at once: 32 MiB of uint16
VOCAB = 256  # the ids written are below it
log = logger("large_data")


def write_tokens(path: Path, nbytes: int) -> None:
    """``nbytes`` of uint16 token ids below 256 (the first one 255, so every file gives the model
    the same vocabulary), unless ``path`` already holds that many."""
    if path.exists() and path.stat().st_size == nbytes:
        return
    rng = np.random.default_rng(0)
    left = nbytes // 2
    with open(path.with_suffix(".part"), "wb") as f:
        first = True
        while left:
            ids = rng.integers(0, 256, min(CHUNK, left)).astype(np.uint16)
            if first:
                ids[0], first = 255, False
            ids.tofile(f)
            left -= len(ids)
    path.with_suffix(".part").rename(path)


def train(path: Path, out: Path, steps: int, *, vocab: bool = True) -> dict:
    """Launch ``fsdpx train`` on ``path`` (with ``--vocab-size``, or without: the built-in GPT's
    vocabulary is then the data's, one pass over the file for its largest id); its peak RSS, the
    seconds to its first metrics line and to its end."""
    name = path.stem + ("" if vocab else "-derived")
    cmd = [sys.executable, "-m", "fsdpx", "train", "--data-path", str(path), "--data-dtype", "uint16",
           *(["--vocab-size", str(VOCAB)] if vocab else []), "--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--block-size", "64", "--batch-size", "32",
           "--noise-multiplier", "1.0", "--steps", str(steps), "--out", str(out), "--name", name, "--overwrite",
           "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    metrics = out / name / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    launched = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = None
    while proc.poll() is None and first is None:
        if metrics.exists() and metrics.stat().st_size:
            first = time.perf_counter() - launched
        time.sleep(0.02)
    _, status, usage = os.wait4(proc.pid, 0)
    ended = time.perf_counter() - launched
    stdout, stderr = proc.stdout.read(), proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"fsdpx train on {path} failed:\n{stderr[-3000:]}{stdout[-1000:]}")
    if first is None:
        first = ended
    return {"file": str(path), "vocab_size": VOCAB if vocab else "from the data", "file_bytes": path.stat().st_size,
            "peak_rss_mib": usage.ru_maxrss / 1024,
            "first_step_line_s": round(first, 2), "total_s": round(ended, 2), "steps": steps}


PHASES = """
import json, sys, time
t0 = time.perf_counter()
import torch
from fsdpx.train import RunConfig
from fsdpx.train.segments import data_digest
from fsdpx.train.sources import build_source
from privacy.sampling import PoissonSampler
from privacy.step import sample_batch
t1 = time.perf_counter()
config = RunConfig.of(data_path=sys.argv[1], data_dtype="uint16", n_layer=2, n_embd=64, n_head=2, block_size=64,
                      batch_size=32.0, noise_multiplier=1.0, vocab_size=256)
source = build_source(config)
t2 = time.perf_counter()
sampler = PoissonSampler(len(source.inputs), 32 / len(source.inputs), key=0)
for step in range(5):
    sample_batch((source.inputs, source.targets), sampler, step)
t3 = time.perf_counter()
digest = data_digest(source.inputs, source.targets)  # starts the background hash and waits for it
t4 = time.perf_counter()
build_source(config.replace(vocab_size=None))  # the built-in GPT's vocabulary from the data: one pass
t5 = time.perf_counter()
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"imports_s": round(t1 - t0, 2), "build_source_s": round(t2 - t1, 2),
                  "five_batches_s": round(t3 - t2, 3), "digest_s": round(t4 - t3, 2),
                  "build_source_vocab_from_data_s": round(t5 - t4, 2),
                  "examples": len(source.inputs), "peak_rss_mib": round(hwm / 1024, 1)}))
"""


def phases(path: Path) -> dict:
    """The data's share of the time before the first step, in a process of its own: the source
    built (the vocabulary pass), the data digest (the second pass), five Poisson batches."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", PHASES, str(path)], env=env, capture_output=True, text=True,
                          check=True)
    return {"file": path.name, **json.loads(done.stdout.splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=4.0, help="the big file's size (the target: at least 4)")
    ap.add_argument("--small-mib", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the token files are written and kept (default: a temp dir)")
    args = ap.parse_args()
    where = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="fsdpx-large-"))
    where.mkdir(parents=True, exist_ok=True)
    small, big = where / "small.bin", where / f"big-{args.size_gib:g}g.bin"
    log(f"writing {small} ({args.small_mib:g} MiB) and {big} ({args.size_gib:g} GiB) if not there")
    write_tokens(small, int(args.small_mib * 2**20) // 2 * 2)
    t = time.perf_counter()
    write_tokens(big, int(args.size_gib * 2**30) // 2 * 2)
    log(f"files ready ({time.perf_counter() - t:.1f} s)")
    for path in (small, big):
        log(f"phases on {path.name}")
        print(json.dumps(phases(path)), flush=True)
    out = where / "runs"
    results = []
    for path in (small, big):
        log(f"training on {path.name}")
        results.append(train(path, out, args.steps))
        print(json.dumps(results[-1]), flush=True)
    base, large = results
    log(f"training on {big.name}, the vocabulary from the data")
    print(json.dumps(train(big, out, args.steps, vocab=False)), flush=True)
    verdict = {"rss_over_small_mib": round(large["peak_rss_mib"] - base["peak_rss_mib"], 1),
               "rss_target_met": large["peak_rss_mib"] <= base["peak_rss_mib"] + 256,
               "first_step_target_met": large["first_step_line_s"] <= 10.0,
               "size_target_met": large["file_bytes"] >= 4 * 2**30}
    print(json.dumps(verdict), flush=True)


if __name__ == "__main__":
    main()
