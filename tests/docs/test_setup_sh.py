"""scripts/setup.sh: which pip commands each setting gives, run for real with a recording interpreter."""
import os
import re
import shlex
import subprocess
from importlib.metadata import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup.sh"
PIP = ["python", "-m", "pip", "install", "-q", "--disable-pip-version-check"]
TORCH = PIP + ["torch==2.13.0"]
PACKAGE = PIP + ["-e", ".[dev,milp,plot,interference]"]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def setup(tmp_path, **env):
    """Run setup.sh from another directory with only the given PIPEMORPH_* settings."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIPEMORPH_") and k != "PYTHON"}
    return subprocess.run(["bash", str(SETUP)], cwd=tmp_path, env={**clean, **env}, capture_output=True,
                          text=True, timeout=60)


def commands(stdout: str) -> list[list[str]]:
    return [shlex.split(line) for line in stdout.splitlines()]


@pytest.mark.parametrize("env, expected", [
    ({}, [TORCH, PACKAGE]),
    ({"PIPEMORPH_TORCH_INDEX_URL": CPU_INDEX}, [PIP + ["--index-url", CPU_INDEX, "torch==2.13.0"], PACKAGE]),
    ({"PIPEMORPH_SKIP_TORCH": "1"}, [PACKAGE]),
    ({"PIPEMORPH_SKIP_TORCH": "0"}, [TORCH, PACKAGE]),
])
def test_dry_run_prints_the_pip_commands_of_each_setting(tmp_path, env, expected):
    r = setup(tmp_path, PIPEMORPH_DRY_RUN="1", **env)
    assert r.returncode == 0, r.stderr
    assert commands(r.stdout) == expected


def test_without_dry_run_the_same_commands_run_from_the_repository_root(tmp_path):
    # PYTHON is the interpreter setup.sh runs pip with; this one records its arguments and directory.
    log = tmp_path / "calls"
    recorder = tmp_path / "python"
    recorder.write_text(f'#!/usr/bin/env bash\necho "$PWD $*" >> {shlex.quote(str(log))}\n')
    recorder.chmod(0o755)
    r = setup(tmp_path, PYTHON=str(recorder), PIPEMORPH_TORCH_INDEX_URL=CPU_INDEX)
    assert r.returncode == 0, r.stderr
    dry = setup(tmp_path, PYTHON=str(recorder), PIPEMORPH_TORCH_INDEX_URL=CPU_INDEX, PIPEMORPH_DRY_RUN="1")
    printed = [" ".join(c[1:]) for c in commands(dry.stdout)]
    assert log.read_text().splitlines() == [f"{ROOT} {c}" for c in printed]
    assert len(printed) == 2 and f"--index-url {CPU_INDEX} torch==2.13.0" in printed[0]


@pytest.mark.parametrize("env, needle", [
    ({"PIPEMORPH_SKIP_TORCH": "yes"}, "PIPEMORPH_SKIP_TORCH must be 0 or 1"),
    ({"PIPEMORPH_DRY_RUN": "true"}, "PIPEMORPH_DRY_RUN must be 0 or 1"),
    ({"PIPEMORPH_TORCH_INDEX_URL": "download.pytorch.org/whl/cpu"}, "PIPEMORPH_TORCH_INDEX_URL must be an index URL"),
    ({"PIPEMORPH_SKIP_TORCH": "1", "PIPEMORPH_TORCH_INDEX_URL": CPU_INDEX}, "drop PIPEMORPH_TORCH_INDEX_URL"),
])
def test_bad_settings_get_one_sentence_exit_2_and_run_nothing(tmp_path, env, needle):
    r = setup(tmp_path, PIPEMORPH_DRY_RUN=env.pop("PIPEMORPH_DRY_RUN", "1"), **env)
    assert r.returncode == 2 and r.stdout == ""
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert re.fullmatch(r"setup\.sh: [^\n]+\.\n", r.stderr)


def test_the_extras_setup_installs_are_the_ones_the_package_declares():
    declared = set(metadata("ds_pipemorph").get_all("Provides-Extra"))
    assert set(re.search(r"\[(.*)\]", PACKAGE[-1]).group(1).split(",")) == declared
