"""``DirectTransport``: messages go straight through torch.distributed (gloo or NCCL) in the training process.

Each tensor of a message is its own non-blocking point-to-point message (``isend``/``irecv``), preceded
by the layout header (``header``) whenever the receiver cannot know the layout yet, all tagged with
(kind, micro-batch, part) so that sends and receives issued in any order match. A send returns
without waiting for its receiver (completion is waited for once per iteration, in ``wait_sends``),
unless ``send_window`` messages to that peer are not known received yet; receives wait with the
transport's timeout. The contract is ``protocol.Transport``'s.

The messages go through a point-to-point layer (``P2P``: ``isend``/``irecv`` returning works):
``TorchP2P`` is torch.distributed's. A layer with ``in_order`` set (NCCL, or a test double with its
rules: ``ds_pipemorph.inject.nccl_double``) ignores tags and runs a pair of ranks' operations in
the order they were issued; there ``post_recv`` waits for the header at once and posts the tensors
right behind it, so that header and tensors keep their place in the pair's order (``post_recv``),
and the sends and receives between ``begin_group`` and ``end_group`` go out as one group
(``P2P.batch``: ``torch.distributed.batch_isend_irecv``), as DeepSpeed's own p2p issues a send and a
receive with one peer.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Protocol, Sequence, Union

import torch
import torch.distributed as dist

from ...fileio import first_line
from ...plan.ir.ops import Kind, message_op
from .header import HEADER_INTS, decode_header, encode_header, tag
from .protocol import TransportError, TransportTimeout, link_of, peer_of

# A wait that failed after this share of the timeout timed out (backends wake a little early or late).
TIMEOUT_REACHED = 0.95


class P2P(Protocol):
    """Non-blocking point-to-point operations of one rank (``TorchP2P``, or a test double).

    ``isend``/``irecv`` return a work with ``wait(timeout: timedelta) -> bool | None`` (False or a
    raised ``RuntimeError`` when it did not complete; a ``TransportError`` is passed on as it is)
    and ``is_completed()``. ``in_order``: tags are ignored and every operation with one peer, both
    directions, runs in issue order, a send completing only with its receive (NCCL's rules)."""

    in_order: bool

    def isend(self, tensor: torch.Tensor, dst: int, tag: int): ...

    def irecv(self, tensor: torch.Tensor, src: int, tag: int): ...

    def batch(self, ops: Sequence[tuple[bool, torch.Tensor, int, int]]) -> list:
        """Issue ``ops`` (sending?, tensor, peer, tag) as one group: one work per op, in order, or one
        work for the whole group (a coalescing backend: NCCL)."""

    def close(self) -> None: ...


class TorchP2P:
    """torch.distributed's point-to-point operations on the default group; in order under NCCL.

    ``isend``/``irecv`` call the default group's ``send``/``recv`` as ``dist.isend``/``dist.irecv``
    end up doing, without their checks of arguments this class already knows (the group, global
    ranks = its ranks, one dense tensor): on a busy host those checks cost more than the call."""

    def __init__(self):
        self.in_order = dist.is_initialized() and "nccl" in dist.get_backend()
        self._group = None  # the default group, looked up at the first message

    def _world(self):
        self._group = dist.group.WORLD
        return self._group

    def isend(self, tensor: torch.Tensor, dst: int, tag: int):
        if tensor.is_complex():
            tensor = torch.view_as_real(tensor)
        return (self._group or self._world()).send([tensor], dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int):
        if tensor.is_complex():
            tensor = torch.view_as_real(tensor)
        return (self._group or self._world()).recv([tensor], src, tag)

    def batch(self, ops: Sequence[tuple[bool, torch.Tensor, int, int]]) -> list:
        """One ``batch_isend_irecv`` (NCCL: one ncclGroupStart/End; the engine's collectives at start-up
        came first, as torch asks of a group's first batch)."""
        return dist.batch_isend_irecv([dist.P2POp(dist.isend if sending else dist.irecv, t, peer, tag=tag)
                                       for sending, t, peer, tag in ops])

    def close(self) -> None:
        pass


class _Grouped:
    """The work of a send or receive in an open group: set when the group is issued (``_flush``)."""

    __slots__ = ("work",)

    def __init__(self):
        self.work = None

    def is_completed(self) -> bool:
        return self.work is not None and self.work.is_completed()


class _Failed:
    """The work of an operation whose group could not be issued: waiting for it raises the group's error."""

    def __init__(self, error: TransportError):
        self.error = error

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout=None):
        raise self.error


