"""Fixtures the planner tests share, and the import path of planner_helpers."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # planner_helpers, for the test modules

from canzona.planner import build_inventory, get_preset


@pytest.fixture(scope="session")
def q32():
    """The inventory of the qwen3-32b preset (read only)."""
    return build_inventory(get_preset("qwen3-32b"))
