"""State <-> (JSON tree, {path: tensor}) (``ckpt.flatten``)."""

import json
import math
from concurrent.futures import Future
from typing import NamedTuple

import numpy as np
import pytest
import torch

from ckpt.errors import UnsupportedStateError
from ckpt.flatten import contains_type, flatten, unflatten
from privacy.accounting import Accountant
from privacy.sampling import PoissonSampler
from privacy.step import DPConfig, TrainState


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
