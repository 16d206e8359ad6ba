"""The re-plan search beside training: one worker process that runs ``ControlPolicy.refine`` jobs in turn.

A re-plan's search takes milliseconds to seconds (it grows with stages x micro-batches and the
evaluation budget). On the training thread every rank would wait for it at an iteration boundary;
in a thread of the training process it would hold the GIL against the engine's dispatch. So the
planning rank starts one worker process (``python -m ds_pipemorph.control.replan_worker``: the
planner only, no torch) at its first job and hands it ``(policy, costs)`` pickled on a pipe; a
reader thread takes each answer back. ``poll`` never blocks, so the engine checks at every
iteration boundary whether the search has landed and trains on the plan in force until it has.

Frames on both pipes: an 8-byte little-endian length, then a pickle. A job is ``(number, policy,
costs)``; its answer ``(number, "ok", decision, seconds)`` or ``(number, "error", one sentence)``.
Only the answer of the job running now, from the worker running now, lands; a worker that dies
answers with an error too, so a caller never waits for a job that cannot land.
"""
from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import threading
from typing import Any, BinaryIO, Optional

_LEN = struct.Struct("<Q")


def write_frame(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LEN.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: BinaryIO) -> Optional[Any]:
    """The next frame's object, or None at the end of the stream."""
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    data = stream.read(n)
    if len(data) < n:
        return None
    return pickle.loads(data)


class BackgroundPlanner:
    """One job at a time: ``submit`` while ``busy`` is False, then ``poll`` until it answers."""

    def __init__(self) -> None:
        self._proc: Optional[subprocess.Popen] = None
        self._reader: Optional[threading.Thread] = None
        self._answer: Optional[tuple] = None
        self._lock = threading.Lock()
        self._job = 0  # number of the job running now (or last run)
        self.busy = False

    def submit(self, policy, costs) -> None:
        """Start ``policy.refine(costs)`` in the worker (starting the worker first if needed)."""
        if self.busy:
            raise RuntimeError("a re-plan search is already running")
        with self._lock:
            self._job += 1
            self._answer = None
        self.busy = True
        try:
            self._ensure_worker()
            write_frame(self._proc.stdin, (self._job, policy, costs))
        except (OSError, ValueError) as e:  # the worker is gone: answer with the reason
            self._land(self._proc, self._job, ("error", f"the re-plan worker cannot take a job ({e})"))

    def poll(self) -> Optional[tuple]:
        """The answer of the running job once (``("ok", decision, s)`` or ``("error", why)``), else None."""
        with self._lock:
            answer, self._answer = self._answer, None
        if answer is not None:
            self.busy = False
        return answer

    def close(self) -> None:
        """Stop the worker (idempotent): at the end of its input when idle, at once when searching."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if self.busy:
            proc.kill()
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _ensure_worker(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        self._proc = subprocess.Popen([sys.executable, "-m", "ds_pipemorph.control.replan_worker"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._reader = threading.Thread(target=self._read, args=(self._proc,), name="pipemorph-replan-reader",
                                        daemon=True)
        self._reader.start()

    def _read(self, proc: subprocess.Popen) -> None:
        while True:
            try:
                frame = read_frame(proc.stdout)
            except (OSError, pickle.UnpicklingError, EOFError) as e:
                frame = (self._job, "error", f"the re-plan worker's answer cannot be read ({e})")
            if frame is None:
                code = proc.wait()
                self._land(proc, self._job, ("error", f"the re-plan worker exited with code {code}"))
                return
            job, *answer = frame
            self._land(proc, job, tuple(answer))

    def _land(self, proc, job: int, answer: tuple) -> None:
        """Keep ``answer`` if it is for the job running now, from the worker running now."""
        with self._lock:
            if self.busy and proc is self._proc and job == self._job:
                self._answer = answer
