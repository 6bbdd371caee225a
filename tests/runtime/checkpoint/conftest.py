"""Fixtures of the checkpoint tests."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (a bit-identical resume needs the same reduction order
    as the reference run), restored after it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
