"""`canzona plan` and `canzona inspect` through typer's CliRunner, every error path included."""

import json

import pytest

from canzona.planner.plan import SCHEMA_VERSION
from canzona.planner.plan.load import load_plan
from canzona.planner.report import inspect_report
from cli_helpers import one_error_line, run


QWEN3_0_6B = dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, vocab_size=151936, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def plan_and_stdout(tmp_path_factory):
    """One plan made with the default solver and what ``canzona plan`` printed, shared by the
    inspect tests."""
    path = tmp_path_factory.mktemp("plans") / "p.json"
    r = run("plan", "--model", "qwen3-0.6b", "--dp", 8, "--tp", 2, "-o", path)
    assert r.exit_code == 0, r.output
    return path, r.output


# --- canzona plan -----------------------------------------------------------------------------


def test_plan_writes_a_loadable_plan_whose_loads_add_up(plan_and_stdout):
    path, out = plan_and_stdout
    p = load_plan(path)
    assert p.inputs.model == "qwen3-0.6b" and (p.inputs.dp, p.inputs.tp) == (8, 2)
    # The defaults: roofline cost, solver auto, unless the simulator kept the paper's greedy plan
    # (its status says so, and the plan records the options it was made with).
    kept_greedy = p.metrics.solver_status.startswith("the paper's greedy plan, kept")
    assert p.inputs.solver.solver == ("greedy" if kept_greedy else "auto")
    assert p.inputs.solver.alpha == 1.0
    assert p.inputs.cost_model == "roofline" and p.inputs.optimizer.name == "muon"
    m = p.metrics
    assert len(m.dp_load) == 8 and m.split_matrices == 0
    # Every matrix task is owned once, and the per-index loads add up to the matrix tasks' total
    # plus the (divisible) AdamW tasks' total, up to integer rounding of the cut AdamW pieces.
    assert all(t.owner is not None for t in p.tasks if t.optimizer == "matrix")
    total = sum(t.cost for t in p.tasks)
    assert total - len(p.tasks) <= sum(m.dp_load) <= total
    owned = [0] * 8
    for t in p.tasks:
        if t.owner is not None:
            owned[t.owner] += t.cost
    assert all(o <= load for o, load in zip(owned, m.dp_load))
    # The summary: sizes, FLOPs and memory rows, the gap, the status, the wall time, the file.
    flat = " ".join(out.split())
    for needle in ("qwen3-0.6b", "dp=8 tp=2", "16 GPUs", "optimizer FLOPs", "optimizer state",
                   "gap to the certified bound", "solver status", "wall time", "wrote"):
        assert needle in flat, out
    assert "wall" not in path.read_text()


def test_plan_default_name_in_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run("plan", "-m", "qwen3-0.6b", "--dp", 4, "--solver", "greedy", "--optimizer", "soap",
            "--cost", "numel", "--split-qkv", "--no-overlap")
    assert r.exit_code == 0, r.output
    p = load_plan(tmp_path / "qwen3-0.6b-dp4-tp1-soap.plan.json")
    assert p.inputs.solver.strategy == "canzona-greedy" and p.inputs.cost_model == "numel"
    assert p.inputs.optimizer.split_qkv and p.inputs.bucket_size is None
    assert "load (numel)" in r.output


def test_plan_at_tp1_says_what_dp_pairs_share(tmp_path):
    """``--share all`` at tp 1: the summary names the matrices DP pairs share, as the plan
    records them, and the busiest DP index against the mean useful work."""
    out = tmp_path / "p.json"
    r = run("plan", "-m", "qwen3-0.6b", "--dp", 4, "--share", "all", "-o", out)
    assert r.exit_code == 0, r.output
    p = load_plan(out)
    assert p.dp_shared
    text = " ".join(r.output.split())
    assert "shared by DP pairs (shared Newton–Schulz over two DP ranks" in text
    assert f"{len(p.dp_shared)} matrices (" in text
    assert "busiest DP index / mean useful work" in text


def test_plan_is_byte_identical_on_rerun(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for out in (a, b):
        r = run("plan", "-m", "qwen3-0.6b", "--dp", 8, "-o", out)
        assert r.exit_code == 0, r.output
    assert a.read_bytes() == b.read_bytes()


def test_plan_from_hf_config_and_inspect_needs_it_again(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN3_0_6B))
    out = tmp_path / "hf.json"
    r = run("plan", "--config", cfg, "--dp", 4, "--solver", "greedy", "-o", out)
    assert r.exit_code == 0, r.output
    assert load_plan(out).inputs.model_source == "hf_config"
    one_error_line(run("inspect", out), "--config")
    r = run("inspect", out, "--config", cfg)
    assert r.exit_code == 0, r.output
    assert "canzona-greedy" in r.output


