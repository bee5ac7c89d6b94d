"""Real gloo processes on a transformers model, unmodified (issue 14): BERT with attention
masks and padding, mapping inputs, private ZeRO-3 on 2 processes, equals the single-process
private run (``make_private_step``) in float64; the second batch is a fixed-shape padded
Poisson batch (``privacy.padding``), whose masked row one rank holds."""

import os
import subprocess

import pytest
import torch

from fsdpx import Mesh, strategies, unshard
from fsdpx.train.launch import torchrun_command
from privacy.step import init_state, make_private_step

from support.gloo_bert_problem import NUM_EXAMPLES, batches, config, make_bert, optimizer
from support.hf import cls_loss
from support.processes import python_env

pytest.importorskip("transformers")
HERE = os.path.dirname(__file__)

pytestmark = pytest.mark.slow


def test_bert_private_zero3_on_gloo_equals_the_single_process_run(tmp_path):
    cmd = torchrun_command(2, [os.path.join(HERE, "hf_worker.py"), "--out", str(tmp_path)])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=python_env(OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    model = make_bert()
    state = init_state(dict(model.named_parameters()), optimizer(), key=5, config=config())
    step = make_private_step(model, cls_loss, optimizer(), config(), num_examples=NUM_EXAMPLES)
    losses = []
    for b in batches():
        state, m = step(state, b)
        losses.append(m["loss"])
    mesh, at_rest = Mesh(dp=2), strategies.zero3()
    for name, want in state.params.items():
        got = unshard([r["params"][name] for r in results], at_rest.param_at_rest(want.dim()), mesh)
        torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-10, atol=1e-12, msg=name)
    for r in results:
        assert [m["batch_size"] for m in r["metrics"]] == [3, 3]
        assert [m["loss"] for m in r["metrics"]] == pytest.approx(losses, rel=1e-12)
