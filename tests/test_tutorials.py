"""The tutorials in ``docs/tutorials/`` run, so none of them can rot.

Each tutorial is a markdown file whose fenced ```` ```python ```` blocks, joined top to bottom,
form one script (what a reader gets by copying them in order). Each script runs in a fresh
interpreter from the repository root, within a time limit, and must exit 0: the tutorials'
``assert`` statements are the equalities they teach (a sharded step equal to an unsharded one,
ghost clipping equal to ``vmap``...), so a change that breaks a claim fails here.

``python tests/test_tutorials.py docs/tutorials/01_dp_sgd_from_scratch.md`` prints the script
of one tutorial (to run or debug it by hand).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "docs" / "tutorials"
FILES = sorted(p for p in TUTORIALS.glob("[0-9]*.md"))
TIME_LIMIT_S = 240  # each tutorial takes < 30 s on a 2-core CPU; the limit only catches a hang
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(markdown: str) -> list[str]:
    """The bodies of the ```` ```python ```` fenced blocks of ``markdown``, in order (other
    fences, ```` ``` ```` or ```` ```text ````, are prose)."""
    return [m.group(1) for m in _BLOCK.finditer(markdown)]


def script_of(path: Path) -> str:
    """One script: every python block of the tutorial at ``path``, top to bottom."""
    blocks = python_blocks(path.read_text())
    return "\n\n".join(f"# --- {path.name}, block {i + 1}\n{b}" for i, b in enumerate(blocks))


def test_there_are_tutorials_and_the_index_lists_each_one():
    assert len(FILES) >= 6, [p.name for p in FILES]
    index = (TUTORIALS / "README.md").read_text()
    for path in FILES:
        assert f"({path.name})" in index, f"docs/tutorials/README.md does not link {path.name}"


def test_extraction_keeps_python_blocks_only_and_in_order():
    md = "intro\n```python\na = 1\n```\n\n```text\nnot code\n```\n```python\nassert a == 1\n```\n"
    assert python_blocks(md) == ["a = 1\n", "assert a == 1\n"]


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_tutorial_runs_top_to_bottom(path, tmp_path):
    script = script_of(path)
    assert script.count("assert") >= 3, f"{path.name} shows too few of its claims as asserts"
    file = tmp_path / (path.stem + ".py")
    file.write_text(script)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MPLBACKEND": "Agg"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(file)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=TIME_LIMIT_S)
    took = time.perf_counter() - start
    assert done.returncode == 0, (f"{path.name} failed after {took:.1f} s (script: {file})\n"
                                  f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-8000:]}")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(script_of(Path(arg)))
