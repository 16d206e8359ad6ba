"""scripts/gpu_check.sh: its no-CUDA path, its syntax, the report writer, and that what it names exists.

Nothing here runs on a GPU: the GPU steps themselves have not run on this machine. The script's own
logic runs with a stand-in interpreter that claims CUDA and fails every GPU step; the host-staging shim
of the GPU jobs runs on CPU tensors, forced to stage them; the NCCL step's jobs and checks run on the
gloo double of NCCL's rules, the memory step's on CPU ranks with the activation meter's figure.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ds_pipemorph.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
NO_CUDA_LINE = "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing run"


def _report_module():
    spec = importlib.util.spec_from_file_location("gpu_check_report", ROOT / "scripts" / "gpu_check" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.timeout(120)
def test_without_cuda_it_says_so_in_one_line_and_exits_0_writing_nothing(tmp_path):
    if _cuda_available():
        pytest.skip("a CUDA device is here: the script would run its steps")
    out = tmp_path / "report"
    p = subprocess.run(["bash", str(SCRIPT), "--out", str(out)], capture_output=True, text=True, timeout=100,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout == NO_CUDA_LINE + "\n"
    assert p.stderr == ""
    assert not out.exists()


@pytest.mark.timeout(60)
def test_the_script_parses_and_rejects_unknown_arguments():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, timeout=30).returncode == 0
    p = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "unknown argument '--bogus'" in p.stderr


def _steps(tmp_path: Path) -> list[dict]:
    junit = tmp_path / "cuda_tests.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.staging.test_staging_nvcc" name="test_cuda_path_round_trip_on_a_gpu"/>'
        '<testcase classname="tests.runtime.test_oprecords" name="test_a_failing_op_propagates_its_error"/>'
        '</testsuite></testsuites>')
    job = tmp_path / "one_gpu_job.json"
    job.write_text(json.dumps({"ok": False, "failures": ["always_s4: losses differ"],
                               "key_numbers": {"s4": {"max_loss_diff": 0.25}}}))
    bench = tmp_path / "staging_throughput.json"
    bench.write_text(json.dumps({"benchmark": "staging_throughput", "rows": [
        {"size_mb": 16, "median_gbps": {"memcpy": 8.0, "ring": 5.0}, "ratio_vs_memcpy": {"ring": 0.625}}]}))
    rows = [
        ("cuda_tests", "0", "41.2", str(junit), "", "python -m pytest -q tests/staging/test_staging_nvcc.py"),
        ("one_gpu_job", "1", "95.0", str(job), "", "python scripts/gpu_check/one_gpu_job.py w k"),
        ("staging_bench", "0", "60.3", str(bench), "", "python benchmarks/transport/staging_throughput.py"),
        ("nsight", "skipped", "0", "", "nsys (Nsight Systems) is not installed", "python scripts/gpu_check/nsight.py w k"),
    ]
    tsv = tmp_path / "steps.tsv"
    tsv.write_text("".join("\t".join(r) + "\n" for r in rows))
    return _report_module().read_steps(tsv)


def test_the_report_writer_writes_json_and_text_and_fails_on_a_failed_step(tmp_path, capsys):
    report = _report_module()
    out = tmp_path / "out"
    assert report.write_report(_steps(tmp_path), out, 480) == 1
    data = json.loads((out / "gpu_check_report.json").read_text())
    text = (out / "gpu_check_report.txt").read_text()
    assert capsys.readouterr().out == text
    assert data["verdict"] == "FAILED" and data["failed"] == 1 and data["skipped"] == 1
    by = {s["name"]: s for s in data["steps"]}
    assert [s["name"] for s in data["steps"]] == ["cuda_tests", "one_gpu_job", "staging_bench", "nsight"]
    assert by["cuda_tests"]["status"] == "passed" and by["cuda_tests"]["key_numbers"]["passed"] == 2
    assert by["one_gpu_job"]["status"] == "failed" and by["one_gpu_job"]["problems"] == ["always_s4: losses differ"]
    assert by["staging_bench"]["key_numbers"] == {"16MB": {"memcpy_gbps": 8.0, "ring_gbps": 5.0, "ring_vs_memcpy": 0.62}}
    assert by["nsight"]["status"] == "skipped" and by["nsight"]["note"] == "nsys (Nsight Systems) is not installed"
    for s in data["steps"]:
        assert {"name", "command", "exit_code", "seconds", "key_numbers"} <= s.keys()
    assert text.startswith("gpu_check: FAILED (1 of 4 steps failed, 1 skipped)")
    assert "problem: always_s4: losses differ" in text and "SKIPPED    nsight" in text


def test_a_skipped_gpu_test_or_a_missing_key_file_fails_its_step(tmp_path):
    report = _report_module()
    steps = _steps(tmp_path)
    junit = Path(steps[0]["key_file"])
    junit.write_text(junit.read_text().replace(
        'name="test_cuda_path_round_trip_on_a_gpu"/>',
        'name="test_cuda_path_round_trip_on_a_gpu"><skipped message="needs a CUDA GPU"/></testcase>'))
    steps = [steps[0], {**steps[2], "key_file": str(tmp_path / "absent.json")}, steps[3]]
    assert report.write_report(steps, tmp_path / "out", 480) == 1
    by = {s["name"]: s for s in json.loads((tmp_path / "out" / "gpu_check_report.json").read_text())["steps"]}
    assert by["cuda_tests"]["status"] == "failed" and "did not pass: skipped" in by["cuda_tests"]["problems"][0]
    assert by["staging_bench"]["status"] == "failed" and "was not written" in by["staging_bench"]["problems"][0]


def test_all_passed_or_skipped_exits_0(tmp_path):
    report = _report_module()
    steps = [s for s in _steps(tmp_path) if s["name"] != "one_gpu_job"]
    assert report.main(["--steps", str(_write_tsv(tmp_path, steps)), "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "gpu_check_report.json").read_text())["verdict"] == "PASSED"


def _write_tsv(tmp_path: Path, steps: list[dict]) -> Path:
    tsv = tmp_path / "steps2.tsv"
    tsv.write_text("".join("\t".join([s["name"], "skipped" if s["exit_code"] is None else str(s["exit_code"]),
                                      str(s["seconds"]), s["key_file"], s["note"], s["command"]]) + "\n"
                           for s in steps))
    return tsv


def _defined(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


def test_every_file_and_test_the_script_and_its_drivers_name_exists():
    text = SCRIPT.read_text()
    drivers = sorted((ROOT / "scripts" / "gpu_check").glob("*.py"))
    named = set(re.findall(r"\b((?:tests|scripts|benchmarks)/[\w/]+\.(?:py|sh))(?:::(\w+))?", text))
    for d in drivers:  # the drivers name tests/... files as path parts: "tests" / "runtime" / "worker.py"
        src = d.read_text()
        named |= set(re.findall(r"\b((?:tests|scripts|benchmarks)/[\w/]+\.py)(?:::(\w+))?", src))
        named |= {("/".join(parts), "") for parts in
                  (re.findall(r'"([\w.]+)"', m) for m in re.findall(r'REPO((?:\s*/\s*"[\w.]+")+)', src))}
    pytest_paths = {p for p, _ in named if p.startswith("tests/")}
    assert {"tests/staging/test_staging_nvcc.py", "tests/runtime/worker.py", "tests/nvtx/nvtx_job.py"} <= pytest_paths
    for path, test in named:
        assert (ROOT / path).is_file(), f"{path} (named by gpu_check) does not exist"
        if test:
            assert test in _defined(ROOT / path), f"{path}::{test} does not exist"
    for path, tests in _report_module().GPU_ONLY_TESTS.items():
        assert path in pytest_paths and set(tests) <= _defined(ROOT / path)
    for imported in ("_assert_equal_to_stock", "_expected_peak"):  # what one_gpu_job.py reuses
        assert imported in _defined(ROOT / "tests" / "runtime" / "test_equivalence.py")


def test_a_step_the_budget_left_unrun_makes_the_check_incomplete_and_exit_1(tmp_path):
    report = _report_module()
    steps = [s for s in _steps(tmp_path) if s["name"] != "one_gpu_job"]
    steps.insert(1, {"name": "one_gpu_job", "exit_code": None, "not_run": "incomplete", "seconds": 0.0,
                     "key_file": "", "note": "not run: the 480 s budget was spent before this step",
                     "command": "python scripts/gpu_check/one_gpu_job.py w k"})
    tsv = tmp_path / "budget.tsv"
    tsv.write_text("".join("\t".join([s["name"], "budget" if s.get("not_run") == "incomplete" else
                                      "skipped" if s["exit_code"] is None else str(s["exit_code"]),
                                      str(s["seconds"]), s["key_file"], s["note"], s["command"]]) + "\n"
                           for s in steps))
    assert [s["not_run"] for s in report.read_steps(tsv)] == ["", "incomplete", "", "skipped"]
    assert report.main(["--steps", str(tsv), "--out", str(tmp_path / "out")]) == 1
    data = json.loads((tmp_path / "out" / "gpu_check_report.json").read_text())
    assert (data["verdict"], data["failed"], data["incomplete"], data["skipped"]) == ("INCOMPLETE", 0, 1, 1)
    assert {s["name"]: s["status"] for s in data["steps"]}["one_gpu_job"] == "incomplete"
    text = (tmp_path / "out" / "gpu_check_report.txt").read_text()
    assert text.startswith("gpu_check: INCOMPLETE (0 of 4 steps failed, 1 not run for want of time, 1 skipped)")
    assert "INCOMPLETE one_gpu_job" in text


def _stub_python(tmp_path: Path) -> Path:
    """A PYTHON for gpu_check.sh that claims a CUDA device (``STUB_GPUS`` of them, default 1), runs the
    report writer with the real interpreter and fails every GPU step at once: the script's own logic
    runs, no GPU work does."""
    stub = tmp_path / "python"
    stub.write_text(f"""#!/usr/bin/env bash
