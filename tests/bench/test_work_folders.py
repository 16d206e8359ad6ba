"""A benchmark's work folder (``benchmarks/_common/_util.py``): removed when its run succeeds or its
input was bad, kept and named when the run fails; each run answers for the folders it made only."""
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "_common"))

from _util import BadInput, exit_on_bad_input, work_folder  # noqa: E402


def _run(code: int, made: list, raises: bool = False):
    def main():
        made.append(work_folder("pipemorph-test-work-"))
        (made[-1] / "node0.log").write_text("a log line\n")
        if raises:
            raise BadInput("--rate must be positive")
        return code
    return main


@pytest.mark.timeout(60)
def test_a_run_removes_its_folder_when_it_succeeds_or_its_input_is_bad_and_keeps_it_when_it_fails(capsys):
    made: list[Path] = []
    assert _run(0, made)() == 0  # a main called by itself, as a test calls it: its folder is its caller's
    outside = made[0]
    assert exit_on_bad_input(_run(1, made)) == 1
    failed = made[1]
    assert capsys.readouterr().err == f"the run's files are kept under {failed}\n"
    assert failed.is_dir() and outside.is_dir()

    assert exit_on_bad_input(_run(0, made)) == 0
    assert not made[2].exists() and failed.is_dir() and outside.is_dir()  # another run's folders stay
    assert capsys.readouterr().err == ""

    assert exit_on_bad_input(_run(0, made, raises=True)) == 2
    assert not made[3].exists()
    assert capsys.readouterr().err == "error: --rate must be positive\n"  # one sentence, no folder named

    assert exit_on_bad_input(_run(None, made)) == 0  # a main that returns nothing succeeded
    assert not made[4].exists()
    shutil.rmtree(failed)
    shutil.rmtree(outside)
