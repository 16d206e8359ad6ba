"""`pipemorph export --format torch-csv`, `pipemorph simulate --lowered`, and torch schedule CSVs
replayed by `pipemorph simulate`, through Typer's CliRunner, good and bad input."""
import json
import subprocess
import sys

import pytest

from cli_helpers import run, write


# Two stages, two micro-batches, DeepSpeed's 1F1B order with a split backward.
PLAN = {
    "version": 1, "stages": 2, "microbatches": 2, "warmup": [2, 1],
    "schedule": [["F0", "F1", "B0", "W0", "B1", "W1"], ["F0", "B0", "W0", "F1", "B1", "W1"]],
}


def one_sentence_exit_2(r, needle):
    assert r.exit_code == 2, r.output
    assert needle in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1, r.output


def test_lowered_prints_one_stream_per_rank(tmp_path):
    r = run("simulate", write(tmp_path, "p.yaml", PLAN), "--lowered")
    assert r.exit_code == 0, r.output
    # one receive of each kind posted ahead (the default window, in the order the other stage
    # sends), the next right after the op that consumed the last; each send right after its producer
    assert r.output.splitlines() == [
        "0RECV_B0 0F0 0SEND_F0 0F1 0SEND_F1 0B0 0RECV_B1 0W0 0B1 0W1",
        "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1W0 1F1 1B1 1SEND_B1 1W1",
    ]
    r = run("simulate", write(tmp_path, "p.yaml", PLAN), "--lowered", "--json")
    assert json.loads(r.output)["lowered"][0].startswith("0RECV_B0 0F0 0SEND_F0")


def test_lowered_nccl_prints_the_streams_run_under_nccls_rules_with_groups_bracketed(tmp_path):
    r = run("simulate", write(tmp_path, "p.yaml", PLAN), "--lowered", "--nccl")
    assert r.exit_code == 0, r.output
    # A unit-time run sends F0, F1, then B0 (stage 1 runs B0 while stage 0 waits for it), then B1: both
    # ends issue the pair's messages in that order. Each send right after its producer, each receive
    # right before its consumer unless the order puts it before one of the receiver's own sends
    # (stage 1 receives F1 before it sends B0); a send and a receive with one peer side by side are
    # one group, as DeepSpeed's send_forward_recv_backward.
    assert r.output.splitlines() == [
        "0F0 0SEND_F0 0F1 [0SEND_F1 0RECV_B0] 0B0 0W0 0RECV_B1 0B1 0W1",
        "1RECV_F0 1F0 1B0 [1RECV_F1 1SEND_B0] 1W0 1F1 1B1 1SEND_B1 1W1",
    ]
    one_sentence_exit_2(run("simulate", write(tmp_path, "p.yaml", PLAN), "--lowered", "--nccl", "--dispatch", "ready"),
                        "--nccl runs ordered dispatch only")
    one_sentence_exit_2(run("simulate", write(tmp_path, "p.yaml", PLAN), "--nccl"), "give --lowered too")


def test_export_writes_torch_actions_with_backward_input_as_I(tmp_path):
    out = tmp_path / "s.csv"
    r = run("export", write(tmp_path, "p.yaml", PLAN), "--format", "torch-csv", "-o", out, "--ranks", "2")
    assert r.exit_code == 0, r.output
    assert out.read_text().splitlines() == [
        "0RECV_B0,0F0,0SEND_F0,0F1,0SEND_F1,0I0,0RECV_B1,0W0,0I1,0W1,0REDUCE_GRAD",
        "1RECV_F0,1F0,1RECV_F1,1I0,1SEND_B0,1W0,1F1,1I1,1SEND_B1,1W1,1REDUCE_GRAD",
    ]


def test_a_fused_plan_sends_its_gradient_after_W(tmp_path):
    out = tmp_path / "s.csv"
    r = run("export", write(tmp_path, "p.yaml", dict(PLAN, backward="fused")), "-o", out)
    assert r.exit_code == 0, r.output
    assert out.read_text().splitlines()[1] == "1RECV_F0,1F0,1RECV_F1,1I0,1W0,1SEND_B0,1F1,1I1,1W1,1REDUCE_GRAD,1SEND_B1"