case "$*" in
  *torch.cuda.is_available*) echo True ;;
  *torch.cuda.device_count*) echo "${{STUB_GPUS:-1}}" ;;
  *versioned_extensions_dir*) [ -n "${{STUB_EXT:-}}" ] || exit 1; echo "$STUB_EXT" ;;
  *scripts/gpu_check/report.py*) exec {sys.executable} "$@" ;;
  *) echo "stub: no GPU step runs here"; exit 3 ;;
esac
""")
    stub.chmod(0o755)
    return stub


def _run_stubbed(tmp_path: Path, budget: str, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": str(_stub_python(tmp_path)), "GPU_CHECK_BUDGET_S": budget,
            "PATH": "/usr/bin:/bin", **env}  # no nsys on this PATH: the nsight step is skipped
    full.pop("TORCH_EXTENSIONS_DIR", None)
    return subprocess.run(["bash", str(SCRIPT), "--out", "rel/out"], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env=full)


@pytest.mark.timeout(90)
def test_a_spent_budget_leaves_steps_unrun_an_incomplete_verdict_and_a_relative_out_under_the_callers_dir(tmp_path):
    p = _run_stubbed(tmp_path, "5", STUB_EXT=str(tmp_path / "ext"))
    assert p.returncode == 1, p.stdout + p.stderr
    data = json.loads((tmp_path / "rel" / "out" / "gpu_check_report.json").read_text())
    assert data["verdict"] == "INCOMPLETE"
    assert {s["name"]: s["status"] for s in data["steps"]} == {
        "cuda_tests": "incomplete", "op_timing": "incomplete", "one_gpu_job": "incomplete", "memory": "incomplete",
        "nccl_job": "skipped", "tp_job": "skipped", "staging_bench": "incomplete", "nsight": "skipped"}
    nccl = next(s for s in data["steps"] if s["name"] == "nccl_job")  # one GPU: NCCL wants one per rank
    assert nccl["note"].startswith("needs 2 CUDA devices or more")


@pytest.mark.timeout(90)
def test_with_time_left_failing_steps_fail_the_check(tmp_path):
    p = _run_stubbed(tmp_path, "100", STUB_EXT=str(tmp_path / "ext"), STUB_GPUS="2")
    assert p.returncode == 1, p.stdout + p.stderr
    data = json.loads((tmp_path / "rel" / "out" / "gpu_check_report.json").read_text())
    assert data["verdict"] == "FAILED" and data["failed"] == 6  # with 2 GPUs the NCCL step runs too
    assert all(s["exit_code"] == 3 and s["seconds"] >= 0 for s in data["steps"]
               if s["name"] not in ("nsight", "tp_job"))
    tp = next(s for s in data["steps"] if s["name"] == "tp_job")  # 2 stages x 2 tensor-parallel ranks: 4 GPUs
    assert tp["status"] == "skipped" and tp["note"].startswith("needs 4 CUDA devices or more")


@pytest.mark.timeout(60)
def test_without_an_importable_package_it_says_so_in_a_sentence(tmp_path):
    p = _run_stubbed(tmp_path, "100")
    assert p.returncode == 2
    assert p.stderr.strip().endswith("cannot import ds_pipemorph (install the checkout's requirements); nothing run")
    assert not (tmp_path / "rel").exists()


def _host_p2p_module():
    spec = importlib.util.spec_from_file_location("gpu_check_host_p2p", ROOT / "scripts" / "gpu_check" / "host_p2p.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_host_staging_shim_leaves_cpu_tensors_alone_by_default():
    import torch

    assert _host_p2p_module().cuda_on_gloo(torch.zeros(2), None) is False


@pytest.mark.timeout(60)
def test_deepspeed_p2p_works_through_the_host_staging_shim_on_two_gloo_ranks(tmp_path):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "scripts" / "host_p2p_worker.py")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                              env={**os.environ, "DS_ACCELERATOR": "cpu", "RANK": str(r), "LOCAL_RANK": str(r),
                                   "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=50) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    staged = [json.loads(out.strip().splitlines()[-1])["staged"] for out, _ in outs]
    # rank 0: p2p.send, send_obj's two sends, two isends; rank 1: p2p.recv, recv_obj's two recvs, two irecvs
    assert staged[0] == {"send": 3, "recv": 1, "isend": 2, "irecv": 0}
    assert staged[1] == {"send": 1, "recv": 3, "isend": 0, "irecv": 2}


@pytest.mark.timeout(180)
def test_the_nccl_step_runs_its_jobs_and_checks_on_the_cpu_double_of_nccls_rules(tmp_path):
    """nccl_job.py --double: its jobs and checks, on gloo under NCCL's rules instead of NCCL (the NCCL
    run itself needs two GPUs); the key file says the engine trained like stock and ran NcclLowering."""
    keys = tmp_path / "nccl_job.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check" / "nccl_job.py"), str(tmp_path / "work"),
                        str(keys), "--double"], capture_output=True, text=True, cwd=ROOT, timeout=170,
                       env={**os.environ, "GPU_CHECK_STEP_S": "160"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    got = json.loads(keys.read_text())
    assert got["ok"] and got["failures"] == []
    for job in ("auto", "off"):
        k = got["key_numbers"][job]
        assert k["max_loss_diff"] <= 1e-5 and k["max_param_diff"] <= 1e-5 and k["p2p"] == ["NcclRules"]


@pytest.mark.timeout(180)
def test_the_tensor_parallel_step_runs_its_jobs_and_checks_on_the_cpu_double_of_nccls_rules(tmp_path):
    """tp_job.py --double: 2 stages x 2 tensor-parallel ranks on gloo under NCCL's rules (the NCCL run
    itself needs four GPUs); the key file says the engine trained like stock and ran NcclLowering."""
    keys = tmp_path / "tp_job.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check" / "tp_job.py"), str(tmp_path / "work"),
                        str(keys), "--double"], capture_output=True, text=True, cwd=ROOT, timeout=170,
                       env={**os.environ, "GPU_CHECK_STEP_S": "160"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    got = json.loads(keys.read_text())
    assert got["ok"] and got["failures"] == []
    for job in ("zb", "1f1b"):
        k = got["key_numbers"][job]
        assert k["max_loss_diff"] <= 1e-5 and k["max_param_diff"] <= 1e-5 and k["p2p"] == ["NcclRules"]


def _peak_memory_module():
    spec = importlib.util.spec_from_file_location("gpu_check_peak_memory", ROOT / "scripts" / "gpu_check" / "peak_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _derived_bytes(pm) -> tuple[int, list[int], int, int]:
    """(one message, F's bytes per micro-batch per stage, what B leaves for W = each Linear's input,
    the gradients B keeps for W) of the CPU sizes: a block saves its input, fc1's output and the
    GELU's (1 + 4 + 4 messages), the last stage's loss its prediction and target (2 more); W keeps
    each Linear's input (1 + 4) and the gradient of each Linear's output (4 + 1), and the biases'
    gradients B computed (4 + 1 widths)."""
    width, rows, blocks = pm.SIZES["cpu"]
    m = rows * width * 4
    f = [9 * blocks * m + (2 * m if s == pm.S - 1 else 0) for s in range(pm.S)]
    return m, f, 5 * blocks * m, 5 * blocks * (m + width * 4)


@pytest.mark.timeout(480)
def test_the_memory_step_on_cpu_measures_what_the_engine_predicted(tmp_path):
    """memory_job.py --device cpu: the memory step's 4 jobs on 4 CPU ranks in one launch, its checks,
    and the numbers against values derived from the model (the figure: the engine's activation meter)."""
    pm = _peak_memory_module()
    keys = tmp_path / "memory.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check" / "memory_job.py"), str(tmp_path / "work"),
                        str(keys), "--device", "cpu"], capture_output=True, text=True, cwd=ROOT, timeout=460,
                       env={**os.environ, "GPU_CHECK_STEP_S": "440"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    got = json.loads(keys.read_text())
    assert got["ok"] and got["failures"] == []
    assert got["key_numbers"]["device"] == "cpu" and "one B's transient" in got["key_numbers"]["what_else"]
    m, f, kept, grads = _derived_bytes(pm)
    S = pm.S
    assert got["key_numbers"]["profile_out_activation_mb"] == pytest.approx([x / 2**20 for x in f], rel=1e-6)
    rows = json.loads((tmp_path / "work" / "peak_memory.json").read_text())["rows"]
    assert len(rows) == len(pm.JOBS) * S * pm.MEASURED
    by = {(r["job"], r["stage"], r["iteration"]): r for r in rows}
    for (job, s, i), r in by.items():
        stock = by[("stock", s, i)]["measured"]
        if job == "stock":  # S - s micro-batches of F's bytes, as the engine predicts stock's
            assert r["measured"] == (S - s) * f[s], (s, r)
            continue
        assert (r["f"], r["w"], r["grads"]) == (f[s], kept, grads), (job, s, r)
        if job == "zb":  # the default: 1F1B's order, each W right after its B while a forward remains
            assert r["units"] == r["held_f"] == S - s and r["measured"] == (S - s) * f[s] == stock, (s, r)
        elif job == "adaptive":  # re-plans stay within stock's memory
            assert r["units"] <= S - s and r["held_f"] * f[s] <= r["measured"] <= stock, (s, r)
        else:  # adaptive_1.5: within the grant, every micro-batch between F and B counted
            assert r["units"] <= 1.5 * (S - s) and r["held_f"] * f[s] <= r["measured"] <= 1.5 * stock, (s, r)
            assert r["measured"] <= r["units"] * f[s], (s, r)  # W's share (5 of 9 messages a block) counted as 1
    assert any(by[("adaptive_1.5", s, 1)]["measured"] > by[("stock", s, 1)]["measured"] for s in range(S))


def _ideal_result(pm) -> dict:
    """A result file as a CPU run of the memory step writes it, with the derived numbers."""
    m, f, kept, grads = _derived_bytes(pm)
    rows = []
    for job, section in pm.JOBS.items():
        for s in range(pm.S):
            for i in range(1, 1 + pm.MEASURED):
                row = {"job": job, "rank": s, "stage": s, "iteration": i, "measured": (pm.S - s) * f[s], "saved": 0,
                       "start": 0, "params": 1000, "in": m if s else 0, "out": m if s < pm.S - 1 else 0}
                if section is not None:
                    row.update(units=pm.S - s, held_f=pm.S - s, held_w=1, f=f[s], w=kept, grads=grads,
                               stock_units=pm.S - s, recv_window=1, send_window=2)
                rows.append(row)
    profile = "memory:\n  activation_mb: [" + ", ".join(f"{x / 2**20:.9g}" for x in f) + "]\n"
    return {"device": "cpu", "sizes": {}, "rows": rows, "profile_out": profile}


def test_the_memory_steps_checks_fail_a_rank_above_stock_or_outside_the_predictions_bounds():
    pm = _peak_memory_module()
    m, f, kept, grads = _derived_bytes(pm)
    result = _ideal_result(pm)
    assert pm.compare(result)[1] == []
    row = next(r for r in result["rows"] if (r["job"], r["rank"], r["iteration"]) == ("zb", 1, 1))
    # the device's bound: the prediction, one B's transient and the output gradients of a pending W; on
    # CUDA also the held outputs, the windows' messages and the parameters' gradients and optimizer step
    lower, predicted, upper = pm.bounds(row, f[1], "cpu")
    assert (lower, predicted, upper) == (3 * f[1], 3 * f[1], 4 * f[1] + grads)
    # (the windows: recv_window 1 + send_window 2 messages of each kind, in and out)
    assert pm.bounds(row, f[1], "cuda")[2] - upper == 3 * m + (1 + 2) * 2 * m + pm.OPTIMIZER_FACTOR * 1000
    row["measured"] = int(1.2 * row["measured"])  # within the bounds, above stock's x 1.10: (a)
    other = next(r for r in result["rows"] if (r["job"], r["rank"], r["iteration"]) == ("adaptive", 0, 2))
    other["measured"] = 3 * f[0]  # fewer bytes than the 4 micro-batches held between F and B: (b)
    result["profile_out"] = None
    failures = pm.compare(result)[1]
    assert len(failures) == 3, failures
    assert failures[0].startswith("zb: rank 1 (stage 1) iteration 1 held") and "1.200x stock's" in failures[0]
    assert failures[1].startswith("adaptive: rank 0 (stage 0) iteration 2 measured") and "outside" in failures[1]
    assert failures[2] == "adaptive: profile_out was not written"
