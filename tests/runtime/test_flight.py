"""The flight recorder's table (``CanzonaOptimizer(flight_record=)``): launched collectives are
listed until their work completes, the file is rewritten atomically, close() stops the thread."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("torch")

from canzona.runtime.flight import FlightRecorder  # noqa: E402


class _Work:
    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


def test_table_lists_unfinished_collectives_until_they_complete(tmp_path):
    rec = FlightRecorder(tmp_path, 3, interval_s=60, labels={"dp_rank": 1, "tp_rank": 1})
    a, b = _Work(), _Work()
    rec.add("the reduce of bucket 0 (PaddedCollective)", a)
    rec.add("the TP gather (all-to-all) of micro-group 2", b)
    rec.add("inline", None)  # a collective that ran inline is never in flight
    rec.write()
    got = json.loads((tmp_path / "canzona-flight-rank3.json").read_text())
    assert got["rank"] == 3 and got["dp_rank"] == 1
    assert got["in_flight"] == ["the reduce of bucket 0 (PaddedCollective)",
                                "the TP gather (all-to-all) of micro-group 2"]
    a.done = True
    rec.write()
    got = json.loads((tmp_path / "canzona-flight-rank3.json").read_text())
    assert got["in_flight"] == ["the TP gather (all-to-all) of micro-group 2"]
    b.done = True
    rec.close()
    assert json.loads((tmp_path / "canzona-flight-rank3.json").read_text())["in_flight"] == []
    assert not any(t.name == "canzona-flight" and t.is_alive() for t in threading.enumerate())
    assert not list(tmp_path.glob("*.tmp"))
