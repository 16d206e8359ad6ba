"""`pipemorph partition` through Typer's CliRunner: the table, the parts file, the plan, bad input."""
import json

import pytest
import yaml

from ds_pipemorph.plan.files.planfile import PlanFile
from ds_pipemorph.plan.partition.parts import PartsFile
from cli_helpers import run, write


# 12 layers, the last four slower; a 64 MB activation after layer 2 and a 20 ms link in the middle.
PROFILE = {
    "stages": 4,
    "microbatches": 8,
    "layers": {
        "forward_ms": [2] * 8 + [3] * 4,
        "backward_input_ms": [2] * 8 + [3] * 4,
        "backward_weight_ms": 1.5,
        "activation_mb": [8, 8, 64] + [8] * 9,
        "memory_mb": 200,
        "stash_mb": 16,
    },
    "links": {"bandwidth_gbs": 10, "latency_ms": [0, 20, 0]},
    "memory": {"capacity_mb": 1000},
}


def test_partition_prints_the_comparison_and_writes_parts_and_plan(tmp_path):
    prof = write(tmp_path, "layers.yaml", PROFILE)
    out, plan = tmp_path / "parts.yaml", tmp_path / "plan.yaml"
    r = run("partition", prof, "-o", out, "--plan", plan)
    assert r.exit_code == 0, r.output
    assert "Partition of 12 layers into 4 stages, 8 micro-batches" in r.output
    assert "proved best" in r.output
    for row in ("searched (chosen)", "uniform", "parameters", "gap to bound", "lower bound over every partition"):
        assert row in r.output
    pf = PartsFile.model_validate(yaml.safe_load(out.read_text()))
    assert pf.parts[0] == 0 and pf.parts[-1] == 12 and len(pf.parts) == 5
    assert pf.parts[1] != 3  # never cut after the 64 MB activation
    assert pf.predicted.complete and pf.predicted.lower_bound_ms <= pf.predicted.iteration_ms <= pf.predicted.search_ms
    assert len(pf.schedule) == 4 and pf.warmup[-1] == 1 and len(pf.links_ms) == 3
    # The plan file is the planner's format, for the stage profile of these parts.
    plan_file, sched = PlanFile.read(plan)
    assert plan_file.predicted.iteration_ms == pf.predicted.iteration_ms
    assert plan_file.profile.compute_ms.forward == pf.stage_ms.forward
    assert [" ".join(r) for r in plan_file.schedule] == [" ".join(r) for r in pf.schedule]
    r = run("simulate", plan, "--compare", "", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["iteration_ms"] == pytest.approx(pf.predicted.iteration_ms)


def test_partition_json_and_stage_and_microbatch_overrides(tmp_path):
    prof = write(tmp_path, "layers.yaml", PROFILE)
    out = tmp_path / "parts.json"
    r = run("partition", prof, "--stages", 2, "--microbatches", 6, "--json", "-o", out)
    # links lists have 3 values, one per link of 4 stages: with 2 stages that is named
    assert r.exit_code == 2 and "links.latency_ms: expected 1 values" in r.output and not out.exists()
    one_link = dict(PROFILE, links={"bandwidth_gbs": 10, "latency_ms": 5}, memory={"capacity_mb": 3000})
    r = run("partition", write(tmp_path, "l2.yaml", one_link), "--stages", 2, "--microbatches", 6, "--json", "-o", out)
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["microbatches"] == 6 and len(obj["parts"]) == 3 and obj["chosen"] == "searched"
    assert set(obj["compare"]) == {"searched", "uniform", "parameters"}
    assert obj["search"]["partitions"] == 11 and obj["search"]["complete"]
    for row in obj["compare"].values():
        assert row["lower_bound_ms"] <= row["iteration_ms"] + 1e-9
    assert obj["compare"]["searched"]["iteration_ms"] <= obj["compare"]["uniform"]["iteration_ms"] + 1e-9
    assert json.loads(out.read_text())["parts"] == obj["parts"]


def test_a_baseline_that_does_not_fit_memory_is_shown_as_such(tmp_path):
    # Layer 0 is large: the uniform cut (3 layers per stage) puts it with two others and overflows.
    prof = dict(PROFILE, layers=dict(PROFILE["layers"], memory_mb=[900] + [100] * 11, param_count=1))
    r = run("partition", write(tmp_path, "l.yaml", prof))
    assert r.exit_code == 0, r.output
    assert "does not fit memory" in r.output


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"stages": 2, "microbatches": 4, "compute_ms": {"forward": 1, "backward_input": 1, "backward_weight": 1}},
         "is a profile, not a layer profile: partitioning needs per-layer times under 'layers'"),
        (dict(PROFILE, layers=dict(PROFILE["layers"], forward_ms=[2] * 11 + [-1])), "layers.forward_ms: layer 11 is negative"),
        (dict(PROFILE, links={"bandwidth_gbs": 0}), "links.bandwidth_gbs: link 0 must be positive"),
        (dict(PROFILE, memory={"capacity_mb": 300}), "no way to cut 12 layers into 4 stages fits memory.capacity_mb"),
        (dict(PROFILE, stages=13, links={}), "12 layers cannot fill 13 stages"),
        ("[1, 2]", "expected a mapping"),
    ],
)
def test_bad_input_is_one_sentence_exit_2_and_no_output(tmp_path, data, needle):
    out = write(tmp_path, "parts.yaml", "old: content\n")
    r = run("partition", write(tmp_path, "l.yaml", data), "-o", out)
    assert r.exit_code == 2, r.output
    assert needle in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert out.read_text() == "old: content\n"  # untouched


