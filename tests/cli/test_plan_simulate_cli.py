"""`pipemorph plan` and `pipemorph simulate` through Typer's CliRunner, good and bad input."""
import json

import pytest
import yaml

from cli_helpers import run, write


PROFILE = {
    "stages": 4,
    "microbatches": 12,
    "compute_ms": {"forward": [10] * 4, "backward_input": [10] * 4, "backward_weight": [10] * 4},
    "links_ms": [0, 0, 0],
    "memory": {"max_inflight": [7, 5, 3, 1]},
}


def test_plan_prints_warmup_tolerance_and_prediction_and_writes_the_plan(tmp_path):
    prof = write(tmp_path, "p.yaml", PROFILE)
    out = tmp_path / "plan.yaml"
    r = run("plan", prof, "-o", out)
    assert r.exit_code == 0, r.output
    assert "warm-up x_s: [7, 5, 3, 1]" in r.output
    assert "predicted iteration 390.0 ms" in r.output
    assert "replay tolerance ms" in r.output
    plan = yaml.safe_load(out.read_text())
    assert plan["version"] == 1 and plan["warmup"] == [7, 5, 3, 1]
    assert plan["predicted"]["iteration_ms"] == 390.0
    assert plan["profile"]["stages"] == 4


def test_plan_says_which_micro_batch_count_it_planned_for_and_takes_another(tmp_path):
    prof = write(tmp_path, "p.yaml", PROFILE)
    r = run("plan", prof, "--greedy")
    assert r.exit_code == 0, r.output
    assert "Plan for 4 stages x 12 micro-batches (the profile's count; " in r.output
    out = tmp_path / "plan8.yaml"
    r = run("plan", prof, "--greedy", "--microbatches", "8", "-o", out)
    assert r.exit_code == 0, r.output
    assert "Plan for 4 stages x 8 micro-batches (--microbatches; the profile has 12; " in r.output
    plan = yaml.safe_load(out.read_text())
    assert plan["profile"]["microbatches"] == 8
    assert sum(op.startswith("F") for op in plan["schedule"][0]) == 8


