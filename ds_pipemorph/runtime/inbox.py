"""Every receive of an iteration in flight at once, each completion a readiness event.

Readiness-driven dispatch needs to know, without blocking, whether a message is in. gloo cannot
say: its ``Work.is_completed()`` turns true only inside ``wait()``. So each receive of the
iteration is a ``Transport.recv`` running in a worker thread (daemon threads kept for the engine's
life, fed by a queue; a thread blocked in ``wait()`` holds no GIL, and a daemon thread never keeps a
failed rank's process alive); the training thread asks ``arrived`` (a flag) and, when nothing it
could run is ready, sleeps in ``wait_any`` until a receive completes. Any transport works this
way (direct, delegated, the router, test wrappers): ``recv`` matches by (kind, micro-batch), so the
receives can complete in any order. A receive's op record is stamped in its thread (``RECV_F3``:
from when the thread began waiting to when it had the message back, which can be up to the
interpreter's switch interval after the arrival), which is what the control loop's delay
estimator reads; with NVTX on, the same span is a range on that thread
(``OpRecorder.run_on_thread``).

Messages of one kind come from one neighbour over one ordered channel, in the order the neighbour
sends them, which is usually the order this stage posts their receives (the producer's order in
the plan). Their threads, though, wake in any order, so the second of two messages that landed
together can be announced first, and the stage would run its op ahead of the first one's, which
the replay, seeing both in, never does. So ``drain``, seeing a message announced while a receive of
its kind posted before it is not announced yet, waits for that one, at most ``settle_s`` (2 ms by
default) per call. That is microseconds when the earlier message is in and its thread only has to
run, a little more when the direct path still has to post its data receive after its header
(gloo then moves the two messages' data in the order their receives were posted), and the whole
``settle_s`` when the producer really sent in another order: a ready stage whose inputs came out
of the plan's order, or hints that order a kind differently on neighbouring stages. The time
spent waiting is counted in ``settled_ns``, not in ready dispatch's choosing time.
"""
from __future__ import annotations

import collections
import queue
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures import TimeoutError as FutureTimeout

from ..plan.ir.ops import message_op
from .transport.protocol import TransportTimeout

SETTLE_S = 0.002


