"""tests/megatron: canzona checked against megatron-core itself.

Every test here is marked ``megatron`` (``pytest -m megatron`` runs them, ``-m "not megatron"``
leaves them out) and is skipped, with the reason, when megatron-core is not installed. The test
modules import torch and megatron lazily, so collecting them costs nothing without it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # megatron_stubs, for the test modules

from megatron_stubs import MISSING_REASON, megatron_available  # noqa: E402

HAVE_MEGATRON = megatron_available()
_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason=MISSING_REASON)
    for item in items:
        if _HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.megatron)
            if not HAVE_MEGATRON:
                item.add_marker(skip)
