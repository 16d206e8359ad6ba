"""Lowering: a compute plan (per-stage F/B/W orders) -> per-rank instruction streams with the
communication placed, and a dry run that proves the streams deadlock-free before any rank starts.

``LoweringPolicy`` is the one rule the engine, ``pipemorph simulate --lowered`` and ``pipemorph
export`` lower with (receive window, fused backward), so what the command line prints is what the
engine runs. One stage per rank. Where communication goes (``lower``):

- receives are posted ahead within a window (``recv_window``, default ``RECV_WINDOW``) or up
  front: each stage posts the receives it will need, RECV_F for each of its F (stages > 0) and
  RECV_B for each of its B (stages < S-1), each in the order the producing stage sends them. That is the order messages arrive on the
  channel, so the streams also run where messages between two ranks are matched in order
  (torch pipelining's untagged p2p); where they are matched by tag it changes nothing.
- a send follows its producer: SEND_F right after F (stages < S-1), SEND_B right after B
  (stages > 0), or after W for a fused backward (``fused_backward``: B m directly followed by W m,
  the input gradient leaves after the whole backward, as DeepSpeed's ``BackwardPass`` sends it).
- the wait for a received tensor is implied by the compute op that consumes it: F m waits for
  RECV_F m, B m for RECV_B m.

``dry_run`` executes the streams of all ranks symbolically under one of two semantics:
non-blocking sends (``isend``; what the runtime does): a send is issued at once and a consumer
waits until the matching send was issued; or blocking sends (``blocking_sends=True``, gloo's
``dist.send``): a send also waits until the peer has posted the matching receive. A deadlock is
reported naming each stuck stage, the op it waits at and what it needs, e.g.
``deadlock: stage 0 waits at 0SEND_F1 (needs 1RECV_F1), stage 1 waits at 1SEND_B0 (needs 0RECV_B0)``.
(torch's ``_simulate_comms_compute`` lets a receive proceed only once its send was issued, a
blocking receive; its runtime, like this project's, posts ``irecv`` and waits at the consumer,
which is what is modelled here. Streams with receives up front pass this dry run, not torch's.)

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Protocol, Sequence, Union

from .fused import fused_at
from .ops import PAYLOADS, Kind, Op, Schedule
from .text_enum import TextEnum

Stream = list[Op]  # one rank's ops, each with its stage (global form, ``2SEND_F5``)


class Dispatch(TextEnum):
    """How a stage runs its stream: ``ORDERED`` as written, ``READY`` the first ready op in it (RRFP).
    Equal to its text (``"ordered"``, ``"ready"``). The config's ``dispatch`` field is this type (read
    from the text once, there); functions that take a dispatch from a caller ``parse`` it once."""

    ORDERED = "ordered"
    READY = "ready"

    @classmethod
    def parse(cls, value: Union["Dispatch", str]) -> "Dispatch":
        """``value`` (a ``Dispatch`` or its text) as a ``Dispatch``; ValueError naming it otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"dispatch is 'ordered' or 'ready', not {value!r}") from None


DISPATCHES: tuple[Dispatch, ...] = tuple(Dispatch)

# Receives of each kind posted ahead of the ops that consume them. A posted receive holds its
# buffer, so the window bounds the receive memory (one message per kind) where posting every
# receive of the iteration would hold N; one ahead keeps a receive in place before its message
# arrives (a window of 2 measured no faster, `pipemorph paired zb+recv2 zb`, docs/memory.md).
RECV_WINDOW = 1


class BadStream(ValueError):
    """The streams are malformed: a receive posted twice, a tensor used before its receive is
    posted, a send without its receive, messages that do not match in order."""


class Deadlock(BadStream):
    """Every unfinished rank waits on another one."""