def test_lowered_and_export_post_the_plans_recv_window_ahead_and_ready_dispatch_posts_all(tmp_path):
    """Three micro-batches in 1F1B order on 2 stages; stage 1 consumes F0, F1, F2 in order.

    Default window 1: one ahead, each next one after the op that consumed the last; window 2:
    RECV_F0 RECV_F1 up front, RECV_F2 once F0 consumed its receive; ready dispatch: all three up
    front."""
    plan = {"version": 1, "stages": 2, "microbatches": 3, "warmup": [2, 1],
            "schedule": [["F0", "F1", "B0", "W0", "F2", "B1", "W1", "B2", "W2"],
                         ["F0", "B0", "W0", "F1", "B1", "W1", "F2", "B2", "W2"]]}
    path = write(tmp_path, "p.yaml", plan)
    r = run("simulate", path, "--lowered")
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[1] == ("1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1W0 1F1 1RECV_F2 1B1 1SEND_B1 1W1 "
                                        "1F2 1B2 1SEND_B2 1W2")
    out = tmp_path / "one.csv"
    assert run("export", path, "-o", out).exit_code == 0
    assert out.read_text().splitlines()[1].startswith("1RECV_F0,1F0,1RECV_F1,1I0,1SEND_B0")
    two = write(tmp_path, "two.yaml", dict(plan, recv_window=2))
    r = run("simulate", two, "--lowered")
    assert r.output.splitlines()[1] == ("1RECV_F0 1RECV_F1 1F0 1RECV_F2 1B0 1SEND_B0 1W0 1F1 1B1 1SEND_B1 1W1 "
                                        "1F2 1B2 1SEND_B2 1W2")
    r = run("simulate", two, "--lowered", "--dispatch", "ready")
    assert r.output.splitlines()[1].startswith("1RECV_F0 1RECV_F1 1RECV_F2 1F0 1B0 1SEND_B0")
    r = run("simulate", two, "--lowered", "--dispatch", "eager")
    one_sentence_exit_2(r, "--dispatch")


# Stage 0: F0 F1 I0 W0 I1 W1, stage 1 the same, 10 ms per op. Without delay stage 1 runs F0 at
# 10-20, F1 20-30, I0 30-40, W0 40-50, I1 50-60, W1 60-70; stage 0 gets the gradients at 40 and 60:
# I0 40-50, W0 50-60, I1 60-70, W1 70-80 -> 80 ms. With 5 ms on the link, stage 1 starts at 15
# (F1 at 25) and ends W1 at 75; the gradients reach stage 0 at 50 and 70: W1 ends at 90 -> 90 ms.
TORCH_CSV = "0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1F1,1I0,1W0,1I1,1W1\n"


