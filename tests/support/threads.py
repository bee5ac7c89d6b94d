"""The fixture test modules of tiny CPU runs share: torch on one thread for each test."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models are fastest on one thread, and on a busy machine a second one mostly waits;
    the thread count is put back after the test. Import it into a test module to use it there."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