def lower(schedule: Schedule, *, fused_backward: bool = False, recv_window: Optional[int] = None) -> list[Stream]:
    """Per-rank instruction streams of ``schedule`` (one stage per rank), as the module says.

    ``recv_window``: None posts every receive of the iteration up front; k >= 1 posts the first k
    receives of each kind (RECV_F, RECV_B) up front and, after each op that consumed one, the next
    ones while fewer than k of that kind are outstanding (a posted receive holds its buffer: k
    bounds that memory). Receives keep the producers' order, so an op that consumes out of that
    order first posts every receive up to its own (the window then stretches for it).
    """
    if recv_window is not None and recv_window < 1:
        raise ValueError(f"recv_window must be None or >= 1, got {recv_window}")
    S = len(schedule)
    out: list[Stream] = []
    for s, row in enumerate(schedule):
        pending = {  # receives not posted yet, in the order the neighbours send them
            Kind.F: [Op(Kind.RECV_F, op.mb, s) for op in schedule[s - 1] if op.kind is Kind.F] if s > 0 else [],
            Kind.B: [Op(Kind.RECV_B, op.mb, s) for op in schedule[s + 1] if op.kind is Kind.B] if s < S - 1 else [],
        }
        window = {kind: len(pending[kind]) if recv_window is None else recv_window for kind in pending}
        outstanding = dict.fromkeys(PAYLOADS, 0)  # posted, not consumed yet

        def post(kind: Kind, upto: Optional[int] = None) -> None:
            """Post the next receives of ``kind``: through micro-batch ``upto``, else up to the window."""
            while pending[kind] and (upto is not None or outstanding[kind] < window[kind]):
                recv = pending[kind].pop(0)
                stream.append(recv)
                outstanding[kind] += 1
                if recv.mb == upto:
                    return

        stream: Stream = []
        post(Kind.F)
        post(Kind.B)
        for i, op in enumerate(row):
            consumes = consumes_message(op, s, S)
            if consumes and any(r.mb == op.mb for r in pending[op.kind]):
                post(op.kind, upto=op.mb)
            stream.append(op.at(s))
            if op.kind is Kind.F and s < S - 1:
                stream.append(Op(Kind.SEND_F, op.mb, s))
            elif s > 0 and sends_gradient(row, i, fused_backward):
                stream.append(Op(Kind.SEND_B, op.mb, s))
            if consumes:
                outstanding[op.kind] -= 1
                post(op.kind)
        out.append(stream)
    return out


class Lowering(Protocol):
    """What the engine, ``simulate --lowered`` and ``export`` lower a plan with: ``LoweringPolicy``
    (gloo and the delegates: messages matched by tag) or ``nccl_lowering.NcclLowering`` (NCCL's
    in-order point-to-point)."""

    fused: bool

    def for_dispatch(self, dispatch: Dispatch) -> "Lowering":
        """The lowering ``dispatch`` runs; ValueError for a dispatch it cannot run."""

    def lower(self, schedule: Schedule) -> list[Stream]:
        """Per-rank streams of ``schedule``, dry-run; BadStream if they cannot run."""

    def lines(self, schedule: Schedule) -> list[str]:
        """``format_streams(lower(schedule))``."""


@dataclass(frozen=True)
class LoweringPolicy:
    """How a compute plan becomes per-rank streams: receives posted ``recv_window`` ahead per kind
    (None: every receive of the iteration up front), each send right after its producer, and
    ``fused``: a B m directly followed by W m is one backward whose input gradient leaves after W.

    A plan file names both (``recv_window``, ``backward``; ``PlanFile.lowering``); plans the engine
    builds itself take the defaults. Ready dispatch lowers with every receive up front
    (``for_dispatch``): a completed receive is what makes an op ready, and a receive not posted
    cannot complete.

    >>> LoweringPolicy(recv_window=1).lines([[Op("F", 0), Op("B", 0), Op("W", 0)],
    ...                                      [Op("F", 0), Op("B", 0), Op("W", 0)]])
    ['0RECV_B0 0F0 0SEND_F0 0B0 0W0', '1RECV_F0 1F0 1B0 1SEND_B0 1W0']
    """

    recv_window: Optional[int] = RECV_WINDOW
    fused: bool = False

    def __post_init__(self):
        if self.recv_window is not None and self.recv_window < 1:
            raise ValueError(f"recv_window must be None or >= 1, got {self.recv_window}")

    def for_dispatch(self, dispatch: Dispatch) -> "LoweringPolicy":
        """The policy a dispatch runs: ``ordered`` this one, ``ready`` every receive up front."""
        return self if Dispatch.parse(dispatch) is Dispatch.ORDERED else replace(self, recv_window=None)

    def lower(self, schedule: Schedule) -> list[Stream]:
        """The streams of ``schedule`` after a dry run with non-blocking sends and messages matched
        in order (what the engine and torch pipelining both run); raises BadStream otherwise."""
        streams = lower(schedule, fused_backward=self.fused, recv_window=self.recv_window)
        dry_run(streams, ordered_channels=True)
        return streams

    def lines(self, schedule: Schedule) -> list[str]:
        """``format_streams`` of ``lower(schedule)``: one line per rank, ``0F0 0SEND_F0 ...``."""
        return format_streams(self.lower(schedule))


