"""The send side of a delegated transport: into the staging rings, and waiting for acknowledgements.

``send`` frames the message (``framing``), gives it the next sequence number of its direction, keeps
it in its queue's unacknowledged list and hands the copy into the ring to the copy thread
(``copier.Copier``), so the training thread goes on while the bytes move (§5.2). The copy waits only
while every slot of the ring is full, checking that the delegate draining it is alive. A message stays
referenced until the peer's delegate acknowledged it: a restarted delegate gets every such message
again. ``wait_sends`` waits for the copies and then for every acknowledgement.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..header import encode_header
from ..protocol import TransportError, TransportTimeout, peer_of
from . import framing
from .delegate_proc import MAX_PIECES, SLICE_S, make_tag
from .directions import DelegateQueue, Direction


class Sending:
    """Part of ``DelegatedTransport``: its send side (its lock covers sending and restarts)."""

    def send(self, kind: str, mb: int, payload: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Copy message (kind, mb) into the next send ring and return (waits only on a full ring)."""
        with self._lock:
            self._send(kind, mb, payload)

    def _send(self, kind: str, mb: int, payload) -> None:
        self._copier.check()
        d = self._direction(kind, True)
        self._publish_delays()
        bare = isinstance(payload, torch.Tensor)
        tensors = [self.staging_path.outgoing(t) for t in ([payload] if bare else payload)]
        meta = encode_header(tensors, bare)
        _, total = framing.tensor_segments(tensors)
        cut = framing.piece_bytes(total, self.slot_bytes, self.num_slots, self.fit_ring)
        pieces = framing.pieces_of(total, cut)
        if pieces > MAX_PIECES:
            raise TransportError(f"rank {self.rank}: {self._describe(kind, mb, True)}: a message of {total} bytes "
                                 f"needs {pieces} pieces of {cut} bytes (at most {MAX_PIECES}); raise "
                                 f"pipemorph.delegation.slot_mb")
        head = framing.make_head(d.next_seq, kind, mb, total, pieces, cut, meta)
        q = d.queue_for(d.next_seq)
        self._check_alive(d, q, "sending")  # a waitpid(WNOHANG): microseconds
        msg = framing.Message(d.next_seq, head, tensors, self._describe(kind, mb, True, q.index),
                              cut, self.staging_path.sent(tensors))
        d.next_seq += 1
        for each in d.queues:  # what the peer holds is let go on every queue, not only on the one sent into
            self._prune(each)
        q.unacked.append(msg)
        self._copier.submit(d, q, msg)  # the copy into the ring runs beside the next op (§5.2)
        self.sent[d.link] = self.sent.get(d.link, 0) + 1

    def _push_locked(self, d: Direction, q: DelegateQueue, msg: framing.Message) -> None:
        with self._lock:
            if not self._closed:
                self._push(d, q, msg)

    def _push(self, d: Direction, q: DelegateQueue, msg: framing.Message) -> None:
        segs, total = framing.layout(msg.head, msg.tensors)
        cut = msg.piece_bytes
        pieces = framing.pieces_of(total, cut)
        ring, path = q.ring, self.staging_path
        for p in range(pieces):
            a, b = p * cut, min(total, (p + 1) * cut)
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    with path.sending(msg.ready), \
                            path.writing(ring, b - a, make_tag(msg.seq, pieces, p), SLICE_S) as (view, spans):
                        framing.copy_range(segs, a, b, view, True, spans)
                    break
                except TimeoutError:
                    if self._check_alive(d, q, f"{msg.what} waited for a free staging slot"):
                        return  # the restart pushed every unacknowledged message, this one included
                    self._refuse_if_peer_closed(d, q, msg.what)
                    if time.monotonic() > deadline:
                        raise TransportTimeout(
                            f"rank {self.rank}: {msg.what} timed out after {self.timeout_s:g} s waiting for a free "
                            f"staging slot (the sender delegate is not draining ring {ring.name})") from None

    def _refuse_if_peer_closed(self, d: Direction, q: DelegateQueue, what: str, n: int = 1) -> None:
        end = d.peer_end(q)
        if end is not None:
            raise TransportError(f"rank {self.rank}: {what} cannot be delivered: {self._peer_ended(d, end)} "
                                 f"({n} messages unacknowledged)")

    def _peer_ended(self, d: Direction, end: str) -> str:
        stage = peer_of(self.stage_id, d.kind, d.sending)
        if end == "gone":
            return f"rank {self.stage_ranks[stage]} (stage {stage}) died"
        return f"stage {stage} closed its end of link {d.link} first"

    def _prune(self, q: DelegateQueue) -> None:
        done = q.acked.value
        while q.unacked and q.unacked[0].seq <= done:
            q.unacked.popleft()

    def wait_sends(self) -> None:
        """Wait until the peer ranks' receive rings hold every message sent so far (restarting dead delegates)."""
        self._copier.drain(self.timeout_s)
        for d in list(self._dirs.values()):
            if not d.sending:
                continue
            for q in d.queues:
                deadline = time.monotonic() + self.timeout_s
                last = time.monotonic()
                while True:
                    with self._lock:
                        self._prune(q)
                        if not q.unacked:
                            break
                    now = time.monotonic()
                    if now - last > SLICE_S:
                        last = now
                        self._health(f"{q.unacked[0].what} waited to be delivered")
                        with self._lock:
                            if q.unacked:
                                self._refuse_if_peer_closed(d, q, q.unacked[0].what, len(q.unacked))
                    if now > deadline:
                        raise TransportTimeout(
                            f"rank {self.rank}: timed out after {self.timeout_s:g} s waiting for "
                            f"{q.unacked[0].what} to be received ({len(q.unacked)} messages unacknowledged)")
                    time.sleep(0.0002)
