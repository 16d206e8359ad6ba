"""The lowering for NCCL: per-rank streams that NCCL's in-order point-to-point runs (``nccl``'s rules).

``lower_nccl`` places each send right after its producer (SEND_F after F, SEND_B after B, or after
W for a fused backward) and each receive as late as it can go: right before its consumer, unless
the pair's message order puts it before one of the receiver's own sends to the same peer, in which
case it is posted right before that send. Both ranks of a pair issue their messages in one order:
the order a unit-time run of the plan produces them in (each step, every stage runs its next op if
its input was sent in an earlier step). Receives from one peer so keep the sender's order, and an
exchange (both ranks have a message for the other) is ordered the way the run meets it.

Adjacent sends and receives with one peer are issued as one group (``nccl_groups``: per rank, index
ranges of its stream), as DeepSpeed's p2p does; the streams pass the dry run without any group too.

Every valid plan lowers to streams that run. Were the dry run stuck, take the host op earliest in
the unit-time run among those the hosts wait at: it consumes a message whose producer ran earlier,
so the sender issued the send; every earlier message of the pair was issued on both sides too (a
receive ordered before one of the receiver's sends is posted before it, and that send's producer
ran earlier still), so the first unmatched message of the pair is at the head of both streams and
would complete. Tested on random valid plans, 1F1B and ZB-H1 (tests/plan/test_nccl_rules.py). A
plan that cannot run at all (an op waits for an input never produced) is refused with ``Deadlock``.

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .lower import Deadlock, Dispatch, Stream, consumes_message, sends_gradient, format_streams
from .nccl import nccl_dry_run, nccl_groups
from .ops import Kind, Op, Schedule


def lower_nccl(schedule: Schedule, fused_backward: bool = False) -> list[Stream]:
    """Per-rank streams of ``schedule`` (one stage per rank) placed as the module says."""
    S = len(schedule)
    made: list[dict[int, Op]] = [{} for _ in range(S)]  # per stage: index of a producer -> its send
    used: list[dict[int, Op]] = [{} for _ in range(S)]  # per stage: index of a consumer -> its receive
    for s, row in enumerate(schedule):
        for i, op in enumerate(row):
            if op.kind is Kind.F and s < S - 1:
                made[s][i] = Op(Kind.SEND_F, op.mb, s)
            elif s > 0 and sends_gradient(row, i, fused_backward):
                made[s][i] = Op(Kind.SEND_B, op.mb, s)
            if consumes_message(op, s, S):
                used[s][i] = Op(op.kind.recv, op.mb, s)
    at = {op: i for s in range(S) for d in (made[s], used[s]) for i, op in d.items()}
    pairs: dict[int, list[Op]] = {}  # s -> the sends between s and s + 1, in the order the run makes them
    for send in _send_order(schedule, made, used):
        pairs.setdefault(min(send.stage, send.peer), []).append(send)
    out = []
    for r, row in enumerate(schedule):
        # slot (i, 0): right before op i; (i, 1): after op i, right before the send it produces
        slots: dict[tuple[int, int], list[Op]] = {}
        for p in (r - 1, r + 1):
            placed, bound = [], (len(row), 0)
            for send in reversed(pairs.get(min(r, p), [])):  # the pair's last message first
                if send.stage == r:
                    bound = min(bound, (at[send], 1))
                else:
                    recv = Op(send.kind.recv, send.mb, r)
                    bound = min(bound, (at.get(recv, len(row)), 0))
                    placed.append((recv, bound))
            for recv, slot in reversed(placed):
                slots.setdefault(slot, []).append(recv)
        stream: Stream = []
        last = None  # peer of the send just issued: receives from it go first, to share its group
        for i, op in enumerate(row):
            stream += sorted(slots.get((i, 0), []), key=lambda recv: recv.peer != last)
            stream.append(op.at(r))
            last = None
            if i in made[r]:
                last = made[r][i].peer  # receives from that peer go last, right before the send
                stream += sorted(slots.get((i, 1), []), key=lambda recv: recv.peer == last)
                stream.append(made[r][i])
        out.append(stream + sorted(slots.get((len(row), 0), []), key=lambda recv: recv.peer != last))
    return out


def _send_order(schedule: Schedule, made: list[dict[int, Op]], used: list[dict[int, Op]]) -> list[Op]:
    """The sends of a unit-time run of ``schedule``: each step, every stage whose next op's input
    was sent in an earlier step runs it (lower stages first). Raises Deadlock if the plan is stuck."""
    S, ptr, sent, order = len(schedule), [0] * len(schedule), set(), []

    def source(s: int) -> Optional[Op]:  # the send the next op of stage s waits for, if any
        recv = used[s].get(ptr[s])
        return None if recv is None else Op(recv.kind.send, recv.mb, recv.peer)

    while any(ptr[s] < len(row) for s, row in enumerate(schedule)):
        ran = [s for s in range(S) if ptr[s] < len(schedule[s]) and (source(s) is None or source(s) in sent)]
        if not ran:
            raise Deadlock("the plan cannot run: " + ", ".join(
                f"stage {s} waits at {schedule[s][ptr[s]].at(s)} for {source(s)}"
                for s in range(S) if ptr[s] < len(schedule[s])))
        step = [made[s][ptr[s]] for s in ran if ptr[s] in made[s]]
        for s in ran:
            ptr[s] += 1
        order += step
        sent.update(step)
    return order


@dataclass(frozen=True)
class NcclLowering:
    """The lowering for NCCL, shaped like ``lower.LoweringPolicy``: ``lower`` returns the streams of
    ``lower_nccl`` after they passed ``nccl_dry_run`` with their ``nccl_groups`` (else raises
    BadStream). ``fused``: a B m directly followed by W m is one backward whose input gradient leaves
    after W. Ordered dispatch only: ready dispatch posts every receive up front, which NCCL's
    in-order point-to-point cannot run (``nccl``'s module docstring).

    >>> NcclLowering().lines([[Op("F", 0), Op("B", 0), Op("W", 0)], [Op("F", 0), Op("B", 0), Op("W", 0)]])
    ['0F0 0SEND_F0 0RECV_B0 0B0 0W0', '1RECV_F0 1F0 1B0 1SEND_B0 1W0']
    """

    fused: bool = False

    def for_dispatch(self, dispatch: Dispatch) -> "NcclLowering":
        """This lowering for ``ordered`` dispatch; ValueError for any other."""
        if dispatch != Dispatch.ORDERED:
            raise ValueError(f"with NCCL, dispatch is 'ordered', not {str(dispatch)!r}: ready dispatch posts every "
                             "receive up front, which NCCL's in-order point-to-point cannot run")
        return self

    def lower(self, schedule: Schedule) -> list[Stream]:
        streams = lower_nccl(schedule, self.fused)
        nccl_dry_run(streams, groups=nccl_groups(streams))
        return streams

    def groups(self, streams: list[Stream]) -> list[list[range]]:
        """``nccl_groups(streams)``: the index ranges each rank issues as one group."""
        return nccl_groups(streams)

    def lines(self, schedule: Schedule) -> list[str]:
        """``format_streams`` of ``lower(schedule)``: one line per rank, ``0F0 0SEND_F0 ...``."""
        return format_streams(self.lower(schedule))
