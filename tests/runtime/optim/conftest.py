"""Shared setup of the optimizer-kernel tests: two intra-op threads (the CI machine has two
cores; more would oversubscribe), and a fixed default dtype."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True, scope="session")
def _two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(min(2, before))
    yield
    torch.set_num_threads(before)

