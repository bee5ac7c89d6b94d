"""State <-> (JSON tree, {path: tensor}) (``ckpt.flatten``)."""

import json
import math
import os
import subprocess
import sys
import textwrap
from concurrent.futures import Future
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch

from ckpt.errors import UnsupportedStateError
from ckpt.flatten import contains_type, flatten, unflatten
from privacy.accounting import Accountant
from privacy.sampling import PoissonSampler
from privacy.step import DPConfig, TrainState

ROOT = Path(__file__).resolve().parent.parent


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def test_round_trip_keeps_types_order_and_bits():
    acc = Accountant(delta=1e-5, accountant="rdp").record(1.1, 0.01, 3)
    state = TrainState(
        params={"z.weight": torch.randn(3, 2), "a/b": torch.tensor(1.5, dtype=torch.float64)},
        opt_state={"count": 3, "mu": {"z.weight": torch.zeros(3, 2)}, "bits": torch.tensor([True, False])},
        step=3, key=2**62 + 1, accountant=acc,
    )
    full = {"train": state, "sampler": PoissonSampler(100, 0.1, key=4), "dp": DPConfig(1.0, 1.1, 0.01),
            "misc": [None, True, 0.1, float("inf"), float("-inf"), float("nan"), (1, ("x",)), "s", []]}
    tree, tensors = flatten(full)
    tree = json.loads(json.dumps(tree, allow_nan=False))  # it really is strict JSON
    assert set(tensors) == {"train/params/z.weight", "train/params/a%2Fb", "train/opt_state/mu/z.weight",
                            "train/opt_state/bits"}
    back = unflatten(tree, tensors.__getitem__)
    assert _same(back, full)
    assert back["train"].accountant.epsilon() == acc.epsilon()
    assert contains_type(tree, "Accountant") and not contains_type(flatten({"x": 1})[0], "Accountant")


@pytest.mark.parametrize("leaf, where", [
    (Future(), "opt/pending"),
    (np.zeros(2), "opt/pending"),
    (NamedTuple("P", [("a", int)])(1), "opt/pending"),
    ({1: 2}, "opt/pending"),
])
def test_unsupported_leaf_names_its_path(leaf, where):
    with pytest.raises(UnsupportedStateError, match=where):
        flatten({"opt": {"pending": leaf}})


def test_unknown_type_tag_is_an_error_not_an_import():
    with pytest.raises(UnsupportedStateError, match="os.system"):
        unflatten({"$type": "os.system", "value": "echo hi"}, lambda p: None)


def test_a_type_decodes_once_its_package_is_imported():
    """``ckpt`` imports nothing of ``privacy``: in a fresh process a ``TrainState`` is an unknown
    tag until privacy is imported, and importing any of its modules (``privacy.noise`` here, not
    where the types live) registers every one of its types."""
    script = textwrap.dedent("""
        import sys
        from ckpt.errors import UnsupportedStateError
        from ckpt.flatten import unflatten
        tree = {"$type": "TrainState", "value": {"$dict": [
            ["params", {"$dict": []}], ["opt_state", None], ["step", 3], ["key", 1],
            ["accountant", {"$type": "Accountant", "value": {"$dict": [
                ["accountant", "rdp"], ["delta", 1e-05], ["epsilon_budget", None],
                ["value_discretization_interval", 0.0001], ["events", []]]}}]]}}
        try:
            unflatten(tree, lambda p: None)
        except UnsupportedStateError as e:
            assert "TrainState" in str(e), e
        else:
            raise AssertionError("decoded a TrainState without privacy")
        assert not any(m == "privacy" or m.startswith("privacy.") for m in sys.modules), "ckpt imported privacy"
        import privacy.noise
        state = unflatten(tree, lambda p: None)
        assert type(state).__name__ == "TrainState" and state.step == 3 and state.accountant.steps == 0
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
