"""A process's shared memory goes when it dies by any signal, SIGKILL included (``runtime.reaper``); rings
whose creator no longer runs are reclaimed, those of a running process are not."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
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


FORK_SERVER_OWNER = textwrap.dedent("""
    import time
    from multiprocessing import util
    from ds_pipemorph.runtime.transport.delegated.supervision import watch_socket_folder

    watch_socket_folder()
    print(util.get_temp_dir(), flush=True)
    time.sleep(120)
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig,tmpdir", [(signal.SIGKILL, None), (signal.SIGTERM, None), (signal.SIGKILL, "/dev/shm")])
def test_the_fork_servers_socket_folder_goes_with_a_killed_process(sig, tmpdir):
    # Multiprocessing removes its folder at a normal exit only; the delegated transport tells the
    # reaper before its fork server makes the socket there (in TMPDIR, which may be /dev/shm).
    env = {**os.environ, "TMPDIR": tmpdir} if tmpdir else None
    p = subprocess.Popen([sys.executable, "-c", FORK_SERVER_OWNER], stdout=subprocess.PIPE, text=True, env=env)
    folder = Path(p.stdout.readline().strip())
    try:
        assert folder.name.startswith("pymp-") and folder.is_dir() and str(folder.parent) == (tmpdir or tempfile.gettempdir())
        os.kill(p.pid, sig)
        p.wait(timeout=30)
        deadline = time.monotonic() + 10
        while folder.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not folder.exists()
    finally:
        if p.poll() is None:
            p.kill()
        if folder.name.startswith("pymp-"):
            shutil.rmtree(folder, ignore_errors=True)


INHERITING = textwrap.dedent("""
    import multiprocessing as mp, os, signal, sys, time
    from multiprocessing import util


    def child(q):
        from ds_pipemorph.runtime.transport.delegated.supervision import watch_socket_folder

        watch_socket_folder()
        q.put(util.get_temp_dir())
        time.sleep(120)


    if __name__ == "__main__":
        mine = util.get_temp_dir()  # the parent's folder: a child started by multiprocessing inherits it
        q = mp.get_context("spawn").Queue()
        p = mp.get_context("spawn").Process(target=child, args=(q,))
        p.start()
        theirs = q.get(timeout=100)
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        time.sleep(3)  # the child's reaper, were it told the folder, removes it within milliseconds
        print(theirs == mine, os.path.isdir(mine), flush=True)
""")


@pytest.mark.timeout(180)
def test_a_child_leaves_its_parents_socket_folder_to_its_parent(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(INHERITING)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["True", "True"]  # the same folder, still there for the parent


FORKING = textwrap.dedent("""
    import os, signal, time
    from multiprocessing import util
    from ds_pipemorph.runtime.transport.delegated.supervision import watch_socket_folder

    watch_socket_folder()  # the parent made its folder and told its reaper
    mine = util.get_temp_dir()
    pid = os.fork()
    if pid == 0:  # a forked child (a data loader's worker, say) that starts delegates of its own
        watch_socket_folder()
        time.sleep(120)
        os._exit(0)
    time.sleep(2)  # the child has told its reaper what it would
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    time.sleep(3)  # the child's reaper, were it told the folder, removes it within milliseconds
    print(os.path.isdir(mine), flush=True)
""")


@pytest.mark.timeout(120)
def test_a_forked_child_leaves_its_parents_socket_folder_to_its_parent():
    p = subprocess.run([sys.executable, "-c", FORKING], capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["True"]
