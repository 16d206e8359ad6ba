"""A test double with NCCL's point-to-point rules on gloo (``inject.nccl_rules``; testing only).

``NcclRules`` is the direct path's point-to-point layer (``runtime.transport.direct.P2P``) when the
section asks for it. It runs on gloo what NCCL would run on GPUs, with NCCL's matching rules
(``plan.ir.nccl``), so that a stream NCCL cannot run fails here instead of passing:

- **one serial queue per peer**: every send and receive this rank issues with a peer, both
  directions, goes into one queue, executed in issue order by one worker thread per peer;
- **tags are ignored**: all messages of a pair travel on one gloo tag per direction, in order, and
  the k-th send meets the k-th receive. Each message carries its identity first (the direct path's
  tag: kind, micro-batch, part, and its size), so a receive that meets a different message than it
  was posted for raises ``TransportError`` naming both (NCCL would silently deliver wrong data);
- **rendezvous**: a send completes only once the peer's receive took it (the receiver answers with
  a small ack on a second tag, which the sender's worker waits for before its next queued op), so
  an op queued behind an unmatched one waits, and a stream NCCL would deadlock on ends in
  ``TransportTimeout`` after the transport's timeout, naming the op and what it is queued behind.

A slow link (``inject.links``, ``inject.trace``, ``inject.rank_links``) is slow here, in the pair's
queue: the worker holds each message's first tensor for the link's delay before sending it, so
everything queued behind it with that peer, both directions, waits too, as on NCCL's one stream per
pair; the messages keep their issue order.

Each message costs three gloo messages (identity, bytes, ack); the double is for correctness tests,
not for timing. A group (``batch``: ``batch_isend_irecv``) is queued op by op in its order, as if
each op were alone, which is stricter (``plan.ir.nccl_lowering``'s streams pass the dry run without
groups too), and like NCCL's coalesced batch it returns one work for the whole group; ``groups``
records what each group held (``("send", "F3 part 1")``, ...), so a test can check that the engine
issued the groups its stream asks for.
"""
from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..fileio import first_line
from ..runtime.transport.header import PARTS, untag
from ..runtime.transport.protocol import TransportError, TransportTimeout

DATA_TAG = 3 << 24  # above the direct path's tags: a message's identity, then its bytes, one direction
ACK_TAG = DATA_TAG + 1  # the receiver's ack: the send completes with its receive


class _Op:
    """One queued send or receive; a work as ``P2P`` describes it."""

    def __init__(self, rules: "NcclRules", sending: bool, tensor: torch.Tensor, peer: int, wire_tag: int):
        self.rules, self.sending, self.tensor, self.peer, self.tag = rules, sending, tensor, peer, wire_tag
        self.done = threading.Event()
        self.error: Optional[TransportError] = None

    def __str__(self) -> str:
        return f"{'send' if self.sending else 'receive'} of {untag(self.tag)} {'to' if self.sending else 'from'} " \
               f"rank {self.peer}"

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        seconds = self.rules.timeout_s if timeout is None else timeout.total_seconds()
        if not self.done.wait(seconds):
            head = self.rules.head(self.peer)
            behind = "" if head is None or head is self else f", queued behind the {head}"
            raise TransportTimeout(f"rank {self.rules.rank}: timed out after {seconds:g} s waiting for the {self}"
                                   f"{behind} (NCCL's in-order point-to-point rules)")
        if self.error is not None:
            raise self.error
        return True