def test_plan_with_te_grouped_expert_names_and_inspect_it(tmp_path):
    """``--names megatron-grouped``: a Megatron MoE whose experts are TEGroupedMLP's; inspect
    rebuilds the model under that naming."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(
        model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=1000, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32)))
    out = tmp_path / "g.json"
    r = run("plan", "--config", cfg, "--dp", 2, "--ep", 2, "--names", "megatron-grouped",
            "-o", out)
    assert r.exit_code == 0, r.output
    names = {t.param for t in load_plan(out).tasks}
    assert "decoder.layers.1.mlp.experts.linear_fc2.weight7" in names
    assert not any("local_experts" in n for n in names)
    r = run("inspect", out, "--config", cfg)
    assert r.exit_code == 0, r.output
    one_error_line(run("plan", "--config", cfg, "--dp", 2, "--names", "te", "-o", out),
                   "--names must be one of: megatron, megatron-grouped, hf")


@pytest.mark.parametrize("args, needles", [
    (("-m", "qwen3-99b"), ("unknown model", "qwen3-99b")),
    (("-m", "qwen3-0.6b", "--alpha", "1.5"), ("--alpha", "1.5")),
    (("-m", "qwen3-0.6b", "--alpha", "-0.1"), ("--alpha",)),
    (("-m", "qwen3-0.6b", "--time-limit", "0"), ("--time-limit",)),
    (("-m", "qwen3-0.6b", "--time-limit", "-3"), ("--time-limit",)),
    (("-m", "qwen3-0.6b", "--comm-limit", "0.5"), ("--comm-limit",)),
    (("-m", "qwen3-0.6b", "--solver", "magic"), ("--solver", "magic", "cpsat")),
    (("-m", "qwen3-0.6b", "--cost", "seconds"), ("--cost", "seconds", "numel")),
    (("-m", "qwen3-0.6b", "--optimizer", "adam"), ("--optimizer", "adam", "shampoo")),
    (("-m", "qwen3-0.6b", "--tp", "3"), ("tp",)),
    ((), ("--model",)),
    (("-m", "qwen3-0.6b", "-c", "config.json"), ("exactly one",)),
    (("-c", "does/not/exist.json"), ("cannot read",)),
])
def test_plan_errors_are_one_line(tmp_path, args, needles):
    r = run("plan", "--dp", 4, *args, "-o", tmp_path / "x.json")
    one_error_line(r, *needles)
    assert not (tmp_path / "x.json").exists()


def test_plan_unwritable_output(tmp_path):
    one_error_line(run("plan", "-m", "qwen3-0.6b", "--dp", 4, "-o", tmp_path / "nope" / "p.json"),
                   "does not exist")
    (tmp_path / "qwen3-0.6b-dp4-tp1-muon.plan.json").mkdir()  # -o FOLDER: the default name in it
    one_error_line(run("plan", "-m", "qwen3-0.6b", "--dp", 4, "-o", tmp_path), "folder")


def test_plan_cpsat_respects_a_short_time_limit(tmp_path):
    out = tmp_path / "cp.json"
    r = run("plan", "-m", "qwen3-0.6b", "--dp", 4, "--solver", "cpsat", "--time-limit", "0.5",
            "-o", out)
    assert r.exit_code == 0, r.output
    p = load_plan(out)
    assert p.inputs.solver.solver == "cpsat" and p.inputs.solver.time_limit_s == 0.5


def test_plan_help_states_the_defaults():
    r = run("plan", "--help")
    assert r.exit_code == 0
    text = " ".join(r.output.replace("│", " ").split())  # the help's wrapped lines, joined
    for needle in ("default: muon", "default: 1.0", "default: roofline", "default: auto",
                   "default: 10.0"):
        assert needle in text, needle


# --- canzona inspect --------------------------------------------------------------------------


def test_inspect_report(plan_and_stdout):
    path, _ = plan_and_stdout
    r = run("inspect", path)
    assert r.exit_code == 0, r.output
    for needle in ("Per DP index", "Heaviest", "gap to the certified bound", "zero1", "asc",
                   "layerwise", "layerwise-lpt", "canzona-greedy", "canzona", "reduce-scatter",
                   "all-reduce"):
        assert needle in r.output, needle


def test_inspect_json(plan_and_stdout):
    path, _ = plan_and_stdout
    r = run("inspect", path, "--json", "--top", 3)
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    p = load_plan(path)
    assert [x["flops"] for x in data["ranks"]] == list(p.metrics.dp_flops)
    assert len(data["heaviest_tasks"]) == 3
    names = [b["name"] for b in data["baselines"]]
    assert names == ["zero1", "asc", "layerwise", "layerwise-lpt", "megatron-packed",
                     "canzona-greedy", "canzona"]
    ours = data["baselines"][-1]
    assert ours["max_load"] == max(p.metrics.dp_load) and ours["split_matrices"] == 0
    assert data["metrics"]["gap_to_bound"] == p.metrics.gap_to_bound
    assert data == inspect_report(p, top=3)  # the command prints the library's report as it is


def test_inspect_plot_writes_a_png(plan_and_stdout, tmp_path):
    path, _ = plan_and_stdout
    png = tmp_path / "chart.png"
    r = run("inspect", path, "--plot", png)
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    one_error_line(run("inspect", path, "--plot", tmp_path / "nope" / "c.png"), "chart")


def test_inspect_missing_and_malformed_files(tmp_path):
    one_error_line(run("inspect", tmp_path / "absent.json"), "cannot read")
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    one_error_line(run("inspect", bad), "invalid JSON")
    bad.write_text(json.dumps({"hello": 1}))
    one_error_line(run("inspect", bad), "not a canzona plan")


def test_inspect_newer_schema_version(plan_and_stdout, tmp_path):
    data = json.loads(plan_and_stdout[0].read_text())
    data["schema_version"] = SCHEMA_VERSION + 1
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps(data))
    one_error_line(run("inspect", newer), "newer", "upgrade canzona")


def test_inspect_malformed_field(plan_and_stdout, tmp_path):
    data = json.loads(plan_and_stdout[0].read_text())
    data["metrics"]["dp_load"] = "lots"
    bad = tmp_path / "field.json"
    bad.write_text(json.dumps(data))
    one_error_line(run("inspect", bad), "metrics.dp_load")


def test_inspect_fingerprint_mismatch(plan_and_stdout, tmp_path):
    data = json.loads(plan_and_stdout[0].read_text())
    data["fingerprint"] = "sha256:" + "0" * 64
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    one_error_line(run("inspect", other), "fingerprint", "qwen3-0.6b")