@pytest.mark.parametrize("links,expected", [("0", 80.0), ("5", 90.0)])
def test_simulate_replays_a_torch_schedule_csv(tmp_path, links, expected):
    r = run("simulate", write(tmp_path, "t.csv", TORCH_CSV), "--compute-ms", "10/10/10", "--links-ms", links,
            "--compare", "", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["iteration_ms"] == expected


def test_a_torch_full_backward_is_replayed_as_fused(tmp_path):
    # B = I + W, 20 ms; the gradient leaves after both: stage 1 runs F0 10-20, F1 20-30, B0 30-50,
    # B1 50-70; stage 0 runs B0 50-70 and B1 70-90 -> 90 ms (80 if the gradient left after I).
    csv_text = "0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n"
    r = run("simulate", write(tmp_path, "t.csv", csv_text), "--compute-ms", "10/10/10", "--links-ms", "0",
            "--compare", "", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["iteration_ms"] == 90.0


def test_an_exported_plan_replays_as_the_plan_itself(tmp_path):
    profile = {"stages": 4, "microbatches": 8, "compute_ms": {"forward": 10, "backward_input": 10, "backward_weight": 10},
               "links_ms": [20, 0, 0], "memory": {"max_inflight": [8, 6, 4, 2]}}
    plan = tmp_path / "plan.yaml"
    assert run("plan", write(tmp_path, "prof.yaml", profile), "-o", plan, "--budget", "0.3").exit_code == 0
    out = tmp_path / "plan.csv"
    assert run("export", plan, "-o", out).exit_code == 0
    args = ("--links-ms", "30,0,10", "--compute-ms", "10/12/8", "--compare", "", "--json")
    direct, via_csv = run("simulate", plan, *args), run("simulate", out, *args)
    assert direct.exit_code == 0 and via_csv.exit_code == 0, via_csv.output
    assert json.loads(via_csv.output)["iteration_ms"] == json.loads(direct.output)["iteration_ms"]
    lowered = run("simulate", out, "--lowered").output.splitlines()
    assert lowered == run("simulate", plan, "--lowered").output.splitlines()


def test_a_csv_and_its_plan_file_get_the_same_baselines_when_the_plans_profile_has_free_links(tmp_path):
    """A torch CSV has no profile: its baselines are planned for --compute-ms with free links, what
    a plan file made from a free-link profile has. ZB-H1 under 20 ms on link 0 then takes as long from
    either, and longer than ZB-H1 planned knowing the delay (a profile with link 0 at 20 ms)."""
    def profile(links):
        return {"stages": 4, "microbatches": 12, "links_ms": links,
                "compute_ms": {"forward": 10, "backward_input": 10, "backward_weight": 10}}

    plans = {}
    for name, links in (("free", [0, 0, 0]), ("slow", [20, 0, 0])):
        plans[name] = tmp_path / f"{name}.yaml"
        assert run("plan", write(tmp_path, f"{name}_prof.yaml", profile(links)), "-o", plans[name],
                   "--budget", "0.3").exit_code == 0
    out = tmp_path / "free.csv"
    assert run("export", plans["free"], "-o", out).exit_code == 0
    args = ("--links-ms", "20,0,0", "--compute-ms", "10/10/10", "--json")
    compare = {name: json.loads(run("simulate", path, *args).output)["compare"]
               for name, path in (("plan file", plans["free"]), ("csv", out), ("aware", plans["slow"]))}
    assert compare["csv"] == compare["plan file"]
    assert compare["csv"]["zb-h1"]["iteration_ms"] > compare["aware"]["zb-h1"]["iteration_ms"]


@pytest.mark.parametrize("content,needle", [
    ("0F0,0X1\n1F0\n", "rank 0, column 2: '0X1' is not a torch pipelining action"),
    ("0F0,0F\n1F0\n", "rank 0, column 2: '0F' names no micro-batch"),
    ("0F0,0I0,0W0\n1F0,1I0,1W0,2F0\n", "'2F0' is for stage 2, but the file has 2 ranks"),
    ("0F0,0I0,0W0\n0F1,1I0,1W0\n", "rank 1, column 1: '0F1' is for stage 0; only one stage per rank"),
    ("0F0,0I0,0W0\n", "has 1 rank rows; a pipeline needs at least 2"),
    ("0F0,0B0\n1F0,1I0,1W0\n", "mixes full backwards (B) and split ones (I + W)"),
    ("0F0,0I0,0W0\n1F0,1W0,1I0\n", "stage 1: W0 before B0"),
    ("stages: 4\nmicrobatches: 12\n", "is not a torch pipelining action"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", "is not a CSV text file"),
])
def test_bad_torch_csv_gets_one_sentence_exit_2_and_no_output(tmp_path, content, needle):
    chrome = tmp_path / "trace.json"
    r = run("simulate", write(tmp_path, "t.csv", content), "--compute-ms", "10/10/10", "--chrome", chrome)
    one_sentence_exit_2(r, needle)
    assert not chrome.exists()


def test_a_torch_csv_with_the_wrong_rank_count_for_the_links(tmp_path):
    r = run("simulate", write(tmp_path, "t.csv", TORCH_CSV), "--compute-ms", "10/10/10", "--links-ms", "5,5")
    one_sentence_exit_2(r, "--links-ms: expected 1 values (one per link of 2 stages), got 2")


@pytest.mark.parametrize("edit,args,needle", [
    (None, ("--format", "onnx"), "--format: unknown format 'onnx'; choose from torch-csv"),
    (None, ("--ranks", "4"), "--ranks 4: the plan has 2 stages, and each rank runs one stage"),
    ({"schedule": [["F0", "F1", "B0", "W0", "B1", "W1"], ["F0", "B0", "W0", "F1", "B1", "X1"]]}, (), "'X1' is not an op"),
    ({"schedule": [["F0", "F1", "B0", "W0", "B1", "W1"], ["F1", "B1", "W1", "F0", "B0", "W0"]], "warmup": [2, 1]}, (),
     "stage 1 runs F1 as its forward #0: torch pipelining keeps losses in forward order"),
])
def test_bad_export_input_gets_one_sentence_exit_2_and_leaves_the_output_alone(tmp_path, edit, args, needle):
    out = tmp_path / "s.csv"
    r = run("export", write(tmp_path, "p.yaml", dict(PLAN, **(edit or {}))), "-o", out, *args)
    one_sentence_exit_2(r, needle)
    assert not out.exists()
    out.write_text("kept\n")
    run("export", write(tmp_path, "p.yaml", dict(PLAN, **(edit or {}))), "-o", out, *args)
    assert out.read_text() == "kept\n"


def test_export_of_a_file_that_is_not_a_plan(tmp_path):
    out = tmp_path / "s.csv"
    r = run("export", write(tmp_path, "p.yaml", b"\x00\x01\x02 not yaml"), "-o", out)
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert not out.exists()


@pytest.mark.timeout(120)
def test_export_and_simulate_commands_import_no_torch():
    code = ("import sys, ds_pipemorph_cli.export_cmd, ds_pipemorph_cli.simulate_cmd; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stderr
