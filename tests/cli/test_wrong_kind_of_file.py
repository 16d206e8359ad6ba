"""A command given another of the package's files than the one it reads names what it got and what
takes that file, in one sentence, exit code 2."""
import json
from pathlib import Path

import pytest

from cli_helpers import run

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "recipes" / "profiles" / "paper_fig4.yaml"


@pytest.fixture
def files(tmp_path):
    plan = tmp_path / "plan.yaml"
    assert run("plan", PROFILE, "-o", plan).exit_code == 0
    trace = tmp_path / "timeline.json"
    trace.write_text(json.dumps({"traceEvents": [{"name": "F0", "ph": "X", "ts": 0, "dur": 10, "pid": 0, "tid": 0}]}))
    parts = tmp_path / "parts.yaml"
    parts.write_text("version: 1\nparts: [0, 2, 5, 9, 12]\nwarmup: [4, 3, 2, 1]\nschedule: [[F0]]\n")
    return {"plan": plan, "trace": trace, "profile": PROFILE, "parts": parts}


@pytest.mark.parametrize("command,given,needle", [
    (["plan"], "plan", "{path} is a plan, not a profile: replay it with pipemorph simulate {path}"),
    (["simulate"], "trace", "{path} is a trace, not a plan: read it with pipemorph trace inspect {path}"),
    (["simulate"], "profile", "{path} is a profile, not a plan: make a plan from it first (pipemorph plan {path} -o plan.yaml)"),
    (["partition"], "plan", "{path} is a plan, not a layer profile: replay it with pipemorph simulate {path}"),
    (["plan"], "parts", "{path} is a parts file, not a profile: it splits a model into stages"),
    (["simulate"], "parts", "{path} is a parts file, not a plan: it splits a model into stages (docs/partition.md); "
                            "its plan is what pipemorph partition --plan writes"),
    (["place", "--pp", "2", "--dp", "2"], "profile",
     "{path} is a profile, not a link matrix: give it with --profile {path}, and as MATRIX the links between ranks"),
])
def test_another_kind_of_file_is_named_with_what_takes_it(files, command, given, needle):
    path = files[given]
    r = run(command[0], path, *command[1:])
    assert r.exit_code == 2
    assert needle.format(path=path) in r.output
    assert len(r.output.strip().splitlines()) == 1
