"""The receive side of a delegated transport: messages out of the staging rings, in sequence order.

Receiver delegates fill this rank's receive rings ahead of need. Messages of a direction are taken in
sequence order, which is round-robin over its queues (``Direction.queue_for``); a message for another
(kind, mb) than the one asked for is stashed for its ``recv``, and a piece seen before (re-sent after a
delegate restart) is dropped by (message seq, piece). A receive posted ahead (``post_recv``) lets the
direction's prefetch thread copy the message out of its ring as soon as it arrives, while the training
thread computes; it copies only messages posted ahead, so it is idle at an iteration boundary. One
thread at a time takes pieces of a direction (the ``busy`` flag under the direction's condition); its
waits on a ring run outside every lock.
"""
from __future__ import annotations

import threading
import time

import torch

from ..header import decode_header
from ..protocol import TransportError, TransportTimeout
from . import framing
from .delegate_proc import SLICE_S, split_tag
from .directions import DelegateQueue, Direction


class Receiving:
    """Part of ``DelegatedTransport``: its receive side."""

    def post_recv(self, kind: str, mb: int) -> None:
        """Receiver delegates fill the rings ahead of need; posting the receive also lets the
        direction's prefetch thread copy the message out of its ring as soon as it is in."""
        d = self._direction(kind, False)
        with d.cv:
            self._announce(d, (kind, mb))
            if d.prefetcher is None and not self._closed:
                d.prefetcher = threading.Thread(target=self._prefetch_loop, args=(d,), daemon=True,
                                                name=f"rank {self.rank} link {d.link} {d.kind} prefetch")
                d.prefetcher.start()

    @staticmethod
    def _announce(d: Direction, key: tuple) -> None:
        """Count message ``key`` as expected (once until it is returned); caller holds ``d.cv``."""
        if key not in d.posted:
            d.posted[key] = None
            d.announced += 1
            d.cv.notify_all()

    def _prefetch_loop(self, d: Direction) -> None:
        """Assemble posted messages into the stash as they arrive (off the training thread)."""
        while True:
            with d.cv:
                while not self._closed and d.error is None and (d.busy or d.next_seq >= d.announced):
                    d.cv.wait(SLICE_S)
                if self._closed or d.error is not None:
                    return
                d.busy = True
                kind, mb = next(iter(d.posted), (d.kind, -1))
            try:
                self._take_piece(d, d.queue_for(d.next_seq), self._describe(kind, mb, False))
            except BaseException as e:  # noqa: BLE001  (raised by the next recv)
                with d.cv:
                    d.error = e
            finally:
                with d.cv:
                    d.busy = False
                    d.cv.notify_all()

    def recv(self, kind: str, mb: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Wait for message (kind, mb); other messages that arrive first are stashed for their recv."""
        d = self._direction(kind, False)
        key = (kind, mb)
        what = self._describe(kind, mb, False)
        deadline = time.monotonic() + self.timeout_s
        while True:
            with d.cv:
                self._announce(d, key)
                while d.error is None and key not in d.stash and d.busy:
                    d.cv.wait(SLICE_S)  # the prefetcher is taking a piece: perhaps this message's
                    if time.monotonic() > deadline:
                        break
                if d.error is not None:
                    raise d.error
                if key in d.stash:
                    bare, tensors, ready = d.stash.pop(key)
                    del d.posted[key]
                    break
                if time.monotonic() > deadline:
                    raise TransportTimeout(
                        f"rank {self.rank}: timed out after {self.timeout_s:g} s waiting for {what} "
                        f"(next message {d.next_seq} is due in queue {d.queue_for(d.next_seq).index})")
                d.busy = True
            try:
                self._take_piece(d, d.queue_for(d.next_seq), what)
            finally:
                with d.cv:
                    d.busy = False
                    d.cv.notify_all()
        tensors = self.staging_path.hand_over(tensors, ready)  # CUDA: this stream waits for the copies
        return tensors[0] if bare else tuple(tensors)

    def _take_piece(self, d: Direction, q: DelegateQueue, what: str) -> bool:
        """Consume one piece from queue ``q`` (old rings of a dead delegate first); False if none came.
        A message is stashed for its ``recv`` only once every copy of its last piece is enqueued."""
        path = self.staging_path
        with path.receiving():
            while q.old_rings:
                got = q.old_rings[0].try_pop()
                if got is None:
                    q.old_rings.pop(0).close()
                    continue
                self._stash(d, self._piece(d, got[0], got[1], what))
                return True
            try:
                with path.reading(q.ring, SLICE_S) as (view, tag, spans):
                    done = self._piece(d, view, tag, what, spans)
            except TimeoutError:
                self._health(f"{what} waited for a message")
                end = d.peer_end(q)
                if end is not None and q.ring.occupancy() == 0:
                    raise TransportError(f"rank {self.rank}: {what} cannot arrive: {self._peer_ended(d, end)}") from None
                return False
            self._stash(d, done)
            return True

    def _stash(self, d: Direction, done: tuple | None) -> None:
        if done is not None:
            key, bare, tensors = done
            d.stash[key] = (bare, tensors, self.staging_path.received())

    def _piece(self, d: Direction, view: torch.Tensor, tag: int, what: str, spans: list | None = None):
        """Take one piece into the message being assembled; returns (key, bare, tensors) once it is complete."""
        seq, _, piece = split_tag(tag)
        if seq < d.next_seq:
            d.duplicates += 1
            return None  # a duplicate re-sent after a delegate restart
        if seq > d.next_seq:
            raise TransportError(f"rank {self.rank}: {what}: message {seq} arrived while message {d.next_seq} "
                                 f"was due on link {d.link} (a message was lost)")
        flat = view.reshape(-1).view(torch.uint8) if view.numel() else view.reshape(-1)
        part = d.partial
        if piece == 0:  # (again, if a delegate died in the middle of a message)
            (magic, hseq, kind, mb, total, npieces, cut), meta = framing.read_head(flat)
            if magic != framing.MAGIC or hseq != seq or cut < 1 or npieces != framing.pieces_of(total, cut):
                raise TransportError(f"rank {self.rank}: {what}: corrupt header in link {d.link} message {seq}")
            bare, metas = decode_header(meta)
            dev = self.staging_path.recv_device
            tensors = [torch.empty(shape, dtype=dtype, device=dev) for dtype, shape in metas]
            segs, _ = framing.tensor_segments(tensors)
            part = d.partial = dict(seq=seq, next=0, pieces=npieces, cut=cut, total=total, segs=segs,
                                    key=(kind, mb), bare=bare, tensors=tensors)
        elif part is None or part["seq"] != seq or piece < part["next"]:
            d.duplicates += 1
            return None  # a duplicate piece
        if piece != part["next"]:
            raise TransportError(f"rank {self.rank}: {what}: piece {piece} of link {d.link} message {seq} "
                                 f"arrived while piece {part['next']} was due")
        a = piece * part["cut"]
        framing.copy_range(part["segs"], a, a + flat.numel(), flat, False, spans)
        part["next"] = piece + 1
        if part["next"] < part["pieces"]:
            return None
        d.partial = None
        d.next_seq += 1
        return part["key"], part["bare"], part["tensors"]
