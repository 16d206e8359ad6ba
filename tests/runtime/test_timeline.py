"""The engine's "timeline" option writes a valid Chrome trace of a real 4-stage run: one process per
rank, slices nested per track, every send matched by its receive (an arrow), readable by
`pipemorph trace inspect`, and its results still equal stock DeepSpeed's."""
import json

import pytest
from typer.testing import CliRunner

from ds_pipemorph.trace.measured_chrome import slices_nest_per_track
from ds_pipemorph_cli.app import app

from .launch import SHARED_CEILING, max_param_diff, shared_jobs


@shared_jobs("timeline", timeout=180)  # run in the session's shared 4-rank launch
def _jobs(files) -> list[dict]:
    section = {"schedule": "zb", "delegation": {"mode": "off"}, "timeline": str(files / "timeline.json")}
    return [{"name": "stock", "stages": 4, "micro_batches": 4, "pipemorph": None},
            {"name": "zb_timeline", "stages": 4, "micro_batches": 4, "pipemorph": section}]


@pytest.mark.timeout(SHARED_CEILING + 60)  # the first test to ask for the shared launch waits for all of it
def test_timeline_of_a_real_four_stage_run_is_a_valid_trace_with_matched_sends(shared4):
    run = shared4["timeline"]
    path = run.files / "timeline.json"
    for r in range(4):
        assert max_param_diff(run.result("zb_timeline", r), run.result("stock", r)) <= 1e-5
    trace = json.loads(path.read_text())
    ev = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e["name"] == "process_name"}
    assert names == {r: f"rank {r} (stage {r})" for r in range(4)}
    slices = [e for e in ev if e["ph"] == "X"]
    computes = [e for e in slices if e["name"][0] in "FBW" and e["name"][1:].isdigit()]
    assert len(computes) == 3 * 4 * 3 * 4  # iterations x stages x (F, B, W) x micro-batches
    assert slices_nest_per_track(ev)
    starts = {e["id"] for e in ev if e["ph"] == "s"}
    finishes = {e["id"] for e in ev if e["ph"] == "f"}
    sends = [e for e in slices if e["name"].startswith("SEND_")]
    assert sends and starts == finishes and len(starts) == len(sends)  # every send has its receive
    r = CliRunner().invoke(app, ["trace", "inspect", str(path), "--json"])
    assert r.exit_code == 0, r.output
