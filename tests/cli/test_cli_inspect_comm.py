"""``canzona inspect``: collectives per bucket and per DP index, the comm section, baselines'
communication figures, in the terminal and in ``--json``."""

import json

import pytest

from canzona.planner.plan.load import load_plan
from cli_helpers import run


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("comm") / "q.plan.json"
    r = run("plan", "--model", "qwen3-0.6b", "--dp", 4, "--tp", 2, "-o", path)
    assert r.exit_code == 0, r.output
    return path


def test_inspect_shows_the_collectives_compactly(plan_file):
    p = load_plan(plan_file)
    n = sum(len(buf.buckets) for buf in p.buffers)
    r = run("inspect", plan_file, "--top-buckets", 2)
    assert r.exit_code == 0, r.output
    out = r.stdout
    for needle in ("DP collectives", f"{p.comm.hardware}@{p.comm.hardware_version}",
                   p.comm.link.replace("_", "-"), "vs ZeRO-1's even collectives",
                   f"The 2 most costly of {n} buckets", f"all {n}", "bytes sent", "collectives",
                   "megatron-packed", "max sent", "--json lists every bucket"):
        assert needle in out, needle
    for m, k in p.comm.methods.items():
        assert f"{m} {k}" in out
    assert "converted from" not in out
    rows = [x for x in out.splitlines() if "│ dense #" in x]
    assert len(rows) == 2  # the top 2 only, plus the totals line
    assert "│ megatron-packed" in out
    # --top-buckets 0: the summary lines stay, the table goes.
    r0 = run("inspect", plan_file, "--top-buckets", 0)
    assert "DP collectives" in r0.stdout and "most costly" not in r0.stdout


def test_inspect_json_lists_every_bucket_and_the_comm_figures(plan_file):
    p = load_plan(plan_file)
    data = json.loads(run("inspect", plan_file, "--json", "--top-buckets", 1).stdout)
    c = data["comm"]
    assert len(c["buckets"]) == sum(len(buf.buckets) for buf in p.buffers)  # not the top N
    assert c["hardware"] == p.comm.hardware and c["methods"] == p.comm.methods
    assert c["predicted_s"] == p.comm.predicted_s and c["converted_from"] is None
    assert {"method", "slice_min", "slice_max", "max_sent_bytes", "seconds",
            "zero1_seconds"} <= set(c["buckets"][0])
    assert [b["method"] for b in c["buckets"]] == [b.method for buf in p.buffers
                                                  for b in buf.buckets]
    assert all({"sent_bytes", "collective_s"} <= set(x) for x in data["ranks"])
    assert max(x["sent_bytes"] for x in data["ranks"]) == p.comm.max_sent_bytes
    names = [b["name"] for b in data["baselines"]]
    assert "megatron-packed" in names
    assert all(b["max_sent_bytes"] and b["collective_s"] for b in data["baselines"])


def test_inspect_names_a_converted_plan(plan_file, tmp_path, as_version_1):
    data = as_version_1(plan_file.read_text())
    old = tmp_path / "v1.json"
    old.write_text(json.dumps(data))
    r = run("inspect", old)
    assert r.exit_code == 0, r.output
    assert "converted from schema 1" in r.stdout
    assert json.loads(run("inspect", old, "--json").stdout)["comm"]["converted_from"] == 1


def test_inspect_prints_the_atomic_and_the_sharing_bound(plan_file):
    """The atomic LB beside the bound with shared Newton–Schulz."""
    r = run("inspect", plan_file)
    assert r.exit_code == 0, r.output
    out = " ".join(r.stdout.split())
    assert "atomic LB = max(mean, largest task)" in out and "the bound is" in out
    j = json.loads(run("inspect", plan_file, "--json").stdout)["sharing"]
    assert j["optimizer"] == "muon" and j["gpus"] == 8
    assert j["atomic_lb_over_mean"] >= j["shared_lb_over_mean"] >= 1.0
    assert all(x["k"] in (2, 4) and x["group"] in ("tp", "dp") for x in j["shared"])
