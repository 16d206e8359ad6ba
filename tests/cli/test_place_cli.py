"""`pipemorph place` through Typer's CliRunner: the three predictions, the topology file, bad input."""
import json

import pytest
import yaml

from ds_pipemorph.plan.place.placement import Placement, TopologyFile
from cli_helpers import run, write

SLOW = {1, 3, 5, 7}  # behind a 30 ms link from the others: every default data-parallel ring crosses it
SPLIT = {"world_size": 8, "latency_ms": [[0 if (a in SLOW) == (b in SLOW) else 30 for b in range(8)] for a in range(8)]}
FAST = ["--search-evals", "300"]


def test_place_prints_three_predictions_and_writes_the_topology(tmp_path):
    out = tmp_path / "topology.yaml"
    r = run("place", write(tmp_path, "m.yaml", SPLIT), "--pp", 4, "--dp", 2, "--chunk-mb", 4, "--direct", "-o", out, *FAST)
    assert r.exit_code == 0, r.output
    for needle in ("baseline", "replacement", "orchestrator", "every placement tried: 20,160", "1171.0", "771.0",
                   "421.0", "speed-up: re-placement 1.52x over baseline, orchestrator 1.83x over re-placement",
                   "delegated(2) links", f"wrote {out}"):
        assert needle in r.output
    topo = TopologyFile.model_validate(yaml.safe_load(out.read_text()))
    grid = topo.placement().grid
    assert topo.dims == (4, 2) and all(set(row) <= SLOW or not set(row) & SLOW for row in grid)
    assert topo.model_extra["links_ms"] == [[0.0, 30.0, 0.0]] * 2
    assert topo.model_extra["predicted"] == {"iteration_ms": 421.0, "baseline_ms": 1171.0, "replacement_ms": 771.0}


def test_place_json_and_json_topology_file(tmp_path):
    out = tmp_path / "topology.json"
    r = run("place", write(tmp_path, "m.yaml", SPLIT), "--pp", 4, "--dp", 2, "--chunk-mb", 4, "--json", "-o", out, *FAST)
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    b, rp, o = (obj[k]["iteration_ms"] for k in ("baseline", "replacement", "orchestrator"))
    assert o < rp < b and obj["exact"] is True
    assert obj["baseline"]["ranks"] == Placement.default(4, 2).as_lists() and obj["baseline"]["moved"] == 0
    assert obj["speedup"]["orchestrator_vs_baseline"] == pytest.approx(b / o)
    assert json.loads(out.read_text()) == obj["topology"]
    assert obj["topology"]["ranks"] == obj["orchestrator"]["ranks"]


def test_uniform_matrix_keeps_deepspeeds_default(tmp_path):
    out = tmp_path / "t.yaml"
    r = run("place", write(tmp_path, "m.yaml", {"world_size": 6, "default": {"latency_ms": 2}}), "--pp", 3, "--dp", 2,
            "--json", "-o", out, *FAST)
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    for k in ("baseline", "replacement", "orchestrator"):
        assert obj[k]["ranks"] == [[0, 1], [2, 3], [4, 5]]
    assert yaml.safe_load(out.read_text())["ranks"] == [[0, 1], [2, 3], [4, 5]]


def test_profile_gives_op_times_and_caps(tmp_path):
    prof = {"stages": 4, "microbatches": 8, "memory": {"max_inflight": [4, 3, 2, 1]},
            "compute_ms": {"forward": 10, "backward_input": 10, "backward_weight": 10}}
    r = run("place", write(tmp_path, "m.yaml", SPLIT), "--pp", 4, "--dp", 2, "--profile", write(tmp_path, "p.yaml", prof),
            "--json", *FAST)
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert max(obj["orchestrator"]["warmup"]) <= 4 and obj["baseline"]["warmup"] == [4, 3, 2, 1]


BAD = [
    ({"world_size": 8, "latency_ms": [[0] * 6] * 6}, ("--pp", 4, "--dp", 2), "expected a 8 x 8 matrix"),
    (SPLIT, ("--pp", 3, "--dp", 2), "3 stages x 2 replicas is 6 ranks but the link matrix is for 8 ranks"),
    ({"world_size": 2, "latency_ms": [[0, 1], [2, 0]]}, ("--pp", 2, "--dp", 1), "not symmetric"),
    ({"world_size": 2, "latency_ms": [[0, -1], [-1, 0]]}, ("--pp", 2, "--dp", 1), "must be a number >= 0"),
    ({"world_size": 2, "pairs": [{"ranks": [0, 5], "latency_ms": 3}]}, ("--pp", 2, "--dp", 1), "outside 0..1"),
    ({"world_size": 2, "links": []}, ("--pp", 2, "--dp", 1), "unknown key 'links'"),
    ("world_size: [2\n", ("--pp", 2, "--dp", 1), "not valid YAML or JSON"),
    (SPLIT, ("--pp", 4, "--dp", 2, "--grad-mb", "1,2"), "gradient sizes: expected 4 values"),
    (SPLIT, ("--pp", 4, "--dp", 2, "--grad-mb", "x"), "--grad-mb: 'x' is not"),
    (SPLIT, ("--pp", 4, "--dp", 2, "--chunk-mb", 0), "message size positive"),
    (SPLIT, ("--pp", 4, "--dp", 2, "--chunk-mb", "nan"), "--chunk-mb: nan is not a finite number"),
    (SPLIT, ("--pp", 4, "--dp", 2, "--activation-mb", "inf"), "--activation-mb: inf is not a finite number"),
    (SPLIT, ("--pp", 4, "--dp", 2, "--grad-mb", "inf"), "--grad-mb: inf is not a finite number"),
    (SPLIT, ("--pp", 4, "--dp", 2, "--compute-ms", "10/10"), "--compute-ms: '10/10' is not F/B/W"),
]


@pytest.mark.parametrize("matrix,args,needle", BAD)
def test_bad_input_is_one_sentence_exit_2_and_no_file(tmp_path, matrix, args, needle):
    out = tmp_path / "topology.yaml"
    r = run("place", write(tmp_path, "m.yaml", matrix), *args, "-o", out)
    assert r.exit_code == 2, r.output
    assert needle in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not out.exists() and list(tmp_path.iterdir()) == [tmp_path / "m.yaml"]  # no temporary left either


def test_missing_matrix_profile_mismatch_and_bad_options(tmp_path):
    r = run("place", tmp_path / "nope.yaml", "--pp", 2, "--dp", 1)
    assert r.exit_code == 2 and "no such file" in r.output
    m = write(tmp_path, "m.yaml", SPLIT)
    prof = write(tmp_path, "p.yaml", {"stages": 2, "microbatches": 4, "compute_ms": {"forward": 1, "backward_input": 1, "backward_weight": 1}})
    r = run("place", m, "--pp", 4, "--dp", 2, "--profile", prof)
    assert r.exit_code == 2 and "op times are for 2 stages but --pp is 4" in r.output
    r = run("place", m, "--pp", 4, "--dp", 2, "--profile", prof, "--compute-ms", "1/1/1")
    assert r.exit_code == 2 and "not both" in r.output
    assert run("place", m, "--pp", 0, "--dp", 2).exit_code == 2  # usage errors exit 2 as well


def test_an_existing_topology_file_survives_a_failed_run(tmp_path):
    out = write(tmp_path, "topology.yaml", "old\n")
    r = run("place", write(tmp_path, "m.yaml", SPLIT), "--pp", 2, "--dp", 2, "-o", out)
    assert r.exit_code == 2 and out.read_text() == "old\n"
