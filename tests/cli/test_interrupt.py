"""Ctrl-C (SIGINT) or SIGTERM to a command that runs ranks: its ranks and delegates stop, its temporary
folder and the ranks' shared memory are removed, and it exits 128 + the signal's number with one line."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]


def _below(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _shm_of(procs) -> set[str]:
    names = set()
    for p in procs:
        try:
            names.update(m.path for m in p.memory_maps(grouped=True) if m.path.startswith("/dev/shm/"))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return names


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_stopped_demo_stops_its_ranks_removes_its_folder_and_says_so_in_one_line(tmp_path, sig):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-c", "from cli.app import console_main; console_main()", "demo", "--iterations", "500",
           "--out", str(tmp_path / "demo.json")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:  # until the ranks report iterations (the work folder holds their progress)
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the demo's ranks never reported progress"
            if any(p.stat().st_size for p in tmp.glob("pipemorph-bench-*/progress")):
                break
            time.sleep(0.5)
        below = _below(proc.pid)
        ranks = [p for p in below if "ds_pipemorph.bench.worker" in (c := " ".join(p.cmdline())) and "distributed.run" not in c]
        assert len(ranks) == 4, [p.cmdline() for p in below]
        shm = _shm_of(below)
        t0 = time.monotonic()
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            for p in _below(proc.pid):
                p.kill()
    assert proc.returncode == 128 + getattr(signal, sig), (out[-2000:], err[-3000:])
    assert took < 20, took
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1] == (f"pipemorph demo: stopped by {sig}; its ranks were stopped and its temporary files "
                         f"removed"), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    time.sleep(1.0)  # reapers remove a killed process's shared memory a moment after it ended
    assert [p.pid for p in below if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    assert list(tmp.glob("pipemorph-bench-*")) == []
    assert sorted(f for f in shm if os.path.exists(f)) == []
