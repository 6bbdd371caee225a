"""Shared setup of the optimizer-kernel tests: two intra-op threads (the CI machine has two
cores; more would oversubscribe). torch is optional for canzona: without it the kernel test
modules skip themselves and this fixture does nothing."""

from __future__ import annotations

import pytest

try:
    import torch
except ImportError:  # planning-only install
    torch = None


@pytest.fixture(autouse=True, scope="session")
def _two_threads():
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(min(2, before))
    yield
    torch.set_num_threads(before)
