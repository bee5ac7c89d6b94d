"""The set-up's pins: ``constraints.txt`` holds the exact version of every package the suite was
last run with; ``make`` installs through it, ``pyproject.toml`` keeps ranges for users.

    python .ci/pins.py freeze   # print constraints.txt for the packages installed here
    python .ci/pins.py check    # exit 1 naming each installed package that differs from its pin
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PINS = ROOT / "constraints.txt"
UNPINNED = {"fsdpx", "pip", "setuptools", "wheel"}  # the project itself and the installers
HEADER = """\
# Exact versions the whole suite last passed with (issue 26). `make demo` / `make test` install
# through this file; pyproject.toml keeps ranges for users. Move the pins with `make pins`: a fresh
# environment with the newest versions pyproject.toml admits, the whole suite, then this file.
"""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    """``{normalised name: version}`` of every distribution installed, the local version label
    (``+cpu``) dropped so a pin reads as the release it is."""
    out = {}
    for dist in metadata.distributions():
        name = _norm(dist.metadata["Name"])
        if name not in UNPINNED:
            out[name] = dist.version.split("+")[0]
    return out


def pinned(path: Path = PINS) -> dict[str, str]:
    """``{normalised name: version}`` from a constraints file of ``name==version`` lines."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[_norm(name)] = version.strip()
    return pins


def freeze() -> str:
    return HEADER + "".join(f"{n}=={v}\n" for n, v in sorted(installed().items()))


def differences(path: Path = PINS) -> list[str]:
    """One line per installed package whose version is not its pin, or that has no pin."""
    pins, have = pinned(path), installed()
    lines = [f"{n} {v} installed, pinned {pins[n]}" for n, v in sorted(have.items()) if n in pins and pins[n] != v]
    lines += [f"{n} {v} installed, not in constraints.txt" for n, v in sorted(have.items()) if n not in pins]
    return lines


def main(argv: list[str]) -> int:
    if argv == ["freeze"]:
        sys.stdout.write(freeze())
        return 0
    if argv == ["check"]:
        bad = differences()
        for line in bad:
            print(f"pins: {line}", file=sys.stderr)
        if not bad:
            print(f"pins: the {len(installed())} installed packages are the versions in constraints.txt")
        return 1 if bad else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
