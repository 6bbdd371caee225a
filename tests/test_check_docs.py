"""``benchmarks/check_docs.py``: every figure the README and docs/ quote matches the benchmark
that produces it, and a changed or unmarked figure is caught."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check_docs():
    spec = importlib.util.spec_from_file_location("check_docs", ROOT / "benchmarks" /
                                                  "check_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_quoted_figure_matches_its_source(check_docs):
    assert check_docs.check() == []


def test_a_changed_or_unmarked_figure_is_caught(check_docs, tmp_path, monkeypatch):
    text = (ROOT / "README.md").read_text()
    page = tmp_path / "README.md"
    page.write_text(text.replace("0.958× <!-- fig:q32-share-auto -->",
                                 "0.950× <!-- fig:q32-share-auto -->")
                        .replace("<!-- fig:h200-ns-of-peak -->", ""))
    monkeypatch.setattr(check_docs, "PAGES", [page])
    problems = check_docs.check()
    assert any("fig:q32-share-auto reads '0.950'" in p for p in problems), problems
    assert any("without a marker" in p and "54–70" in p for p in problems), problems