class _Batch:
    """One work for a whole group, done when every op of it is (NCCL's coalesced batch)."""

    def __init__(self, ops: list[_Op]):
        self.ops = ops

    def is_completed(self) -> bool:
        return all(op.is_completed() for op in self.ops)

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Waits at most ``timeout`` for the whole group (each op gets what is left of it)."""
        if timeout is None:
            for op in self.ops:
                op.wait(None)
            return True
        deadline = time.monotonic() + timeout.total_seconds()
        for op in self.ops:
            op.wait(timedelta(seconds=max(0.0, deadline - time.monotonic())))
        return True


class NcclRules:
    """NCCL's point-to-point rules on gloo for one rank (module docstring); ``in_order`` is set."""

    in_order = True

    def __init__(self, rank: int, timeout_s: float, delay_s: Optional[Callable[[int], float]] = None):
        """``delay_s(peer)``: seconds each message to ``peer`` is held before its first tensor is sent."""
        self.rank, self.timeout_s = rank, float(timeout_s)
        self.delay_s = delay_s
        self._queues: dict[int, queue.Queue] = {}
        self._heads: dict[int, Optional[_Op]] = {}  # peer -> the op its worker runs now
        self._received: dict[int, int] = {}  # peer -> receives completed (for the error's "no. k")
        self.groups: list[list[tuple[str, str]]] = []  # per group issued: ("send"|"recv", untag text) per op
        self._lock = threading.Lock()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> _Op:
        return self._issue(_Op(self, True, tensor, dst, tag))

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> _Op:
        return self._issue(_Op(self, False, tensor, src, tag))

    def batch(self, ops) -> list[_Batch]:
        """A group of (sending?, tensor, peer, tag): queued in its order, each op as if alone; one work
        for all of it, as NCCL returns."""
        self.groups.append([("send" if sending else "recv", untag(t)) for sending, _, _, t in ops])
        return [_Batch([self._issue(_Op(self, sending, tensor, peer, t)) for sending, tensor, peer, t in ops])]

    def head(self, peer: int) -> Optional[_Op]:
        return self._heads.get(peer)

    def close(self) -> None:
        """Let the workers end once their queues are done (a worker stuck on a peer ends at its timeout)."""
        with self._lock:
            for q in self._queues.values():
                q.put(None)
            self._queues = {}

    def _issue(self, op: _Op) -> _Op:
        with self._lock:
            q = self._queues.get(op.peer)
            if q is None:
                q = self._queues[op.peer] = queue.Queue()
                threading.Thread(target=self._serve, args=(op.peer, q), daemon=True,
                                 name=f"nccl-rules-{self.rank}-{op.peer}").start()
            q.put(op)
        return op

    def _serve(self, peer: int, q: queue.Queue) -> None:
        failed: Optional[TransportError] = None  # NCCL's stream stops at a failed op: so do the ops behind it
        while True:
            op = q.get()
            if op is None:
                return
            self._heads[peer] = op
            if failed is None:
                try:
                    self._send(op) if op.sending else self._recv(op)
                except TransportError as e:
                    failed = e
                except Exception as e:  # noqa: BLE001 - e.g. isend itself failing: the op's error, not a dead thread
                    failed = TransportError(f"rank {self.rank}: {op} failed: {first_line(e)}")
                    failed.__cause__ = e
            op.error = failed
            op.done.set()

    def _gloo(self, work, op: _Op, step: str) -> None:
        start = time.monotonic()
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            if time.monotonic() - start >= 0.95 * self.timeout_s:
                raise TransportTimeout(f"rank {self.rank}: timed out after {self.timeout_s:g} s at the {op} "
                                       f"({step}; NCCL's in-order point-to-point rules)") from None
            raise TransportError(f"rank {self.rank}: the {op} failed ({step}): {first_line(e)}") from e

    def _send(self, op: _Op) -> None:
        t = op.tensor
        if self.delay_s is not None and op.tag % PARTS == 1:  # a message's first tensor: it crosses the slow link
            seconds = self.delay_s(op.peer)
            if seconds > 0:
                time.sleep(seconds)
        identity = torch.tensor([op.tag, t.numel() * t.element_size()], dtype=torch.int64)
        self._gloo(dist.isend(identity, dst=op.peer, tag=DATA_TAG), op, "its identity")
        self._gloo(dist.isend(t, dst=op.peer, tag=DATA_TAG), op, "its bytes")
        self._gloo(dist.irecv(torch.zeros(1, dtype=torch.int64), src=op.peer, tag=ACK_TAG), op,
                   "waiting for the peer's receive to take it")

    def _recv(self, op: _Op) -> None:
        identity = torch.zeros(2, dtype=torch.int64)
        self._gloo(dist.irecv(identity, src=op.peer, tag=DATA_TAG), op, "its identity")
        got, size = identity.tolist()
        k = self._received[op.peer] = self._received.get(op.peer, 0) + 1
        want = op.tensor.numel() * op.tensor.element_size()
        if (got, size) != (op.tag, want):
            raise TransportError(
                f"rank {self.rank}: receive no. {k} from rank {op.peer} was posted for {untag(op.tag)} ({want} bytes)"
                f" but meets {untag(got)} ({size} bytes): NCCL matches a pair's k-th send with its k-th receive, "
                f"whatever the tags, and would deliver the wrong data")
        self._gloo(dist.irecv(op.tensor, src=op.peer, tag=DATA_TAG), op, "its bytes")
        self._gloo(dist.isend(torch.ones(1, dtype=torch.int64), dst=op.peer, tag=ACK_TAG), op, "the ack")
