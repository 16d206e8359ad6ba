"""Every receive of an iteration in flight at once, each completion a readiness event.

Readiness-driven dispatch needs to know, without blocking, whether a message is in. gloo cannot
say: its ``Work.is_completed()`` turns true only inside ``wait()``. So each receive of the
iteration is a ``Transport.recv`` running in a worker thread of a pool kept for the engine's life
(a thread blocked in ``wait()`` holds no GIL); the training thread asks ``arrived`` (a flag) and,
when nothing it could run is ready, sleeps in ``wait_any`` until a receive completes. Any
transport works this way (direct, delegated, the router, test wrappers): ``recv`` matches by
(kind, micro-batch), so the receives can complete in any order. A receive's op record is stamped
in its thread (``RECV_F3``: from when the thread began waiting to the message's arrival), which is
what the control loop's delay estimator reads.
"""
from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from .oprecords import OpRecord
from .transport.protocol import TransportTimeout


class Inbox:
    def __init__(self, transport, workers: int, timeout_s: float, rank: int):
        self.transport, self.timeout_s, self.rank = transport, timeout_s, rank
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="pipemorph-recv")
        self._futures: dict[tuple[str, int], Future] = {}

    def post(self, kind: str, mb: int, records: list) -> None:
        """Start receiving message (kind, mb); its record goes to ``records`` when it is in."""
        self.transport.post_recv(kind, mb)
        self._futures[(kind, mb)] = self._pool.submit(self._recv, kind, mb, records)

    def _recv(self, kind: str, mb: int, records: list):
        t0 = time.monotonic_ns()
        payload = self.transport.recv(kind, mb)
        records.append(OpRecord(f"RECV_{kind}{mb}", t0, time.monotonic_ns()))  # list.append: atomic
        return payload

    def arrived(self, kind: str, mb: int) -> bool:
        return self._futures[(kind, mb)].done()

    def take(self, kind: str, mb: int):
        """The message (kind, mb), which has arrived; a failed receive raises its error here."""
        return self._futures.pop((kind, mb)).result()

    def wait_any(self, waiting_for: list[str]) -> None:
        """Sleep until one more receive completes (``waiting_for``: what the stage waits for)."""
        futures = [f for f in self._futures.values() if not f.done()]
        if not futures:
            raise RuntimeError(f"rank {self.rank}: no op is ready and no message is expected: "
                               "the readiness rule is stuck")
        done, _ = wait(futures, timeout=self.timeout_s, return_when=FIRST_COMPLETED)
        if not done:
            raise TransportTimeout(f"rank {self.rank}: timed out after {self.timeout_s:g} s with no op ready, "
                                   f"waiting for {', '.join(waiting_for)}")

    @property
    def outstanding(self) -> int:
        return len(self._futures)

    def close(self) -> None:
        self._futures.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
