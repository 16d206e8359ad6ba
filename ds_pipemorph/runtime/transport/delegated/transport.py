"""``DelegatedTransport``: messages leave through host staging rings and delegate processes (PipeMorph §5.2).

Who owns what:

- The training process (this object) creates, per link direction it sends or receives on, ``queues``
  staging rings and one delegate process per ring (``supervision``: started once from a fork server,
  reused across iterations, restarted when one dies). ``send`` frames the message (``framing``: a small
  head + every tensor's bytes, cut into pieces of at most one slot) and a copy thread
  (``copier.Copier``) copies it into the next send ring, round-robin over the queues, while the
  training thread goes on (``sending``); the message stays referenced until the receiving side
  acknowledged it, so nothing is lost when a delegate dies. How the bytes move is chosen once from the
  device of the transport's tensors (``staging.device_path``): host memcpy on the CPU, asynchronous
  copies on side streams on a CUDA device.
- A sender delegate drains its ring, applies the injected delay of its link (one message in flight per
  queue: k queues are k independent FIFOs; ``delays`` shares the delays with it) and sends over its own
  two-process Gloo group; the receiver delegate on the neighbour rank fills the receiving training
  process's ring ahead of need (``delegate_proc``).
- ``recv(kind, mb)`` takes messages in sequence order (message n travels in queue n % k), stashes those
  for other (kind, mb) and drops duplicates; a receive posted ahead lets a prefetch thread copy the
  message out of its ring as soon as it arrives (``receiving``).

Every wait is cut into short slices that check the delegates are alive and ends with a
``TransportTimeout`` naming rank, op, link and queue after ``timeout_s``. A delegate pair whose
connection breaks, loudly or in silence (a downed interface: the peer's kernel stops acknowledging),
is replaced within about ``liveness_s`` (a quarter of ``timeout_s``, at most 5 s) on the next
interface, and the unacknowledged messages are re-sent, so a wait does not expire for a connection
that could be re-made. A peer that is alive but slow (a busy host) is never taken for a lost one:
the kernels judge the connection, not the peer's speed (``delegate_proc``, Liveness). A peer rank
that closed its transport while this one still waits for it ends that wait at once with a sentence.
``wait_sends`` returns once every message sent so far is held by the peer rank's receive ring.
Threads: ``send`` may run in another thread than ``recv`` (the failover of a delayed link re-sends
from its delivery thread); one lock covers sending, starting directions and restarting delegates.
"""
from __future__ import annotations

import itertools
import os
import sys
import threading
import time
import weakref
from collections.abc import Sequence

import torch

from ....plan.ir.ops import message_op
from ....staging.device_path import select_path, uses_cuda
from ...config import DelegationConfig
from ..protocol import link_of, peer_of
from .copier import Copier
from .delay_publishing import DelayPublishing
from .delegate_proc import SLICE_S, liveness_for
from .directions import Direction
from .receiving import Receiving
from .sending import Sending
from .supervision import Supervision, delegate_context

_instances = itertools.count()
_live: weakref.WeakSet = weakref.WeakSet()  # this process's transports not closed yet (``kill_all``)


def kill_all() -> None:
    """Stop every delegated transport of this process without its locks (``DelegatedTransport.kill``)."""
    for t in list(_live):
        t.kill()


