"""The NVTX contract end to end: a real PipeMorphEngine job recorded by an NVTX injection library,
written as an nsys SQLite export and read back by `pipemorph trace inspect`.

The job: 2 stages x 2 data-parallel replicas (4 ranks under torchrun, CPU/gloo), 3 micro-batches,
2 train_batch calls. Each rank also writes its rank, stage, replica, pid and op records, so the
ranges can be checked against what the engine did and the reader's rank mapping against who each
process is.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from nvtx_capture import build_injection, export_sqlite, injection_env, read_all, unavailable_reason
from typer.testing import CliRunner

from ds_pipemorph.procs import run_group
from ds_pipemorph_cli.app import app

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STAGES, DP, N, STEPS = 2, 2, 3, 2
MICRO_BATCH_OP = re.compile(r"(?:LOAD|F|B|W|SEND_F|RECV_F|SEND_B|RECV_B)(\d+)")  # instructions of one micro-batch

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")


def _run_job(tmp_path_factory, stages: int, dp: int, *more: str):
    """Run nvtx_job.py once with the injection loaded; (rank reports, recorded processes, export path)."""
    tmp = tmp_path_factory.mktemp("nvtx_job")
    lib = build_injection(tmp)
    env = {**os.environ, **injection_env(lib, tmp / "nvtx"), "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={stages * dp}",
           str(HERE / "nvtx_job.py"), str(tmp), str(stages), str(dp), str(N), str(STEPS), *more]
    p = run_group(cmd, 540, cwd=REPO, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(stages * dp)]
    return ranks, {pr.pid: pr for pr in read_all(tmp / "nvtx")}, export_sqlite(tmp / "nvtx", tmp / "report.sqlite")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return _run_job(tmp_path_factory, STAGES, DP)


def expected_ops(stage: int) -> dict[str, int]:
    """One iteration of one rank: F, B, W of every micro-batch; per link it touches, N messages each way."""
    ops = {"F": N, "B": N, "W": N}
    if stage > 0:  # receives activations from stage - 1, sends it their gradients
        ops.update(RECV_F=N, SEND_B=N)
    if stage < STAGES - 1:
        ops.update(SEND_F=N, RECV_B=N)
    return dict(sorted(ops.items()))


@pytest.mark.timeout(600)
def test_every_instruction_is_one_range_inside_its_iteration_with_stage_category_and_payloads(job):
    ranks, procs, _ = job
    assert sorted(procs) == sorted(r["pid"] for r in ranks)  # one recording per rank, nothing else
    for me in ranks:
        assert me["nvtx_active"]
        proc = procs[me["pid"]]
        ranges = proc.in_domain("pipemorph")
        assert ranges and all(r.end is not None and r.kind == "push_pop" for r in ranges)
        assert {name for _, _, _, _, name in proc.categories} == {f"stage{me['stage']}"}  # nvtxDomainNameCategoryA
        assert all(r.category == f"stage{me['stage']}" and r.registered for r in ranges)
        iters = [r for r in ranges if r.depth == 0]
        assert [r.message for r in iters] == [f"ITER{k}" for k in range(STEPS)]
        assert all(r.payload_type == 2 and r.payload == me["rank"] for r in iters)  # int64: the global rank
        ops = [r for r in ranges if r.depth == 1]
        assert len(ops) + len(iters) == len(ranges)
        records = [rec for batch in me["records"] for rec in batch]
        assert [r.message for r in ops] == [op for op, _, _ in records]
        for r, (op, t0, t1) in zip(ops, records):
            assert t0 <= r.start <= r.end <= t1, op  # the range lies inside the engine's own record (one clock)
            m = MICRO_BATCH_OP.fullmatch(op)
            if m:
                assert (r.payload_type, r.payload) == (2, int(m.group(1))), op
            else:  # OptimizerStep, ReduceGrads, ...
                assert r.payload is None, op
        for k, it in enumerate(iters):
            inside = [r.message for r in ops if it.start <= r.start and r.end <= it.end]
            assert inside == [op for op, _, _ in me["records"][k]]


@pytest.mark.timeout(600)
def test_trace_inspect_reports_the_jobs_iterations_stages_ranks_and_op_counts(job):
    ranks, _, report = job
    r = CliRunner().invoke(app, ["trace", "inspect", str(report), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["warnings"] == [] and out["iterations"] == list(range(STEPS))
    assert out["measures"].startswith("host time") and "not the kernels" in out["measures"]  # said on every read
    # Ranks come from the ITER payloads, stages from the categories: each process is who it says it is.
    truth = sorted((me["rank"], me["stage"], me["pid"]) for me in ranks)
    assert [(x["rank"], x["stage"], x["pid"]) for x in out["ranks"]] == truth
    assert sorted(x["stage"] for x in out["ranks"]) == sorted(s for s in range(STAGES) for _ in range(DP))
    for x in out["ranks"]:
        assert x["iterations"] == STEPS
        assert [it["ops"] for it in x["per_iteration"]] == [expected_ops(x["stage"])] * STEPS
    (link,) = out["links"]
    assert link["link"] == 0 and link["unmatched"] == 0
    assert link["messages"] == DP * STEPS * N * 2  # per replica pair and iteration: N activations, N gradients


@pytest.mark.timeout(600)
def test_replicas_pair_by_rank_so_every_message_is_received_after_it_was_sent(job):
    from ds_pipemorph.trace.measured import message_pairs
    from ds_pipemorph.trace.nsys import read_nsys

    ranks, _, report = job
    t = read_nsys(report)
    replica = {me["rank"]: me["replica"] for me in ranks}
    pairs, unmatched = message_pairs(t)
    assert len(pairs) == DP * STEPS * N * 2 and unmatched == {0: 0}
    for _, sender, send, receiver, recv in pairs:
        assert replica[sender.rank] == replica[receiver.rank]  # DeepSpeed's p2p pairs replicas by data-parallel id
        assert send.start_ns < recv.end_ns


@pytest.mark.timeout(600)
def test_ready_dispatchs_receives_are_ranges_on_their_receive_threads_inside_their_records(tmp_path_factory):
    """Ready dispatch receives in threads of its own (``runtime.inbox``): each receive is one range on
    such a thread, named, categorised and numbered as on the training thread, within its op record."""
    ranks, procs, _ = _run_job(tmp_path_factory, 2, 1, "ready")
    for me in ranks:
        proc = procs[me["pid"]]
        ranges = proc.in_domain("pipemorph")
        iters = [r for r in ranges if r.message.startswith("ITER")]
        main = {r.tid for r in iters}
        assert len(iters) == STEPS and len(main) == 1
        kind = "RECV_F" if me["stage"] == 1 else "RECV_B"
        recvs = [r for r in ranges if r.message.startswith("RECV_")]
        assert sorted(r.message for r in recvs) == sorted(f"{kind}{m}" for m in range(N) for _ in range(STEPS))
        for r in recvs:
            assert r.tid not in main and r.depth == 0 and r.end is not None, r
            assert r.category == f"stage{me['stage']}" and (r.payload_type, r.payload) == (2, int(r.message[6:]))
            k = next(k for k, it in enumerate(iters) if it.start <= r.start <= it.end)
            (t0, t1), = [(a, b) for op, a, b in me["records"][k] if op == r.message]
            assert t0 <= r.start <= r.end <= t1, r.message
