"""How the lab reports what goes wrong without a namespace: a node killed by a signal is not a
timeout, a rate trace that fails is not silent, a --logs path that cannot hold logs is refused
before any lab is built. These need no privilege."""
from __future__ import annotations

import signal
import subprocess
import threading

import pytest
import typer
from typer.testing import CliRunner

from ds_pipemorph.fileio import BadInput
from ds_pipemorph.lab import RateTrace
from ds_pipemorph.lab.trace import TraceFailed, TracePlayer
from ds_pipemorph_cli import lab_cmd


def sh(script: str) -> subprocess.Popen:
    return subprocess.Popen(["sh", "-c", script])


@pytest.mark.timeout(60)
def test_a_node_killed_by_a_signal_is_named_with_the_signal_not_as_a_timeout():
    procs = [sh("sleep 30"), sh("kill -SEGV $$")]
    try:
        failed = lab_cmd._wait_all(procs, timeout=30)
    finally:
        procs[0].kill()
        procs[0].wait()
    assert failed == {1: -signal.SIGSEGV}
    code, message = lab_cmd._verdict(failed, 30)
    assert code == 128 + 11  # SIGSEGV is 11 on Linux; a shell reports 139 for it
    assert message == "node 1 was killed by signal 11 (SIGSEGV)"


@pytest.mark.timeout(60)
def test_exit_codes_of_the_nodes_success_and_timeout_are_told_apart():
    assert lab_cmd._wait_all([sh("exit 0"), sh("exit 0")], timeout=30) == {}
    assert lab_cmd._verdict({}, 30) == (0, None)
    failed = lab_cmd._wait_all([sh("exit 0"), sh("exit 5")], timeout=30)
    assert failed == {1: 5}
    assert lab_cmd._verdict(failed, 30) == (5, "the job failed in node 1 (exit code 5)")
    slow = sh("sleep 30")
    try:
        assert lab_cmd._wait_all([slow], timeout=0.5) is None
    finally:
        slow.kill()
        slow.wait()
    code, message = lab_cmd._verdict(None, 0.5)
    assert code == 1 and "timed out" in message and "signal" not in message


def _trace(*ts: float) -> RateTrace:
    return RateTrace(points=[{"t": t, "rate": f"{10 * (i + 1)}mbit"} for i, t in enumerate(ts)])


@pytest.mark.timeout(60)
def test_a_rate_trace_whose_apply_fails_stops_and_raises_from_join_and_stop():
    seen = []

    def apply(bits: int) -> None:
        if len(seen) == 1:
            raise BadInput("'tc -n pmlab-x-n0 class change' failed: Cannot find device \"eth0\"")
        seen.append(bits)

    player = TracePlayer(_trace(0, 0.05, 0.1), apply).start()
    with pytest.raises(TraceFailed, match=r"t=0.05 s: 'tc -n pmlab-x-n0 class change' failed") as info:
        player.join(30)
    assert isinstance(info.value.__cause__, BadInput)
    assert not player.running
    assert seen == [10_000_000] and [r for _, r in player.applied] == [10_000_000]  # t=0.1 never applied
    player.stop()  # told once: stopping afterwards is quiet

    other = TracePlayer(_trace(0), lambda bits: 1 / 0).start()
    with pytest.raises(TraceFailed, match="division by zero"):
        other.stop()


@pytest.mark.timeout(60)
def test_a_rate_trace_that_works_is_stopped_early_without_error():
    applied = threading.Event()
    player = TracePlayer(_trace(0, 30), lambda bits: applied.set()).start()
    assert applied.wait(30)
    player.stop()
    assert not player.running and [r for _, r in player.applied] == [10_000_000]


@pytest.mark.timeout(60)
def test_the_cli_following_a_trace_that_fails_says_so_in_one_sentence_and_exits_1(capsys):
    def apply(bits: int) -> None:
        if bits == 20_000_000:
            raise BadInput("'tc -n pmlab-x-n0 class change' failed: Cannot find device \"eth0\"")

    player = TracePlayer(_trace(0, 0.05), apply).start()
    followed = []
    with pytest.raises(typer.Exit) as info:
        with lab_cmd._trace_errors():
            for point in lab_cmd._follow(player):
                followed.append(point[1])
    assert info.value.exit_code == 1 and followed == [10_000_000]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: the rate trace stopped at its point t=0.05 s: 'tc -n pmlab-x-n0 class change' failed: "
                   "Cannot find device \"eth0\""]


def refused(res) -> str:
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --logs"), res.stderr
    return lines[0]


def launch(logs) -> object:
    # A lab name no other test uses; were the check to come after the build, ip would be run.
    return CliRunner().invoke(lab_cmd.app, ["launch", "--nodes", "2", "--name", "logck", "--logs", str(logs),
                                            "--", "true"])


@pytest.mark.timeout(60)
def test_a_logs_path_that_is_a_file_is_refused_before_the_lab_is_built(tmp_path, monkeypatch):
    from ds_pipemorph.lab import Lab

    def no_build(self):
        raise AssertionError("the lab was built before --logs was checked")

    monkeypatch.setattr(Lab, "up", no_build)
    a_file = tmp_path / "logs.txt"
    a_file.write_text("kept\n")
    assert "is a file" in refused(launch(a_file))
    assert "is a file, not a directory" in refused(launch(a_file / "sub" / "dir"))
    assert a_file.read_text() == "kept\n" and sorted(p.name for p in tmp_path.iterdir()) == ["logs.txt"]