@dataclass
class _Pending:
    work: object
    keep: object  # tensors that must stay alive until the work completes
    kind: str
    mb: int  # the message: its op ("SEND_F3 on link 1 to stage 2") is named only if it fails
    last: bool = False  # the message's last work: one per message in a peer's queue


def _shapes(layout: tuple) -> list:
    """A sent layout's tensors as [(dtype, [shape...]), ...] (for messages)."""
    return [(dtype, list(shape)) for dtype, shape in layout[1]]


def wait_work(work, timeout_s: float, rank: int, what: str) -> None:
    """Wait at most ``timeout_s`` for a torch.distributed work; TransportTimeout or TransportError,
    one sentence naming ``what``, instead of a wait that never ends."""
    start = time.monotonic()
    try:
        ok = work.wait(timedelta(seconds=timeout_s))
    except TransportError:  # a point-to-point layer's own sentence (test doubles)
        raise
    except RuntimeError as e:
        # A backend's timeout is a plain RuntimeError (gloo) or one of torch's DistError types:
        # what makes it a timeout is that the whole timeout went by, not the words of its text.
        if time.monotonic() - start >= TIMEOUT_REACHED * timeout_s:
            raise TransportTimeout(f"rank {rank}: timed out after {timeout_s:g} s waiting for {what}") from None
        raise TransportError(f"rank {rank}: {what} failed: {first_line(e)}") from e
    if ok is False:
        raise TransportTimeout(f"rank {rank}: timed out after {timeout_s:g} s waiting for {what}")


def _dense(t: torch.Tensor) -> torch.Tensor:
    """What goes on the wire for ``t``: detached (the send must not hold its graph), contiguous."""
    t = t.detach()
    return t if t.is_contiguous() else t.contiguous()


# The pending sends to one peer are checked for completed works (whose tensors can then be freed)
# once a few are queued, not at every send. (A gloo send's work reports completion only once waited
# for, so on gloo the tensors are kept until ``wait_sends``; on NCCL they go as they complete.)
REAP_AFTER = 4


def _reap(sends: deque) -> None:
    """Forget the sends to one peer that it has received, from the front (they complete in the order
    sent, mostly), so that their tensors can be freed before ``wait_sends``."""
    while sends and sends[0].work.is_completed():
        sends.popleft()


