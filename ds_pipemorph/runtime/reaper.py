"""Shared memory a training process creates is removed however it ends, SIGKILL included.

``watch(names)`` starts, once per process, a small process outside the training process's tree (its
own session, parent 1: a launcher that kills the rank's process tree does not reach it) that holds the
read end of a pipe whose only write end the training process holds. The pipe closes however the
training process ends (return, exception, a signal, ``kill -9``); the reaper then removes
``/dev/shm/pm_<pid>_*`` (the delegated transport's staging rings, named after their creator's pid) and
every name it was told (DeepSpeed's CPU all-reduce buffer of the rank; the ``pymp-*`` folder that holds
the delegates' fork server's socket), and exits. Names are added
through the pipe, one a line. Removing a name takes nothing from a process that still maps it: the
memory goes when the last one unmaps it.

``reclaim_orphans()``: rings whose creator's pid no longer runs (left by a host that lost power, or by
a version without the reaper) are removed at the next start, and only those.

This file is run by path, stdlib only (``python -I reaper.py PID``): it starts in milliseconds.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

SHM = Path("/dev/shm")
_proc = None  # this process's reaper: (pid it watches for, the pipe's write end)
_told: set = set()  # the names this process told it
_lock = threading.Lock()


def ring_prefix(pid: int) -> str:
    """The name prefix of every staging ring created by process ``pid`` (``DelegatedTransport._ring_name``)."""
    return f"pm_{pid}_"


def watch(*names: str | os.PathLike) -> None:
    """Make sure this process has a reaper, and tell it ``names`` too (paths under /dev/shm, or a
    ``pymp-*`` folder of multiprocessing's), each once."""
    global _proc, _told
    if not SHM.is_dir():
        return
    with _lock:
        if _proc is None or _proc[0] != os.getpid():  # a forked child needs its own
            r, w = os.pipe()
            p = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(os.getpid())], stdin=r,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            os.close(r)
            p.wait()  # the first process exits once it forked the reaper away from this process's tree
            _proc = (os.getpid(), w)
            _told = set()
        w = _proc[1]
        for n in names:
            if os.fspath(n) in _told:
                continue
            _told.add(os.fspath(n))
            try:
                os.write(w, f"{os.fspath(n)}\n".encode())
            except OSError:  # the reaper is gone (killed by hand): nothing to tell
                pass


def reclaim_orphans() -> list[str]:
    """Remove staging rings whose creator (the pid in their name) no longer runs; the names removed."""
    removed = []
    for f in SHM.glob("pm_[0-9]*_*"):
        try:
            pid = int(f.name.split("_")[1])
        except (IndexError, ValueError):
            continue
        if not _running(pid):
            try:
                f.unlink()
                removed.append(f.name)
            except OSError:
                pass
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(owner: int, names: list[str]) -> None:
    for f in SHM.glob(ring_prefix(owner) + "*"):
        try:
            f.unlink()
        except OSError:
            pass
    for n in names:
        p = Path(n)
        if p.name.startswith("pymp-") and p.is_dir() and not p.is_symlink():  # multiprocessing's folder
            shutil.rmtree(p, ignore_errors=True)  # (under /dev/shm too, where TMPDIR points there)
        elif p.parent == SHM:  # only what is ours to remove
            try:
                p.unlink()
            except OSError:
                pass


def main(owner: int) -> int:
    if os.fork() > 0:  # the first process returns to the training process at once
        os._exit(0)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a Ctrl-C, a launcher's kill of the group
        signal.signal(s, signal.SIG_IGN)
    data = b""
    while True:
        try:
            chunk = os.read(0, 4096)
        except InterruptedError:
            continue
        if not chunk:
            break
        data += chunk
    _remove(owner, [n for n in data.decode(errors="replace").splitlines() if n])
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
