"""The console script ends file-only commands without the interpreter's final teardown: what they print,
the files they write and their exit codes must be exactly those of a normal exit."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

PROFILE = Path(__file__).resolve().parents[2] / "recipes" / "profiles" / "paper_fig4.yaml"
# What the ``pipemorph`` console script does (sys.argv holds the command line).
SCRIPT = "from ds_pipemorph_cli.app import console_main; console_main()"


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "120"})


@pytest.mark.timeout(120)
def test_plan_prints_everything_writes_the_plan_and_exits_0(tmp_path):
    out = tmp_path / "plan.yaml"
    p = run("plan", str(PROFILE), "-o", str(out), "--budget", "0.2", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    # The last line printed (after the tolerance table) is there: stdout was flushed before the end.
    assert "predicted iteration 390.0 ms" in p.stdout
    assert p.stdout.rstrip().endswith(f"wrote {out}")
    plan = yaml.safe_load(out.read_text())
    assert plan["warmup"] == [7, 5, 3, 1] and len(plan["schedule"]) == 4
    assert all(len(row) == 3 * 12 for row in plan["schedule"])


@pytest.mark.timeout(120)
def test_bad_input_still_exits_2_with_its_sentence(tmp_path):
    p = run("plan", str(tmp_path / "missing.yaml"), cwd=tmp_path)
    assert p.returncode == 2
    assert "no such file" in p.stderr


@pytest.mark.timeout(120)
def test_json_output_is_complete(tmp_path):
    p = run("plan", str(PROFILE), "--json", "--budget", "0.2", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert yaml.safe_load(p.stdout)["warmup"] == [7, 5, 3, 1]  # JSON is YAML: parses only if complete


@pytest.mark.timeout(120)
def test_exit_handlers_registered_before_still_run(tmp_path):
    marker = tmp_path / "handler-ran"
    script = (f"import atexit, pathlib; atexit.register(pathlib.Path({str(marker)!r}).write_text, 'yes'); "
              + SCRIPT)
    p = subprocess.run([sys.executable, "-c", script, "plan", str(tmp_path / "missing.yaml")], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and marker.read_text() == "yes"


def test_main_with_explicit_arguments_only_raises_systemexit():
    from ds_pipemorph_cli.app import main

    with pytest.raises(SystemExit) as e:
        main(["plan", "/nonexistent/profile.yaml"])
    assert e.value.code == 2  # the caller's process goes on
