"""CPU burners pinned to one core: a real co-located job for compute-straggler benchmarks.

A burner is a separate Python process that spins (``while True``) on the core it is pinned to, at
normal priority, so the kernel's scheduler shares that core between it and whatever else runs
there. It can never outlive the process that started it: it asks the kernel for SIGKILL when its
parent dies (``prctl(PR_SET_PDEATHSIG)``), and checks every ~0.1 s that its parent is still the
process it was started by (covering a parent that died before the request took effect, and
systems without ``prctl``).

    with Burners(core=1, count=3):   # started, pinned and spinning when the block begins
        ...                          # killed (and reaped) when it ends, however it ends

Run as a script, this file is one burner: ``python _burner.py CORE PARENT_PID``.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
READY = "ready"


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent check below still ends it
        pass


def burn(core: int, parent: int) -> None:
    """Spin on ``core`` until the process ``parent`` is gone (one burner's whole life)."""
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before the request above took effect
        return
    os.sched_setaffinity(0, {core})
    print(READY, flush=True)
    next_check = time.monotonic() + 0.1
    x = 0
    while True:
        for i in range(20000):
            x += i * i
        x = 0
        if time.monotonic() >= next_check:
            if os.getppid() != parent:
                return
            next_check += 0.1


class Burners:
    """``count`` burners pinned to ``core``, started by ``start`` (returns once every one spins)
    and ended by ``stop`` (SIGKILL, then reaped). A context manager; ``stop`` is idempotent."""

    def __init__(self, core: int, count: int, ready_timeout_s: float = 120.0):
        if count < 1:
            raise ValueError("count must be at least 1")
        self.core, self.count, self.ready_timeout_s = core, count, ready_timeout_s
        self.procs: list[subprocess.Popen] = []

    def start(self) -> "Burners":
        cmd = [sys.executable, "-S", str(Path(__file__).resolve()), str(self.core), str(os.getpid())]
        try:
            for _ in range(self.count):
                self.procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True))
            deadline = time.monotonic() + self.ready_timeout_s
            for p in self.procs:  # readline blocks: a burner that never gets going fails the timeout below
                line = p.stdout.readline().strip()
                if line != READY or time.monotonic() > deadline:
                    raise RuntimeError(f"a burner on core {self.core} did not start (said {line!r}, exit code {p.poll()})")
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
        self.procs = []

    def __enter__(self) -> "Burners":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    burn(int(sys.argv[1]), int(sys.argv[2]))
