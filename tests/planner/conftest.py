"""Fixtures the planner tests share."""

import pytest

from canzona.planner import build_inventory, get_preset


@pytest.fixture(scope="session")
def q32():
    """The inventory of the qwen3-32b preset (read only)."""
    return build_inventory(get_preset("qwen3-32b"))
