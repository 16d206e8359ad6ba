"""``Copier``: one thread that runs staging copies in submission order, off the training thread.

It keeps the waits for a free staging slot off the training thread. On CPU this thread does the
memcpy into the slot (torch releases the GIL while copying) while the training thread computes the
next op; on a GPU it only enqueues the device-to-host copies and the publishing callback on the
side stream (§5.2's copy stream, ``staging.device_path``). The payload must not be changed after
submission, the same contract as a non-blocking ``isend``.
An error of a job is raised at the next ``check`` or ``drain``.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Optional

from ..protocol import TransportError, TransportTimeout


class Copier:
    def __init__(self, run: Callable[..., None], name: str):
        self._run_job = run
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._pending = 0
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None

    def submit(self, *job) -> None:
        """Queue ``run(*job)``; jobs run one at a time, in this order."""
        self.check()
        with self._cv:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name=self._name)
                self._thread.start()
        self._jobs.put(job)

    def check(self) -> None:
        """Raise the error of a failed job (once)."""
        with self._cv:
            err, self._error = self._error, None
        if err is not None:
            raise err if isinstance(err, TransportError) else TransportError(f"{self._name}: {err}") from err

    def drain(self, timeout_s: float) -> None:
        """Wait until every submitted job ran; raise the first error among them."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._pending == 0, timeout=timeout_s):
                raise TransportTimeout(f"{self._name}: {self._pending} staging copies still pending after "
                                       f"{timeout_s:g} s")
        self.check()

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._run_job(*job)
            except BaseException as e:  # noqa: BLE001  (handed to the training thread)
                with self._cv:
                    if self._error is None:
                        self._error = e
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()