def consumes_message(op: Op, s: int, S: int) -> bool:
    """Whether ``op`` on stage ``s`` consumes a received tensor (F below the first stage, B above the last)."""
    return op.kind is Kind.F and s > 0 or op.kind is Kind.B and s < S - 1


def sends_gradient(row: Sequence[Op], i: int, fused: bool) -> bool:
    """Whether the input gradient leaves right after ``row[i]``: after B, or after the W that
    directly follows its B in a fused backward (``fused.fused_at``)."""
    op = row[i]
    if op.kind is Kind.B:
        return not (fused and fused_at(row, i))
    return fused and op.kind is Kind.W and i > 0 and fused_at(row, i - 1)


def format_streams(streams: list[Stream]) -> list[str]:
    """One line per rank: ``0F0 0SEND_F0 0F1 ...``."""
    return [" ".join(str(op) for op in stream) for stream in streams]


# What a message is: (its payload Kind.F | Kind.B, micro-batch, sending stage, receiving stage).
def _message(op: Op) -> tuple[Kind, int, int, int]:
    kind = op.kind.payload
    if op.kind.is_send:
        return kind, op.mb, op.stage, op.peer
    return kind, op.mb, op.peer, op.stage


def dry_run(streams: list[Stream], *, blocking_sends: bool = False, ordered_channels: bool = False) -> None:
    """Run ``streams`` symbolically; return None when every rank reaches its end, else raise
    ``Deadlock`` (each stuck stage, its op and what it needs) or ``BadStream``.

    ``ordered_channels``: messages from one rank to another are matched in order (the k-th
    receive gets the k-th send), as in untagged p2p; the dry run then also checks that the k-th
    receive is the message the k-th send carries. Otherwise messages are matched by tag (kind and
    micro-batch), as the runtime's transport does.
    """
    S = len(streams)
    for r, stream in enumerate(streams):
        for op in stream:
            if op.stage != r:
                raise BadStream(f"rank {r}: {op} belongs to stage {op.stage}; one stage per rank")
            if op.peer is not None and not 0 <= op.peer < S:
                raise BadStream(f"stage {r}: {op} talks to stage {op.peer}, which does not exist")
    ptr = [0] * S
    posted: set[tuple] = set()  # messages whose receive is posted
    sent: set[tuple] = set()  # messages whose send completed (issued, for non-blocking sends)
    channel_sends: dict[tuple[int, int], list[tuple]] = {}
    channel_recvs: dict[tuple[int, int], list[tuple]] = {}
    computed: set[Op] = set()
    waiting: dict[int, str] = {}
    progress = True
    while progress:
        progress = False
        for r in range(S):
            while ptr[r] < len(streams[r]):
                op = streams[r][ptr[r]]
                need = _blocked_on(op, r, S, posted, sent, computed, blocking_sends)
                if need is not None:
                    waiting[r] = f"stage {r} waits at {op} (needs {need})"
                    break
                waiting.pop(r, None)
                if op.is_compute:
                    computed.add(op)
                else:
                    msg = _message(op)
                    book, done = (channel_sends, sent) if op.kind.is_send else (channel_recvs, posted)
                    if msg in done:
                        raise BadStream(f"stage {r}: {op} appears twice in the iteration")
                    done.add(msg)
                    book.setdefault((msg[2], msg[3]), []).append(msg)
                ptr[r] += 1
                progress = True
    if waiting:
        raise Deadlock("deadlock: " + ", ".join(waiting[r] for r in sorted(waiting)))
    for msg in sorted(sent ^ posted, key=lambda m: (m[2], m[1], m[0])):
        kind, mb, src, dst = msg
        if msg in sent:
            raise BadStream(
                f"stage {src}: {Op(kind.send, mb, src)} has no receive: stage {dst} never posts {Op(kind.recv, mb, dst)}"
            )
        raise BadStream(f"stage {dst}: {Op(kind.recv, mb, dst)} is never sent: stage {src} has no {Op(kind.send, mb, src)}")
    if ordered_channels:
        for (src, dst), sends in sorted(channel_sends.items()):
            for k, (a, b) in enumerate(zip(sends, channel_recvs.get((src, dst), []))):
                if a != b:
                    raise BadStream(
                        f"stage {dst}: its receive #{k} from stage {src} is {Op(b[0].recv, b[1], dst)} but stage {src}"
                        f" sends {Op(a[0].send, a[1], src)} then (messages between two ranks are matched in order)"
                    )


