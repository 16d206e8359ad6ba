"""A benchmark's work folder (``benchmarks/_common/_util.py``): removed when its run succeeds or its
input was bad, kept and named when the run fails; each run answers for the folders it made only."""
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "_common"))

from _util import BadInput, exit_on_bad_input, keep, work_folder  # noqa: E402


def _run(code: int, made: list, raises: bool = False, kept: bool = False):
    def main():
        made.append(work_folder("pipemorph-test-work-"))
        (made[-1] / "node0.log").write_text("a log line\n")
        if kept:  # a rank failed, the run still reports what the others measured
            keep(made[-1])
        if raises:
            raise BadInput("--rate must be positive")
        return code
    return main


@pytest.mark.timeout(60)
def test_a_run_removes_its_folder_when_it_succeeds_or_its_input_is_bad_and_keeps_it_when_it_fails_or_asks(capsys):
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

    assert exit_on_bad_input(_run(0, made, kept=True)) == 0
    assert made[5].is_dir() and capsys.readouterr().err == f"the run's files are kept under {made[5]}\n"

    def exits():  # sys.exit(0) inside main: a success
        made.append(work_folder("pipemorph-test-work-"))
        sys.exit(0)
    with pytest.raises(SystemExit):
        exit_on_bad_input(exits)
    assert not made[6].exists()
    for path in (failed, outside, made[5]):
        shutil.rmtree(path)