class DelegatedTransport(Supervision, DelayPublishing, Sending, Receiving):
    """A ``protocol.Transport`` over delegate processes; see the module docstring for who owns what.

    ``delays`` (a ``runtime.hooks.DelaySource``) is applied inside the sender delegates. Delegates of a
    link direction are started on first use or by ``start_link``; both ends of a link must use the
    same ``queues`` and create their transports in the same order (that order names the rendezvous).
    """

    def __init__(self, rank: int, stage_id: int, stage_ranks: Sequence[int], timeout_s: float = 300.0,
                 device: torch.device | None = None, queues: int = 2, max_queues: int | None = None, delays=None,
                 slot_bytes: int | None = None, num_slots: int | None = None, session: str | None = None,
                 store_addr: str | None = None, store_port: int | None = None,
                 interfaces: Sequence[str] | None = None, liveness_s: float | None = None,
                 fault_at: dict | None = None, fit_ring: bool = False):
        if queues < 1:
            raise ValueError(f"rank {rank}: delegated transport needs at least 1 queue, got {queues}")
        if slot_bytes is None or num_slots is None:  # the ds_config's defaults (delegation.slot_mb, slots)
            defaults = DelegationConfig()
            slot_bytes = defaults.slot_mb << 20 if slot_bytes is None else slot_bytes
            num_slots = defaults.slots if num_slots is None else num_slots
        if slot_bytes < 4096:
            raise ValueError(f"rank {rank}: staging slots must hold at least 4096 bytes, got {slot_bytes}")
        self.rank, self.stage_id = rank, stage_id
        self.stage_ranks = list(stage_ranks)
        self.timeout_s = float(timeout_s)
        self.device = device or torch.device("cpu")
        self.staging_path = select_path(self.device)  # host memcpy, or CUDA copies on side streams
        self.k = queues
        self.max_k = max(queues, max_queues or queues)  # delegates started per direction (growing needs no start)
        self.delays = delays
        self.slot_bytes, self.num_slots = slot_bytes, num_slots
        # Cut each message so that it fills at most one queue's ring (``framing.piece_bytes``): a ring then
        # holds one message's bytes, not one per slot. On the host path only, where a ring's pages are
        # resident as far as pieces reach; a CUDA path's rings are pinned whole, and more pieces would only
        # cost round trips.
        self.fit_ring = bool(fit_ring) and not uses_cuda(self.device)
        # There too, a slot's pages leave both processes once its piece is taken out (the sender delegate
        # sent it, this process copied it out: ``staging.pages``): a ring holds only what is in it.
        self.staging_path.release = self.fit_ring
        self.session = session or f"t{next(_instances)}"
        self.store_addr = store_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = store_port or os.environ.get("MASTER_PORT")
        if not port:
            raise ValueError(f"rank {rank}: delegated transport needs the job's store: set MASTER_PORT (the "
                             f"delegates meet through a TCPStore client on MASTER_ADDR:MASTER_PORT)")
        self.store_port = int(port)
        self.interfaces = tuple(interfaces or ())
        # A delegate pair whose peer host acknowledges nothing this long is lost (delegate_proc's heartbeat).
        self.liveness_s = liveness_for(self.timeout_s) if liveness_s is None else float(liveness_s)
        if not 0 < self.liveness_s < self.timeout_s:
            raise ValueError(f"rank {rank}: liveness_s ({self.liveness_s:g}) must be above 0 and below timeout_s "
                             f"({self.timeout_s:g}): a silent pair must be replaced before the training "
                             f"process gives up on its message")
        # Testing: role ("send" | "recv") -> (point, message[, stall s]) where its delegates of
        # generation 0 die or stall (delegate_proc.fault_point).
        self.fault_at = dict(fault_at or {})
        self.events: list[str] = []  # one line per delegate restart (also logged)
        self.sent: dict[int, int] = {}
        self._dirs: dict[tuple[int, str, bool], Direction] = {}
        self._ctx = delegate_context()
        self._link_k: dict[int, int] = {}  # link -> queues per direction, where not self.k
        self._op = None
        self._closed = False
        self._lock = threading.RLock()
        self._copier = Copier(self._push_locked, f"rank {rank} staging copies")
        self._shared_delays = None  # (origin mp.Value, static mp.Array): what sender delegates read per message
        _live.add(self)

    def _describe(self, kind: str, mb: int, sending: bool, queue: int | None = None) -> str:
        prep = "to" if sending else "from"
        q = "" if queue is None else f" queue {queue}"
        return (f"{message_op(kind, mb, sending)} on link {link_of(self.stage_id, kind, sending)}{q} {prep} "
                f"stage {peer_of(self.stage_id, kind, sending)}")

    def _ring_name(self, link: int, kind: str, sending: bool, q: int, gen: int) -> str:
        role = "s" if sending else "r"
        return f"pm_{os.getpid()}_{self.session}_{link}{kind}{role}{q}_g{gen}"

    # -- lifecycle ----------------------------------------------------------------------------
    def begin_group(self) -> None:
        """Nothing to group: each message goes through its own delegate FIFO."""

    def end_group(self) -> None:
        pass

    def reset_shapes(self) -> None:
        """Nothing to forget: every delegated message carries its layout."""

    def close(self) -> None:
        """Stop every delegate (they exit within ~50 ms) and unlink the rings; no waiting on the wire.
        Close only once the neighbour ranks' ``wait_sends`` returned (the engine closes after the
        step's collectives): a receiver delegate stopped earlier may never acknowledge their last message.

        At interpreter shutdown (an engine collected after an uncaught error) it does nothing: the
        interpreter has frozen the daemon threads, one of which may hold this transport's lock for
        good (a prefetcher restarting a delegate), and the delegates unlink their rings and exit by
        themselves once this process is gone."""
        if sys.is_finalizing():
            return
        _live.discard(self)
        with self._lock:
            self._closed = True
        self._copier.stop()
        for d in self._dirs.values():
            with d.cv:
                d.cv.notify_all()
        for d in self._dirs.values():  # a prefetcher finishes its piece (one ring wait slice) and exits
            if d.prefetcher is not None:
                d.prefetcher.join(timeout=4 * SLICE_S)
        for d in self._dirs.values():
            for q in d.queues:
                q.stop.value = 1
        for d in self._dirs.values():
            for q in d.queues:
                q.proc.join(timeout=2.0)
                if q.proc.is_alive():
                    q.proc.kill()
                    q.proc.join(timeout=2.0)
                for r in [q.ring, *q.old_rings]:
                    r.close()
        self._dirs.clear()

    def kill(self, grace_s: float = 0.5) -> None:
        """Stop every delegate and unlink every ring now, taking no lock: for a process that is being
        stopped (``runtime.lifeline``) while its training thread may hold this transport's lock. The
        delegates get ``grace_s`` to stop in order (their peers then do not restart them), then SIGKILL."""
        _live.discard(self)
        self._closed = True
        queues = [q for d in list(self._dirs.values()) for q in d.queues]
        for q in queues:
            q.stop.value = 1
        deadline = time.monotonic() + grace_s
        for q in queues:
            q.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if q.proc.is_alive():
                q.proc.kill()
        for q in queues:  # the names only: another thread may be inside a ring (the memory goes at exit)
            for r in [q.ring, *q.old_rings]:
                try:
                    self._op.unlink(r.name)
                except Exception:  # noqa: BLE001  (gone already)
                    pass
