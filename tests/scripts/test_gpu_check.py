"""scripts/gpu_check.sh: its no-CUDA path, its syntax, the report writer, and that what it names exists.

Nothing here runs on a GPU: the GPU steps themselves have not run on this machine.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest

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
        ("staging_bench", "0", "60.3", str(bench), "", "python benchmarks/staging_throughput.py"),
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
    assert "problem: always_s4: losses differ" in text and "SKIPPED nsight" in text


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