class Inbox:
    def __init__(self, transport, workers: int, timeout_s: float, rank: int, settle_s: float = SETTLE_S):
        self.transport, self.timeout_s, self.rank, self.settle_s = transport, timeout_s, rank, settle_s
        self._max_workers = max(1, workers)
        self._workers: list[threading.Thread] = []
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._futures: dict[tuple[str, int], Future] = {}
        self._completed: collections.deque = collections.deque()  # (kind, mb) as receives end, for ``drain``
        self._unannounced: dict[str, list[int]] = {}  # kind -> micro-batches posted, not drained yet, in post order
        self._posted_at: dict[tuple[str, int], int] = {}  # (kind, mb) not drained yet -> when it was posted (a count)
        self._posts = 0
        self.settled_ns = 0  # time ``drain`` spent waiting for earlier receives (see the module)

    def post(self, kind: str, mb: int, recorder) -> None:
        """Start receiving message (kind, mb); ``recorder`` (an ``OpRecorder``) records it, and puts an
        NVTX range around it, on the receive's thread."""
        self.transport.post_recv(kind, mb)
        fut: Future = Future()
        self._futures[(kind, mb)] = fut
        self._unannounced.setdefault(kind, []).append(mb)
        self._posted_at[(kind, mb)] = self._posts
        self._posts += 1
        if len(self._workers) < min(self._max_workers, len(self._futures)):
            t = threading.Thread(target=self._work, name=f"pipemorph-recv-{len(self._workers)}", daemon=True)
            t.start()
            self._workers.append(t)
        self._jobs.put((fut, kind, mb, recorder))

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._receive(*job)
            del job  # a worker waiting for its next receive holds nothing of its last one

    def _receive(self, fut: Future, kind: str, mb: int, recorder) -> None:
        """One receive, on a worker. Its message is referenced by the future only (this frame ends
        with it): a worker's local would keep an iteration's tensors alive until the worker's next
        receive, one message per worker thread, well after the op that consumed it."""
        if not fut.set_running_or_notify_cancel():
            return
        try:
            payload = recorder.run_on_thread(str(message_op(kind, mb, False)), lambda: self.transport.recv(kind, mb))
        except BaseException as e:  # handed to the training thread at ``take``
            self._completed.append((kind, mb))
            fut.set_exception(e)
        else:
            # Announced before the future is done, never after: a stage that saw the future done
            # must find it in ``drain`` too (``take`` waits the microseconds in between).
            self._completed.append((kind, mb))  # deque.append: atomic
            fut.set_result(payload)

    def drain(self) -> list[tuple[str, int]]:
        """The receives that ended since the last call (a failed one too: ``take`` raises its error),
        with those of their kind posted before them that end within ``settle_s`` (see the module);
        the time spent settling adds to ``settled_ns``."""
        out = new = self._take_completed()
        deadline = None
        while new:
            behind = self._posted_before(new)
            if not behind:
                break
            now = time.perf_counter_ns()
            if deadline is None:
                deadline = now + int(self.settle_s * 1e9)
            elif now >= deadline:
                break
            wait(behind, timeout=(deadline - now) / 1e9)
            new = self._take_completed()
            out += new
            self.settled_ns += time.perf_counter_ns() - now
        return out

    def _take_completed(self) -> list[tuple[str, int]]:
        out = []
        while self._completed:
            out.append(self._completed.popleft())
        return out

    def _posted_before(self, announced: list[tuple[str, int]]) -> list[Future]:
        """Forget ``announced`` as unannounced; the receives posted before one of them, of its kind,
        not announced yet (done ones too: their announcement is in ``_completed`` already)."""
        latest: dict[str, int] = {}  # kind -> when the last-posted of ``announced`` was posted
        for kind, mb in announced:
            self._unannounced[kind].remove(mb)  # usually the first: announcements mostly come in order
            at = self._posted_at.pop((kind, mb))
            if at > latest.get(kind, -1):
                latest[kind] = at
        behind: list[Future] = []
        for kind, at in latest.items():
            for m in self._unannounced[kind]:  # in post order: stops at the first posted after
                if self._posted_at[(kind, m)] > at:
                    break
                f = self._futures.get((kind, m))  # None: taken already (only after an iteration failed)
                if f is not None:
                    behind.append(f)
        return behind

    def arrived(self, kind: str, mb: int) -> bool:
        return self._futures[(kind, mb)].done()

    def take(self, kind: str, mb: int):
        """The message (kind, mb), which has arrived; a failed receive raises its error here. Its
        completion was announced just before its result was set, so this waits microseconds; the
        timeout turns a broken announcement into an error naming the message, not a silent hang."""
        try:
            return self._futures.pop((kind, mb)).result(timeout=self.timeout_s)
        except FutureTimeout:
            raise TransportTimeout(f"rank {self.rank}: {message_op(kind, mb, False)} was announced as in but not "
                                   f"handed over within {self.timeout_s:g} s") from None

    def wait_any(self, waiting_for: list[str]) -> bool:
        """Sleep until one more receive completes; False at once if none is still running (one may
        have completed since the caller looked: it should look again). ``waiting_for``: what the
        stage waits for, for the timeout's message."""
        futures = [f for f in self._futures.values() if not f.done()]
        if not futures:
            return False
        done, _ = wait(futures, timeout=self.timeout_s, return_when=FIRST_COMPLETED)
        if not done:
            raise TransportTimeout(f"rank {self.rank}: timed out after {self.timeout_s:g} s with no op ready, "
                                   f"waiting for {', '.join(waiting_for)}")
        return True

    def wait_for(self, kind: str, mb: int, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for message (kind, mb); whether it is in."""
        done, _ = wait([self._futures[(kind, mb)]], timeout=timeout_s)
        return bool(done)

    @property
    def outstanding(self) -> int:
        return len(self._futures)

    def close(self) -> None:
        """Forget this iteration's receives and stop the workers (one still blocked in a receive
        ends with it or with the process: the threads are daemons)."""
        for fut in self._futures.values():
            fut.cancel()
        self._futures.clear()
        self._completed.clear()
        self._unannounced.clear()
        self._posted_at.clear()
        for _ in self._workers:
            self._jobs.put(None)
        self._workers = []