def test_missing_file(tmp_path):
    r = run("partition", tmp_path / "nope.yaml")
    assert r.exit_code == 2 and "no such file" in r.output


# 4 equal layers (F = B = W = 1 ms) on 2 stages, 4 micro-batches, free links (tests/plan/test_partition_slowdown.py).
EVEN = {"stages": 2, "microbatches": 4, "layers": {"forward_ms": [1] * 4, "backward_input_ms": 1, "backward_weight_ms": 1}}


def test_slowdown_moves_the_cut_and_scales_the_written_stage_times(tmp_path):
    prof = write(tmp_path, "even.yaml", EVEN)
    out = tmp_path / "parts.json"
    r = run("partition", prof, "--json", "-o", out, "--budget", 0.1)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["parts"] == [0, 2, 4] and json.loads(r.stdout)["search"]["slowdown"] is None
    # Stage 0 at 3x: one layer there (3 ms per op) and three on stage 1 (3 ms per op) make two equal
    # stages, 3·N·3 + 3 = 39 ms; two layers there would be 4·18 = 72 ms of work on stage 0 alone.
    r = run("partition", prof, "--json", "-o", out, "--budget", 0.1, "--slowdown", "0=3")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["parts"] == [0, 1, 4] and obj["search"]["slowdown"] == [3.0, 1.0]
    assert obj["search"]["search_ms"] == 39.0 and obj["predicted"]["iteration_ms"] == 39.0
    assert obj["stage_ms"]["forward"] == [3.0, 3.0]  # the parts file records the scaled times it planned with
    assert json.loads(out.read_text())["parts"] == [0, 1, 4]
    r = run("partition", prof, "--slowdown", "1=3", "--slowdown", "0=1", "--budget", 0.1)
    assert r.exit_code == 0, r.output
    assert "stage times scaled: stage 1 x3" in r.output and "[0, 3, 4]" in r.output


@pytest.mark.parametrize(
    "args, needle",
    [
        (["1"], "--slowdown: '1' is not STAGE=FACTOR"),
        (["x=2"], "--slowdown: 'x=2' is not STAGE=FACTOR"),
        (["1=fast"], "--slowdown: '1=fast' is not STAGE=FACTOR"),
        (["2=2.0"], "--slowdown: stage 2 does not exist (the pipeline has stages 0..1)"),
        (["-1=2.0"], "--slowdown: stage -1 does not exist"),
        (["1=0"], "--slowdown: stage 1's factor must be a finite number above 0, got 0"),
        (["1=-2"], "--slowdown: stage 1's factor must be a finite number above 0, got -2"),
        (["0=nan"], "--slowdown: stage 0's factor must be a finite number above 0, got nan"),
        (["0=inf"], "--slowdown: stage 0's factor must be a finite number above 0, got inf"),
        (["1=2", "1=3"], "--slowdown: stage 1 is given twice"),
    ],
)
def test_bad_slowdown_is_one_sentence_exit_2_and_no_output(tmp_path, args, needle):
    out = write(tmp_path, "parts.yaml", "old: content\n")
    opts = [x for a in args for x in ("--slowdown", a)]
    r = run("partition", write(tmp_path, "even.yaml", EVEN), "-o", out, *opts)
    assert r.exit_code == 2, r.output
    assert needle in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert out.read_text() == "old: content\n"
