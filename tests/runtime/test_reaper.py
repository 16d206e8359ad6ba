"""A process's shared memory goes when it dies by any signal, SIGKILL included (``runtime.reaper``); rings
whose creator no longer runs are reclaimed, those of a running process are not."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

SHM = Path("/dev/shm")

OWNER = textwrap.dedent("""
    import os, sys, time
    from ds_pipemorph.runtime import reaper

    extra = sys.argv[1]
    for name in (f"pm_{os.getpid()}_t0_0Fs0_g0", f"pm_{os.getpid()}_t0_0Br0_g1"):
        open(f"/dev/shm/{name}", "wb").close()
    open(extra, "wb").close()
    reaper.watch(extra)
    print("ready", flush=True)
    time.sleep(120)
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_a_killed_process_leaves_no_ring_and_no_named_buffer(tmp_path, sig):
    extra = SHM / f"deepspeed_allreduce_buffer_test_{os.getpid()}_{int(sig)}"
    p = subprocess.Popen([sys.executable, "-c", OWNER, str(extra)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        mine = list(SHM.glob(f"pm_{p.pid}_*"))
        assert len(mine) == 2 and extra.exists()
        os.kill(p.pid, sig)
        p.wait(timeout=30)
        deadline = time.monotonic() + 10
        while (list(SHM.glob(f"pm_{p.pid}_*")) or extra.exists()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(SHM.glob(f"pm_{p.pid}_*")) == [] and not extra.exists()
    finally:
        if p.poll() is None:
            p.kill()
        for f in [*SHM.glob(f"pm_{p.pid}_*"), extra]:
            f.unlink(missing_ok=True)


def test_orphaned_rings_are_reclaimed_and_a_running_owners_are_not():
    from ds_pipemorph.runtime.reaper import reclaim_orphans

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)  # exited: no process has this pid now (until it is reused)
    orphan = SHM / f"pm_{dead_pid}_t9_0Fs0_g0"
    live = SHM / f"pm_{os.getpid()}_t9_0Fs0_g0"
    for f in (orphan, live):
        f.write_bytes(b"")
    try:
        removed = reclaim_orphans()
        assert orphan.name in removed and not orphan.exists()
        assert live.exists() and live.name not in removed
    finally:
        for f in (orphan, live):
            f.unlink(missing_ok=True)
