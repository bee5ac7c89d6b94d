"""The set-up's pins (issue 26): the README states the versions constraints.txt pins, every
test dependency is pinned, and the check CI runs names a package that is not its pin."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_DEPENDENCIES = ["torch", "transformers", "peft", "opacus", "datasets", "ray", "hypothesis", "numba", "scipy",
                     "numpy", "safetensors", "tokenizers"]


def _pins_module():
    spec = importlib.util.spec_from_file_location("pins", ROOT / ".ci" / "pins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_test_dependency_is_pinned_and_the_readme_states_the_pins():
    pins = _pins_module().pinned()
    readme = (ROOT / "README.md").read_text()
    listed = re.search(r"Tested with: (.*?)\. `make pins`", readme, re.S).group(1)
    stated = dict(part.split() for part in listed.replace("\n", " ").split(","))
    assert sorted(stated) == sorted(TEST_DEPENDENCIES)
    assert stated == {name: pins[name] for name in TEST_DEPENDENCIES}


def test_the_check_names_a_package_installed_at_another_version(tmp_path):
    pins = _pins_module()
    have = pins.installed()
    moved = dict(have, pytest="0.0.1")
    del moved["hypothesis"]
    path = tmp_path / "constraints.txt"
    path.write_text("# a comment\n" + "".join(f"{n}=={v}\n" for n, v in moved.items()))
    assert sorted(pins.differences(path)) == sorted([
        f"pytest {have['pytest']} installed, pinned 0.0.1",
        f"hypothesis {have['hypothesis']} installed, not in constraints.txt"])
    path.write_text("".join(f"{n}=={v}\n" for n, v in have.items()))
    assert pins.differences(path) == []
