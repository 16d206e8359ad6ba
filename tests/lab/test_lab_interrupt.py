"""Ctrl-C on ``pipemorph lab launch`` while a delegated job trains in its nodes: the command exits 130
with one line, and every rank, every delegate, every staging ring in /dev/shm and the lab itself are
gone within seconds. ``kill -9`` of the command: its watchdog removes the lab, killing what runs in
the nodes, the rings' reapers last (they remove the rings of the processes they watched).

A Ctrl-C in a terminal is SIGINT to the whole foreground process group: the command and whatever
shares its group. The job is tests/runtime/life_job.py, one rank per lab node under torchrun, every
link through delegates (staging rings in /dev/shm).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds_pipemorph.lab.names import lab_prefix
from lab_helpers import alive, namespaces

ROOT = Path(__file__).resolve().parents[2]
JOB = str(ROOT / "tests" / "runtime" / "life_job.py")
NODES = 3
STOP_S = 15.0  # the command's own stop (10 s to SIGKILL) and the lab's removal


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("sig", ["SIGINT", "SIGKILL"])
def test_ctrl_c_or_kill_of_lab_launch_stops_every_rank_and_delegate_and_leaves_no_ring_and_no_lab(lab_capable, tmp_path,
                                                                                                 sig):
    out = tmp_path / "job"
    out.mkdir()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc_per_node", "1",
                "--node_rank", "{node}", "--master_addr", "{master_addr}", "--master_port", "29631"]
    cmd = ["pipemorph", "lab", "launch", "--nodes", str(NODES), "--name", "ctlc", "--logs", str(tmp_path / "logs"),
           "--", *torchrun, JOB, str(out), "delegated", "100000"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 600
        while not all((out / f"step1.rank{r}").exists() for r in range(NODES)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the job never trained"
            time.sleep(0.5)
        pids = [int(p) for r in range(NODES) for p in (out / f"rank{r}.pid").read_text().split()]
        assert len(pids) > NODES  # delegates run beside the ranks
        rings = [f for f in os.listdir("/dev/shm") if f.startswith(tuple(f"pm_{p}_" for p in pids))]
        assert rings, "the delegated links made no staging ring"
        os.killpg(proc.pid, getattr(signal, sig))
        _, err = proc.communicate(timeout=STOP_S + 30)
        if sig == "SIGINT":
            assert proc.returncode == 130, err
            lines = [line for line in err.strip().splitlines() if line.strip()]
            assert lines == ["pipemorph lab launch: stopped by SIGINT; every node's command was stopped and the lab "
                             "removed"], err
            # the ranks stopped themselves on the SIGTERM their torchrun passed on, not killed by the lab
            logs = "".join((tmp_path / "logs" / f"node{k}.log").read_text() for k in range(NODES))
            assert "stopped by SIGTERM" in logs, logs[-3000:]
        deadline = time.monotonic() + STOP_S
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.2)
        assert [p for p in pids if alive(p)] == []
        while time.monotonic() < deadline and namespaces(lab_prefix("ctlc")):  # after kill -9: the watchdog's work
            time.sleep(0.2)
        assert namespaces(lab_prefix("ctlc")) == []  # the lab, and with it each ring's reaper, is gone
        assert [f for f in rings if os.path.exists(f"/dev/shm/{f}")] == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)