class DirectTransport:
    """Messages go straight through torch.distributed (gloo or NCCL) in the training process.

    ``stage_ranks[s]`` is the global rank of stage ``s`` in this process's pipeline. With
    ``static_shapes`` (DeepSpeed's ``dynamic_shape=False``) the layout of message (kind, mb) is
    exchanged once and later receives are posted with their buffers ahead of time; a send whose
    layout changed is refused naming the op. Without it every message carries its header.

    ``send_window``: where a send completes only when waited for (gloo), how many messages to one
    peer may be sent and not known received before a send, once issued, waits for the oldest; each
    holds its tensors until then, so the window bounds that memory. It applies to the kinds
    ``bound_sends`` names. None: no bound (the tensors of an iteration's sends are then kept until
    ``wait_sends``). Under NCCL's rules a send's tensors go as its work completes, and no send waits.
    """

    def __init__(self, rank: int, stage_id: int, stage_ranks: Sequence[int], timeout_s: float = 300.0,
                 device: Optional[torch.device] = None, static_shapes: bool = True, p2p: Optional[P2P] = None,
                 send_window: Optional[int] = None):
        self.rank, self.stage_id = rank, stage_id
        if send_window is not None and send_window < 1:
            raise ValueError(f"send_window must be at least 1 (or None), not {send_window}")
        self.send_window = send_window
        self._bounded: frozenset[Kind] = frozenset()  # kinds whose sends the window bounds (``bound_sends``)
        self.sends_waited = 0  # sends the window made wait for an earlier message
        self.p2p = p2p or TorchP2P()
        self.stage_ranks = list(stage_ranks)
        self.timeout_s = float(timeout_s)
        self.device = device or torch.device("cpu")
        self.static_shapes = static_shapes
        # Whether a send holds the training process while its message crosses a slow link, the link
        # model the control loop plans with (``plan.ir.links``). Gloo's isend hands the bytes to gloo's
        # own thread: the process goes on, and the messages of a link queue on its wire one after the
        # other (one FIFO). NCCL's send runs on the GPU's stream until its peer has received it.
        self.sender_waits = self.p2p.in_order or not (dist.is_initialized() and dist.get_backend() == "gloo")
        self._sends: dict[int, deque[_Pending]] = {}  # per destination rank, in the order sent
        self._names: dict[tuple[str, int, bool], str] = {}  # (kind, mb, sending) -> "SEND_F3 on link 1 to stage 2"
        self._sends_lock = threading.Lock()  # wrappers (delay injection) may send from their own thread
        self._posted: dict[tuple[str, int], tuple] = {}  # (kind, mb) -> ("header"|"data", ...)
        self._sent_layout: dict[tuple[str, int], tuple] = {}  # what this rank told its peer
        self._recv_layout: dict[tuple[str, int], tuple] = {}  # what the peer told this rank
        self._group: Optional[list] = None  # between begin_group and end_group: (op, _Grouped) not issued yet

    def sender_waits_on(self, link: int) -> bool:
        """Whether a send on ``link`` holds the training process: ``sender_waits``, alike on every link."""
        return self.sender_waits

    def with_p2p(self, p2p: P2P) -> "DirectTransport":
        """A new direct path like this one (nothing sent yet) whose messages go through ``p2p``."""
        path = DirectTransport(self.rank, self.stage_id, self.stage_ranks, self.timeout_s, self.device,
                               self.static_shapes, p2p, self.send_window)
        path.bound_sends(self._bounded)
        return path

    def bound_sends(self, kinds) -> None:
        """Apply ``send_window`` to the sends of ``kinds`` (``Kind.F``: activations, ``Kind.B``: input
        gradients). Waiting for an earlier message can deadlock where the peer is itself waiting for
        this rank: the engine names only kinds its peer receives in the order sent, and only where a
        dry run of every stage's stream with the window finds no deadlock (``runtime.plans.window_kinds``).
        ``close`` and the other paths never wait for these sends."""
        self._bounded = frozenset(kinds)

    # -- naming -------------------------------------------------------------------------------
    def _peer(self, kind: str, sending: bool) -> int:
        """Stage at the other end: activations flow down, input gradients flow up."""
        return peer_of(self.stage_id, kind, sending)

    def _describe(self, kind: str, mb: int, sending: bool) -> str:
        name = self._names.get((kind, mb, sending))
        if name is None:
            prep = "to" if sending else "from"
            name = self._names[(kind, mb, sending)] = (
                f"{message_op(kind, mb, sending)} on link {link_of(self.stage_id, kind, sending)} {prep} "
                f"stage {self._peer(kind, sending)}")
        return name

    def _broken(self, what: str, e: RuntimeError) -> TransportError:
        """A broken link (peer crashed, connection closed) as one sentence naming the op."""
        return TransportError(f"rank {self.rank}: {what} failed: {first_line(e)}")

    def _isend(self, tensor: torch.Tensor, dst: int, wire_tag: int):
        if self._group is None:
            return self.p2p.isend(tensor, dst, wire_tag)
        return self._later((True, tensor, dst, wire_tag))

    def _irecv(self, tensor: torch.Tensor, src: int, wire_tag: int):
        if self._group is None:
            return self.p2p.irecv(tensor, src, wire_tag)
        return self._later((False, tensor, src, wire_tag))

    def _later(self, op: tuple) -> _Grouped:
        work = _Grouped()
        self._group.append((op, work))
        return work

    def _flush(self) -> None:
        """Issue the ops of the open group collected so far (the group stays open). A backend that
        coalesces the group (NCCL) returns one work for all of it: each op then waits for the whole
        group, as on NCCL's stream the ops issued before it complete first anyway. If the group cannot
        be issued, every op of it fails with that error."""
        if not self._group:
            return
        group, self._group = self._group, []
        what = f"a group of {len(group)} sends and receives with rank(s) {sorted({op[2] for op, _ in group})}"
        try:
            issued = list(self.p2p.batch([op for op, _ in group]))
            if len(issued) == 1 < len(group):
                issued *= len(group)
            if len(issued) != len(group):
                raise TransportError(f"rank {self.rank}: {what}: the point-to-point layer returned "
                                     f"{len(issued)} works for {len(group)} operations")
        except RuntimeError as e:  # TransportError included
            err = e if isinstance(e, TransportError) else TransportError(
                f"rank {self.rank}: {what} failed: {first_line(e)}")
            for _, work in group:
                work.work = _Failed(err)
            if err is e:
                raise
            raise err from e
        for (_, work), w in zip(group, issued):
            work.work = w

    def begin_group(self) -> None:
        """Under NCCL's rules, collect the sends and receives until ``end_group`` into one group; a
        wait in between (a receive's header) issues what was collected first."""
        if self.p2p.in_order:
            self._flush()
            self._group = []

    def end_group(self) -> None:
        if self._group is not None:
            try:
                self._flush()
            finally:
                self._group = None

    def _wait(self, work, what: str) -> None:
        if isinstance(work, _Grouped):
            if work.work is None:
                self._flush()
            if work.work is None:  # its group was dropped (``close``) before it was issued
                raise TransportError(f"rank {self.rank}: {what} was never issued")
            work = work.work
        wait_work(work, self.timeout_s, self.rank, what)

    # -- interface ----------------------------------------------------------------------------
    def post_recv(self, kind: str, mb: int) -> None:
        """Post the receive of message (kind, mb) ahead of time (idempotent).

        With static shapes and a known layout for (kind, mb), the tensors' receives are posted
        at once; otherwise the header's receive is, and the tensors' once the header is in.

        In order (``P2P.in_order``: NCCL's rules) this waits for the header here and posts the
        tensors right behind it, at the receive's place in the stream: posted at the consumer, they
        would queue behind this rank's sends to the same peer issued in between, while the sender
        issued header and tensors back to back, and the pair would deadlock. Waiting here cannot
        deadlock with ``plan.ir.nccl_lowering``'s streams: both ranks of a pair issue its messages in
        one order, that of a unit-time run of the plan, and a receive sits right before its consumer
        or right after the producer of a later message of the pair. Every op the sender runs before
        producing this message ran at an earlier step of that run, so the messages it needs from this
        rank were produced by ops this rank has already run, their sends are issued, and every earlier
        message of the pair was issued on both sides: the header's send reaches the head of the
        sender's queue with this receive at the head of ours. (The NCCL double runs these streams,
        tests/runtime/test_nccl_double.py.)
        """
        key = (kind, mb)
        if key in self._posted:
            return
        src = self.stage_ranks[self._peer(kind, sending=False)]
        layout = self._recv_layout.get(key) if self.static_shapes else None
        if layout is None:
            head = torch.empty(HEADER_INTS, dtype=torch.int64, device=self.device)
            try:
                work = self._irecv(head, src, tag(kind, mb, 0))
            except RuntimeError as e:
                raise self._broken(self._describe(kind, mb, sending=False), e) from e
            if not self.p2p.in_order:
                self._posted[key] = ("header", work, head)
                return
            self._wait(work, self._describe(kind, mb, sending=False))
            layout = self._recv_layout[key] = decode_header(head)
        try:
            self._posted[key] = ("data", *self._post_tensors(kind, mb, src, layout))
        except RuntimeError as e:
            raise self._broken(self._describe(kind, mb, sending=False), e) from e

    def _post_tensors(self, kind: str, mb: int, src: int, layout) -> tuple[list, list]:
        _, metas = layout
        bufs, works = [], []
        for part, (dtype, shape) in enumerate(metas, start=1):
            t = torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype, device=self.device)
            works.append(self._irecv(t, src, tag(kind, mb, part)))
            bufs.append(t)
        return works, bufs

    def send(self, kind: str, mb: int, payload: Union[torch.Tensor, Sequence[torch.Tensor]]) -> None:
        """Post message (kind, mb) without waiting for the receiver.

        ``payload`` is a tensor or a tuple of tensors; the receiver gets the same structure. The
        header (layout) travels with the first message of each (kind, micro-batch), and with
        every message when shapes are dynamic.
        """
        with self._sends_lock:
            older = self._send(kind, mb, payload)
        for p in older:  # outside the lock: a send of another thread (a delay lane) is not held by it
            try:
                self._wait(p.work, self._describe(p.kind, p.mb, True) + " to be received")
            except TransportError as e:
                raise EarlierSendFailed(f"rank {self.rank}: {self._describe(p.kind, p.mb, True)}, waited for after "
                                        f"{self._describe(kind, mb, True)} (send window), failed: {e}") from e

    def _send(self, kind: str, mb: int, payload) -> list:
        """Issue message (kind, mb); returns the works of older messages to wait for (``send_window``)."""
        dst = self.stage_ranks[self._peer(kind, sending=True)]
        sends = self._sends.get(dst)
        if sends is None:
            sends = self._sends[dst] = deque()
        if len(sends) >= REAP_AFTER:
            _reap(sends)
        bare = isinstance(payload, torch.Tensor)
        tensors = [_dense(t) for t in ([payload] if bare else payload)]
        layout = (bare, [(t.dtype, t.shape) for t in tensors])
        known = self._sent_layout.get((kind, mb)) if self.static_shapes else None
        if known is not None and known != layout:
            raise TransportError(
                f"rank {self.rank}: {self._describe(kind, mb, True)} changed its tensors from {_shapes(known)} to "
                f"{_shapes(layout)}; build the PipelineModule with dynamic_shape=True or call "
                f"engine.reset_activation_shape() on every rank")
        try:
            if known is None:
                head = encode_header(tensors, bare).to(self.device)
                sends.append(_Pending(self._isend(head, dst, tag(kind, mb, 0)), head, kind, mb))
                self._sent_layout[(kind, mb)] = layout
            for part, t in enumerate(tensors, start=1):
                wire = t.to(torch.uint8) if t.dtype == torch.bool else t  # gloo has no bool
                sends.append(_Pending(self._isend(wire, dst, tag(kind, mb, part)), wire, kind, mb,
                                      last=part == len(tensors)))
        except RuntimeError as e:
            raise self._broken(self._describe(kind, mb, True), e) from e
        if self.send_window is not None and kind in self._bounded and not self.p2p.in_order:
            return self._beyond_window(sends)
        return []

    def _beyond_window(self, sends: deque) -> list:
        """Take the oldest messages to one peer off its queue until at most ``send_window`` are not known
        received: their works, for the caller to wait for."""
        if sum(p.last for p in sends) <= self.send_window:
            return []
        _reap(sends)
        out = []
        while sum(p.last for p in sends) > self.send_window:
            self.sends_waited += 1
            while True:
                p = sends.popleft()
                out.append(p)
                if p.last:
                    break
        return out

    def recv(self, kind: str, mb: int) -> Union[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Wait for message (kind, mb); its tensors are freshly allocated, never shared buffers."""
        self.post_recv(kind, mb)
        key = (kind, mb)
        posted = self._posted.pop(key)
        what = self._describe(kind, mb, sending=False)
        if posted[0] == "header":
            _, work, head = posted
            self._wait(work, what)
            layout = decode_header(head)
            self._recv_layout[key] = layout
            try:
                works, bufs = self._post_tensors(kind, mb, self.stage_ranks[self._peer(kind, sending=False)], layout)
            except RuntimeError as e:
                raise self._broken(what, e) from e
        else:
            _, works, bufs = posted
            layout = self._recv_layout[key]
        for w in works:
            self._wait(w, what)
        bare, metas = layout
        out = [t.bool() if dtype == torch.bool else t for t, (dtype, _) in zip(bufs, metas)]
        return out[0] if bare else tuple(out)

    def wait_sends(self) -> None:
        """Wait until the peers have received every message sent so far."""
        with self._sends_lock:
            pending, self._sends = self._sends, {}
        for sends in pending.values():
            for p in sends:
                self._wait(p.work, self._describe(p.kind, p.mb, True) + " to be received")

    def close(self) -> None:
        """Drop pending state (after an error, or at shutdown); no waiting."""
        with self._sends_lock:
            self._sends = {}
        self._posted.clear()
        self._group = None
        self.p2p.close()

    def reset_shapes(self) -> None:
        """Forget the known layouts (every rank at once, between iterations): headers travel again."""
        if self._posted:
            raise TransportError(f"rank {self.rank}: cannot reset shapes while receives are posted")
        self._sent_layout.clear()
        self._recv_layout.clear()


class EarlierSendFailed(TransportError):
    """A send waiting for an earlier message to the same peer (``send_window``) saw that message fail.
    Its own message went out: failing over would send it twice, so the link is not failed over here
    (as a failure found by ``wait_sends`` is not)."""


def bound_sends(path, kinds) -> None:
    """``DirectTransport.bound_sends`` on the direct transport ``path`` is or wraps (wrappers keep the
    wrapped path as ``inner``: delay injection, test doubles); nothing if it holds none."""
    while path is not None and not isinstance(path, DirectTransport):
        path = getattr(path, "inner", None)
    if path is not None:
        path.bound_sends(kinds)
