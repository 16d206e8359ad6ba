"""Nothing a lab made outlives it: namespaces, veth pairs, bridges, qdiscs and the processes started
in its nodes are gone after a normal exit, a failing job, Ctrl-C and ``kill -9`` of the lab process."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds_pipemorph.lab import Lab, RateTrace, names
from ds_pipemorph.lab.trace import TraceFailed
from lab_helpers import alive, host_network, namespaces

HOLD = str(Path(__file__).with_name("hold_lab.py"))


def wait_gone(prefix: str, pid: int, seconds: float = 30) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and (namespaces(prefix) or alive(pid)):
        time.sleep(0.1)


def start_holder(*args: str) -> tuple[subprocess.Popen, str, int]:
    proc = subprocess.Popen([sys.executable, HOLD, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    assert line, proc.stderr.read()
    return proc, names.lab_prefix(line[0]), int(line[1])


@pytest.mark.timeout(120)
def test_a_failing_job_leaves_nothing_behind(lab_capable):
    before = host_network()
    with pytest.raises(subprocess.CalledProcessError):
        with Lab(nodes=2, networks=2) as lab:
            lab.shape(0, 1, "10mbit")
            lab.shape(1, 0, "20mbit", net=1)
            sleeper = lab.popen(0, ["sleep", "600"])
            assert len(namespaces(lab.prefix)) == 3  # two nodes and the switch
            job = lab.popen(1, ["sh", "-c", "exit 3"])
            if job.wait() != 0:
                raise subprocess.CalledProcessError(job.returncode, job.args)
    assert namespaces(lab.prefix) == []
    assert sleeper.poll() is not None
    assert host_network() == before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["fail", "sigint", "sigkill"])
def test_the_lab_process_ending_any_way_removes_its_lab(lab_capable, how):
    before = host_network()
    proc, prefix, job_pid = start_holder(*(["fail"] if how == "fail" else []))
    assert len(namespaces(prefix)) == 3 and alive(job_pid)
    if how == "fail":
        proc.stdin.write("fail now\n")
        proc.stdin.flush()
    else:
        proc.send_signal(signal.SIGINT if how == "sigint" else signal.SIGKILL)
    proc.wait(timeout=30)
    wait_gone(prefix, job_pid)  # after kill -9 the watchdog does it, a moment later
    assert namespaces(prefix) == []
    assert not alive(job_pid)
    assert host_network() == before


@pytest.mark.timeout(120)
def test_a_rate_trace_that_failed_is_raised_by_down_after_the_lab_is_removed(lab_capable):
    lab = Lab(nodes=2).up()
    guard = lab._watchdog
    try:
        player = lab.play(0, 1, RateTrace(points=[{"t": 0, "rate": "10mbit"}, {"t": 1, "rate": "20mbit"}]))
        end = time.monotonic() + 30
        while not player.applied and time.monotonic() < end:
            time.sleep(0.05)
        # A real failure of the next ``tc class change``: node 0's interface is gone.
        subprocess.run(["ip", "-n", lab.ns(0), "link", "del", "eth0"], check=True, timeout=30)
        while player.running and time.monotonic() < end:
            time.sleep(0.05)
    except BaseException:
        lab.down()
        raise
    assert [r for _, r in player.applied] == [10_000_000]
    with pytest.raises(TraceFailed, match="t=1 s"):
        lab.down()
    assert namespaces(lab.prefix) == []
    assert guard.wait(timeout=30) == 0 and lab._watchdog is None  # let go: nothing is left to retry


@pytest.mark.timeout(120)
def test_ls_lists_namespaces_that_are_not_labs_as_leftovers(lab_capable):
    # A name too long for a lab id, and the switch of a lab without nodes (a build cut short).
    ids = [f"probe{os.getpid():07d}", f"lefto{os.getpid() % 100}"]
    made = [names.switch_ns(i) for i in ids]
    try:
        for ns in made:
            subprocess.run(["ip", "netns", "add", ns], check=True, timeout=30)
        res = subprocess.run([sys.executable, "-c", "from ds_pipemorph_cli.app import app; app()", "lab", "ls"],
                             capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "250"})
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    assert res.returncode == 0, res.stderr
    for i in ids:
        assert any(f" {i} " in line and "leftover" in line for line in res.stdout.splitlines()), res.stdout