def test_plan_json_prints_the_plan_object(tmp_path):
    r = run("plan", write(tmp_path, "p.yaml", PROFILE), "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.output)
    assert obj["stages"] == 4 and len(obj["schedule"]) == 4 and obj["predicted"]["iteration_ms"] == 390.0


def test_plan_accepts_memory_in_megabytes(tmp_path):
    prof = dict(PROFILE, memory={"activation_mb": [100] * 4, "capacity_mb": [750, 500, 300, 100]})
    r = run("plan", write(tmp_path, "p.yaml", prof), "--json", "--greedy")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["warmup"] == [7, 5, 3, 1]


def test_simulate_replays_fig5_and_compares_baselines(tmp_path):
    prof = write(tmp_path, "p.yaml", PROFILE)
    plan = tmp_path / "plan.yaml"
    assert run("plan", prof, "-o", plan, "--greedy").exit_code == 0
    r = run("simulate", plan, "--links-ms", "20,0,0", "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.output)
    assert obj["iteration_ms"] == 440.0
    assert set(obj["compare"]) == {"1f1b", "zb-h1", "gpipe"}
    assert 0 < obj["bubble_rate"] < 1
    r = run("simulate", plan, "--links-ms", "10,0,0", "--compare", "", "--json")
    assert json.loads(r.output)["iteration_ms"] == 400.0


def test_gantt_and_chrome_outputs(tmp_path):
    prof = write(tmp_path, "p.yaml", PROFILE)
    png, trace = tmp_path / "g.png", tmp_path / "t.json"
    r = run("plan", prof, "--gantt", png, "--chrome", trace)
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ev = json.loads(trace.read_text())["traceEvents"]
    slices = [e for e in ev if e["ph"] == "X"]
    assert len(slices) == 4 * 12 * 3
    assert max(e["ts"] + e["dur"] for e in slices) == pytest.approx(390_000)


BAD_PROFILES = [
    ({k: v for k, v in PROFILE.items() if k != "compute_ms"}, "missing key 'compute_ms'"),
    (dict(PROFILE, links_ms=[0, 0]), "links_ms: expected 3 values"),
    (dict(PROFILE, links_ms=[0, -5, 0]), "link 1 has a delay of -5 ms; a delay is a finite number >= 0"),
    # Not a number, or infinite: a schedule on such times would never end, or never start.
    (dict(PROFILE, links_ms=[float("nan"), 0, 0]), "link 0 has a delay of nan ms; a delay is a finite number >= 0"),
    (dict(PROFILE, compute_ms=dict(PROFILE["compute_ms"], forward=[10, float("nan"), 10, 10])),
     "compute_ms.forward: stage 1 takes nan ms; a time is a finite number >= 0"),
    (dict(PROFILE, links_ms=[0, 0, float("inf")]), "link 2 has a delay of inf ms"),
    (dict(PROFILE, compute_ms=dict(PROFILE["compute_ms"], forward=[10, 10, 10])), "compute_ms.forward: expected 4 values"),
    (dict(PROFILE, compute_ms=dict(PROFILE["compute_ms"], backward_input=[10, -1, 10, 10])), "stage 1 takes -1 ms; a time is a finite number >= 0"),
    (dict(PROFILE, memory={"max_inflight": [7, 5, 3]}), "memory.max_inflight: expected 4 values"),
    (dict(PROFILE, extra_key=1), "unknown key 'extra_key'"),
    ("stages: [4\n", "not valid YAML or JSON"),
]


@pytest.mark.parametrize("data,needle", BAD_PROFILES)
def test_bad_profiles_get_one_sentence_exit_2_and_no_output(tmp_path, data, needle):
    out = tmp_path / "plan.yaml"
    r = run("plan", write(tmp_path, "p.yaml", data), "-o", out)
    assert r.exit_code == 2
    assert needle in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not out.exists()


def test_missing_profile_file(tmp_path):
    r = run("plan", tmp_path / "nope.yaml")
    assert r.exit_code == 2 and "no such file" in r.output


def test_a_directory_for_a_profile_is_named_as_one(tmp_path):
    r = run("plan", tmp_path)
    assert r.exit_code == 2 and r.output.strip() == f"error: {tmp_path} is a directory; give the YAML or JSON file in it"


@pytest.fixture
def plan_file(tmp_path):
    p = tmp_path / "plan.yaml"
    assert run("plan", write(tmp_path, "p.yaml", PROFILE), "-o", p, "--greedy").exit_code == 0
    return p


def edit(path, fn):
    data = yaml.safe_load(path.read_text())
    fn(data)
    path.write_text(yaml.safe_dump(data))
    return path


def test_invalid_plan_names_the_first_offending_op(plan_file, tmp_path):
    edit(plan_file, lambda d: d["schedule"][1].remove("W5"))
    png = tmp_path / "g.png"
    r = run("simulate", plan_file, "--gantt", png)
    assert r.exit_code == 2 and "stage 1: W5 is missing" in r.output
    assert not png.exists()


def test_a_profile_given_where_a_plan_goes_is_named_as_such(tmp_path):
    profile = write(tmp_path, "p.yaml", PROFILE)
    r = run("simulate", profile)
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert f"{profile} is a profile, not a plan: make a plan from it first (pipemorph plan {profile}" in r.output


def test_plan_with_wrong_warmup_is_refused(plan_file):
    edit(plan_file, lambda d: d.__setitem__("warmup", [4, 3, 2, 1]))
    r = run("simulate", plan_file)
    assert r.exit_code == 2 and "warmup: stage 0 says 4" in r.output


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--links-ms", "10,0"], "--links-ms: expected 3 values"),
        (["--links-ms", "a,b,c"], "not a comma-separated list"),
        (["--links-ms", "0,-3,0"], "is negative"),
        (["--links-ms", "nan,0,0"], "--links-ms: nan is not a finite number"),
        (["--links-ms", "0,inf,0"], "--links-ms: inf is not a finite number"),
        (["--compute-ms", "10/nan/10"], "is not F/B/W"),
        (["--compute-ms", "10/10"], "is not F/B/W"),
        (["--compute-ms", "10/10/10,10/10/10"], "expected 1 or 4 F/B/W triples"),
        (["--compare", "dualpipe"], "unknown baseline 'dualpipe'"),
    ],
)
def test_bad_simulate_options(plan_file, args, needle):
    r = run("simulate", plan_file, *args)
    assert r.exit_code == 2 and needle in r.output


def test_plan_for_another_stage_count_is_refused(plan_file):
    edit(plan_file, lambda d: d.__setitem__("stages", 3))
    r = run("simulate", plan_file)
    assert r.exit_code == 2
    assert "profile.stages is 4 but the plan has 3 stages" in r.output


def test_plan_and_simulate_keep_and_print_the_activation_memory_in_mb(tmp_path):
    """100 MB of activations per micro-batch, capacity 1.5x what stock 1F1B holds (S - s of them):
    with W keeping all of them (weight_mb 100) no stage may go above its capacity; with W keeping
    nothing (0) the ZB-H1 order fits in stock's memory and takes its 390 ms."""
    import re

    base = {**PROFILE, "memory": {"activation_mb": 100, "capacity_mb": [600, 450, 300, 150], "weight_mb": 100}}
    out = tmp_path / "plan.yaml"
    r = run("plan", write(tmp_path, "p.yaml", base), "--greedy", "-o", out)
    assert r.exit_code == 0, r.output
    line = " ".join(r.output.split())  # rich wraps long lines
    peak = [float(x) for x in re.search(r"activation memory: peak \[([^\]]*)\] MB", line).group(1).split(",")]
    assert all(p <= c for p, c in zip(peak, [600, 450, 300, 150])), peak
    assert "stock 1F1B [400.0, 300.0, 200.0, 100.0]" in line
    r = run("simulate", out)
    assert r.exit_code == 0 and "activation memory: peak [" in " ".join(r.output.split()), r.output

    free = {**base, "memory": {"activation_mb": 100, "capacity_mb": [400, 300, 200, 100], "weight_mb": 0}}
    r = run("plan", write(tmp_path, "free.yaml", free), "--greedy")
    assert r.exit_code == 0, r.output
    assert "predicted iteration 390.0 ms" in r.output
    assert "activation memory: peak [400.0, 300.0, 200.0, 100.0] MB" in " ".join(r.output.split())
