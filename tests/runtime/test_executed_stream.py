"""The engine runs what ``pipemorph simulate --lowered`` prints for the same plan file.

One launch of 3 ranks (gloo, CPU) trains stock DeepSpeed and our engine on plan files: DeepSpeed's
1F1B order, a zero-bubble order (ZB-H1), a zero-bubble order with ``backward: fused``, the 1F1B
order fused with ``recv_window: 1``, ready dispatch, and the built ``zb`` plan with the ds_config's
``recv_window`` (the command's stream for that plan written to a file with the same window). Each rank's ``executed_stream`` of every
step must equal its line of the real command's output (a subprocess), losses and parameters must
equal stock DeepSpeed's within 1e-5. Ready dispatch reorders compute ops only: its stream holds
the same ops, posts the command's receives, in its order, before the first op that consumes a
message, and sends each message right after its producer.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ds_pipemorph.plan.ir.ops import format_stage, warmup_counts
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.baselines import deepspeed_1f1b, zb_h1
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.runtime.config import parse_config
from ds_pipemorph.runtime.plans import build_plan

from .launch import REPO, SHARED_CEILING, max_param_diff, shared_jobs

S, N = 3, 6
TOL = 1e-5


def _plan_file(path: Path, plan, **extra) -> str:
    path.write_text(yaml.safe_dump({"version": 1, "stages": S, "microbatches": N, "warmup": warmup_counts(plan),
                                    "schedule": [format_stage(r) for r in plan], **extra}))
    return str(path)


def _lowered(plan_file: str, *more: str) -> list[list[str]]:
    """Per rank, the ops ``pipemorph simulate PLAN --lowered --json`` prints."""
    p = subprocess.run([sys.executable, "-m", "ds_pipemorph_cli.app", "simulate", plan_file, "--lowered", "--json",
                        *more], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr
    return [line.split() for line in json.loads(p.stdout)["lowered"]]


def _section(plan_file: str, dispatch: str = "ordered") -> dict:
    return {"schedule": "plan", "plan_file": plan_file, "dispatch": dispatch, "delegation": {"mode": "off"},
            "adapt": {"enabled": False}}


def _files(folder: Path) -> dict[str, str]:
    """The plan files the engine runs, written to ``folder``."""
    zb_fused = list_schedule(Costs.uniform(S, 10.0, [0.0, 20.0]), N, [3, 2, 1])
    return {
        "one_f_one_b": _plan_file(folder / "1f1b.yaml", deepspeed_1f1b(S, N)),
        "zb": _plan_file(folder / "zb.yaml", zb_h1(Costs.uniform(S), N)),
        "zb_fused": _plan_file(folder / "zb_fused.yaml", zb_fused, backward="fused"),
        "one_f_one_b_fused_window_1": _plan_file(folder / "1f1b_w1.yaml", deepspeed_1f1b(S, N), backward="fused",
                                                 recv_window=1),
    }


@shared_jobs("executed_stream", timeout=400, ranks=S)  # run in the session's shared 3-rank launch
def _jobs(folder) -> list[dict]:
    files = _files(folder)
    jobs = [{"name": "stock", "stages": S, "micro_batches": N, "pipemorph": None}]
    jobs += [{"name": name, "stages": S, "micro_batches": N, "pipemorph": _section(path)} for name, path in files.items()]
    jobs.append({"name": "zb_ready", "stages": S, "micro_batches": N, "pipemorph": _section(files["zb"], "ready")})
    jobs.append({"name": "zb_config_window", "stages": S, "micro_batches": N,
                 "pipemorph": {"schedule": "zb", "recv_window": N, "delegation": {"mode": "off"},
                               "adapt": {"enabled": False}}})
    return jobs


@pytest.mark.timeout(SHARED_CEILING + 60)  # the first test to ask for the shared launch waits for all of it
def test_the_engine_executes_the_stream_simulate_lowered_prints(shared3, tmp_path):
    run = shared3["executed_stream"]
    files = _files(run.files)  # the files the engine ran (written again: the same)
    zb_fused = list_schedule(Costs.uniform(S, 10.0, [0.0, 20.0]), N, [3, 2, 1])
    expected = {name: _lowered(path) for name, path in files.items()}
    # The ds_config's recv_window lowers a built plan as a plan file's would: every receive up front here.
    built = build_plan(parse_config({"schedule": "zb"}), S, N)
    expected["zb_config_window"] = _lowered(_plan_file(tmp_path / "zb_built.yaml", built, recv_window=N))
    assert expected["zb_config_window"] != _lowered(_plan_file(tmp_path / "zb_built_default.yaml", built))
    # The plan files' settings change the streams, so equal streams prove the engine honours them.
    assert expected["zb_fused"] != _lowered(_plan_file(tmp_path / "zb_split.yaml", zb_fused))
    assert expected["one_f_one_b_fused_window_1"] != expected["one_f_one_b"]
    assert expected["one_f_one_b"] != _lowered(files["one_f_one_b"], "--dispatch", "ready")
    ready_expected = _lowered(files["zb"], "--dispatch", "ready")

    for r in range(S):
        ref = run.result("stock", r)
        for name in [*files, "zb_ready", "zb_config_window"]:
            ours = run.result(name, r)
            assert ours["losses"] == pytest.approx(ref["losses"], abs=TOL), f"{name} rank {r}: losses differ"
            assert max_param_diff(ours, ref) <= TOL, f"{name} rank {r}: parameters differ"
            assert len(ours["executed"]) == 3
        stage = run.result("stock", r)["stage"]
        for name in [*files, "zb_config_window"]:
            for step, ran in enumerate(run.result(name, r)["executed"]):
                assert ran == expected[name][stage], f"{name} rank {r} step {step}: ran {ran}"
        for step, ran in enumerate(run.result("zb_ready", r)["executed"]):
            want = ready_expected[stage]
            posts = [t for t in want if "RECV" in t]
            # every receive, in the command's order, before the first op that consumes a message (a
            # first stage's warm-up forwards may run before them)
            first_post = ran.index(posts[0])
            assert ran[first_post:first_post + len(posts)] == posts, f"rank {r} step {step}: ran {ran}"
            consumer = "F" if stage > 0 else "B"
            assert all(not t[1:].startswith(consumer) for t in ran[:first_post]), f"rank {r} step {step}: ran {ran}"
            assert sorted(ran) == sorted(want), f"rank {r} step {step}: ran {ran}"
            for i, t in enumerate(ran):  # each send right after the op that produced it (split backward)
                if "SEND_" in t:
                    assert ran[i - 1] == t.replace("SEND_", ""), f"rank {r} step {step}: {t} after {ran[i - 1]}"