def window_deadlock(streams: list[Stream], bounded: list, window: int) -> Optional[str]:
    """Run ``streams`` symbolically with a send window (``DirectTransport.send_window``): after rank r
    issues a message of a kind in ``bounded[r]``, it waits until at most ``window`` of its messages to
    that peer are not yet received. A message counts as received only when the op consuming it ran
    (the most waiting there can be: a receive whose layout is not known yet, as in a job's first
    iteration or with dynamic shapes, posts its tensors only then); a later receive can only shorten
    a wait. None when every rank reaches its end, else who waits where (one sentence)."""
    S = len(streams)
    ptr = [0] * S
    issued: set[tuple] = set()
    consumed: set[tuple] = set()
    queues: dict[tuple[int, int], list[tuple]] = {}  # (src, dst) -> messages not known received
    waits: list[Optional[tuple]] = [None] * S  # the message a rank waits for after a send
    progress = True
    while progress:
        progress = False
        for r in range(S):
            while True:
                if waits[r] is not None:
                    if waits[r] not in consumed:
                        break
                    waits[r] = None
                    progress = True
                if ptr[r] >= len(streams[r]):
                    break
                op = streams[r][ptr[r]]
                k = op.kind
                if k is Kind.F and r > 0 or k is Kind.B and r < S - 1:
                    msg = (k, op.mb, r - 1 if k is Kind.F else r + 1, r)
                    if msg not in issued:
                        break
                    consumed.add(msg)
                elif k.is_send:
                    msg = (k.payload, op.mb, r, op.peer)
                    issued.add(msg)
                    if k.payload in bounded[r]:
                        queue = queues.setdefault((r, op.peer), [])
                        queue.append(msg)
                        queue[:] = [m for m in queue if m not in consumed]
                        if len(queue) > window:
                            waits[r] = queue[len(queue) - window - 1]  # the newest of those over the window
                ptr[r] += 1
                progress = True
    stuck = [r for r in range(S) if ptr[r] < len(streams[r]) or waits[r] is not None]
    if not stuck:
        return None
    where = []
    for r in stuck:
        if waits[r] is not None:
            kind, mb, _, dst = waits[r]
            where.append(f"stage {r} waits for stage {dst} to receive {Op(kind.send, mb, r)}")
        else:
            where.append(f"stage {r} waits at {streams[r][ptr[r]]}")
    return "with the send window: " + ", ".join(where)


def _blocked_on(op: Op, r: int, S: int, posted, sent, computed, blocking: bool):
    """What ``op`` on rank ``r`` still needs (text of the op on the peer), or None if it can run.
    Raises BadStream for an op that can never run in any interleaving."""
    k, m = op.kind, op.mb
    if k is Kind.F and r > 0 or k is Kind.B and r < S - 1:
        src = r - 1 if k is Kind.F else r + 1
        msg = (k, m, src, r)
        if msg not in posted:
            raise BadStream(f"stage {r}: {op} consumes a tensor whose receive {Op(k.recv, m, r)} is not posted before it")
        if msg not in sent:
            return str(Op(k.send, m, src))
        return None
    if k.is_send:
        producer = Op(k.payload, m, r)
        if producer not in computed:
            raise BadStream(f"stage {r}: {op} sends before {producer} produced it")
        msg = _message(op)
        if blocking and msg not in posted:
            return str(Op(k.recv, m, op.peer))
    return None
