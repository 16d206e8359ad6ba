"""The state a delegated transport keeps per link direction and per delegate queue.

A *direction* is one (link, kind, sending) this rank uses: it owns ``queues`` delegate queues, each a
staging ring and the delegate process serving it. Messages of a direction are numbered (``next_seq``)
and spread round-robin over the first ``active`` queues from ``base_seq`` on. The send side keeps each
queue's unacknowledged messages; the receive side keeps messages taken out of order (``stash``), the one
being assembled (``partial``) and what the prefetch thread shares with ``recv`` (under ``cv``).
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class DelegateQueue:
    """One ring and the delegate that serves it."""

    index: int
    ring: Any
    proc: Any
    gen: Any  # mp.Value: generation of the pair's rendezvous (the delegate sets the next one when its peer goes)
    stop: Any
    acked: Any  # mp.Value: send: last message seq the peer holds; recv: last seq published into a ring of this queue
    ready: Any  # mp.Value: 0 until the pair met, 1 met, delegate_proc.PEER_CLOSED / PEER_GONE (``peer_end``)
    born: int = 0  # the generation this delegate was started for
    old_rings: list = field(default_factory=list)  # receive side: rings of a dead delegate, drained first
    unacked: deque = field(default_factory=deque)  # send side: framing.Message kept until acknowledged


@dataclass
class Direction:
    link: int
    kind: str
    sending: bool
    queues: list
    next_seq: int = 0  # send: next seq to assign; recv: next seq to take
    active: int = 0  # queues in use (a prefix of ``queues``; the rest are started and idle)
    base_seq: int = 0  # the first message of the current queue count: seq s goes to (s - base_seq) % active
    stash: dict = field(default_factory=dict)  # recv: (kind, mb) -> payload
    partial: dict | None = None  # recv: message being assembled
    # recv side, shared with the prefetch thread (under ``cv``):
    cv: threading.Condition = field(default_factory=threading.Condition)
    posted: dict = field(default_factory=dict)  # (kind, mb) posted or asked for and not yet returned (ordered)
    announced: int = 0  # messages posted so far: the prefetcher assembles messages next_seq < announced
    busy: bool = False  # a thread is taking a piece from a ring
    error: BaseException | None = None  # the prefetcher's failure, raised by the next recv
    prefetcher: threading.Thread | None = None
    duplicates: int = 0  # recv: pieces dropped as seen before (a re-sent message the ring held already)

    def queue_for(self, seq: int):
        return self.queues[(seq - self.base_seq) % self.active]

    def peer_end(self, q: DelegateQueue) -> str | None:
        """How the peer rank's delegate of ``q`` ended: "closed" (its training process closed the
        transport), "gone" (its training process died), or None (it did not)."""
        from .delegate_proc import PEER_CLOSED, PEER_GONE

        return {PEER_CLOSED: "closed", PEER_GONE: "gone"}.get(q.ready.value)
