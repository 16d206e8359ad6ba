"""NCCL's point-to-point rules, and a dry run that executes lowered streams under them
(``nccl_dry_run``); ``nccl_lowering`` lowers plans to streams that pass it.

The rules (torch's ProcessGroupNCCL): every send and receive between two ranks, both directions,
runs on one communicator and one stream per rank, so on each rank the ops with a given peer run
strictly one after another in the order issued. A send and a receive complete together, once
both are at the head of their streams (a rendezvous); the k-th send from a to b is matched with
the k-th receive at b from a, whatever the tags. Ops issued as one group (``ncclGroupStart/End``,
``dist.batch_isend_irecv``) become eligible together and progress concurrently; a group here holds
ops with one peer only (``Groups``: per rank, index ranges of its stream). The host does not block
when it issues a send or a receive, only at the compute op that consumes a received tensor and, at
the end of the iteration, for everything still queued.

So a receive posted ahead can hold up a later send to the same peer, and two ranks that each wait
for an op queued behind their own deadlock: ``lower.LoweringPolicy`` (receives posted ahead, or up
front for ready dispatch) deadlocks this way on every plan of two or more stages. A deadlock is
reported naming each stuck stage, the op its host waits at and what heads its blocked streams, e.g.
``deadlock under NCCL's ordering: stage 0 waits at 0B0 for 0RECV_B0 (needs 1SEND_B0, not issued
yet); stage 1 waits at 1F0 for 1RECV_F0 (needs 0SEND_F0, queued behind 0RECV_B0)``.

This is a model of NCCL's documented behaviour, checked on symbols; it has not been run on GPUs.

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

from collections import deque
from typing import Optional, Sequence

from .lower import BadStream, Deadlock, Stream, consumes_message
from .ops import Op

Groups = list[list[range]]  # per rank, the index ranges of its stream issued as one group (one peer each)


def nccl_dry_run(streams: Sequence[Stream], *, groups: Optional[Groups] = None) -> list[tuple[Op, Op]]:
    """Run ``streams`` symbolically under NCCL's rules (module docstring); ``groups`` as
    ``nccl_groups`` returns them (None: every op alone). Returns the (send, receive) pairs in the
    order they completed; raises ``BadStream`` for malformed streams or a pair's k-th send and k-th
    receive carrying different messages, ``Deadlock`` naming every stuck stage otherwise."""
    S = len(streams)
    partner, consumed = _pair_up(streams)
    starts = _group_starts(streams, groups)
    ptr = [0] * S
    queues: dict[tuple[int, int], deque] = {}  # (rank, peer) -> units (index lists) issued, not done
    issued: set[tuple[int, int]] = set()
    done: set[tuple[int, int]] = set()
    matches: list[tuple[Op, Op]] = []
    progress = True
    while progress:
        progress = False
        for r, stream in enumerate(streams):
            while ptr[r] < len(stream):
                i, op = ptr[r], stream[ptr[r]]
                if op.is_compute:
                    if i in consumed[r] and (r, consumed[r][i]) not in done:
                        break
                    ptr[r] = i + 1
                else:
                    unit = starts[r].get(i, range(i, i + 1))
                    queues.setdefault((r, op.peer), deque()).append(list(unit))
                    issued.update((r, k) for k in unit)
                    ptr[r] = unit.stop
                progress = True
        for (r, p), q in queues.items():
            for i in q[0] if q else ():
                b, j = partner[r, i]
                if (r, i) not in done and queues.get((b, r)) and j in queues[b, r][0]:
                    done.update(((r, i), (b, j)))
                    pair = (streams[r][i], streams[b][j])
                    matches.append(pair if pair[0].kind.is_send else pair[::-1])
                    progress = True
        for (r, p), q in queues.items():
            while q and all((r, i) in done for i in q[0]):
                q.popleft()

    def head(r: int, p: int) -> int:  # the first op not done in the head unit of r's stream with p
        return next(i for i in queues[r, p][0] if (r, i) not in done)

    def needs(r: int, i: int) -> str:
        b, j = partner[r, i]
        if (b, j) not in issued:
            return f"needs {streams[b][j]}, not issued yet"
        h = head(b, r)
        return f"needs {streams[b][j]}" + ("" if j in queues[b, r][0] else f", queued behind {streams[b][h]}")

    def where(r: int, i: int) -> str:  # where op i of rank r sits in its stream with its peer
        h = head(r, streams[r][i].peer)
        return f" ({needs(r, i)})" if i in queues[r, streams[r][i].peer][0] else \
            f", queued behind {streams[r][h]} ({needs(r, h)})"

    stuck = []
    for r, stream in enumerate(streams):
        blocked = sorted(p for (a, p), q in queues.items() if a == r and q)
        if ptr[r] == len(stream) and not blocked:
            continue
        if ptr[r] < len(stream):
            i = consumed[r][ptr[r]]
            text = f"stage {r} waits at {stream[ptr[r]]} for {stream[i]}{where(r, i)}"
        else:
            i = head(r, blocked[0])
            text = f"stage {r} waits at the end of the iteration for {stream[i]}{where(r, i)}"
        for p in blocked:
            if p != stream[i].peer:
                h = head(r, p)
                text += f", and its stream with stage {p} is headed by {stream[h]} ({needs(r, h)})"
        stuck.append(text)
    if stuck:
        raise Deadlock("deadlock under NCCL's ordering: " + "; ".join(stuck))
    return matches


def _pair_up(streams: Sequence[Stream]) -> tuple[dict, list[dict[int, int]]]:
    """(rank, index) of each send and receive -> (rank, index) of its match (the k-th of the pair),
    and per rank: index of a compute op -> index of the receive it consumes. Raises BadStream."""
    S = len(streams)
    sends: dict[tuple[int, int], list] = {}  # (src, dst) -> (rank, index) of its sends, in issue order
    recvs: dict[tuple[int, int], list] = {}
    consumed: list[dict[int, int]] = []
    for r, stream in enumerate(streams):
        have: dict[Op, int] = {}
        consumed.append({})
        for i, op in enumerate(stream):
            if op.stage != r:
                raise BadStream(f"rank {r}: {op} belongs to stage {op.stage}; one stage per rank")
            if op.is_compute and consumes_message(op, r, S):
                need = Op(op.kind.recv, op.mb, r)
                if need not in have:
                    raise BadStream(f"stage {r}: {op} consumes a tensor whose receive {need} is not posted before it")
                consumed[r][i] = have[need]
            elif not op.is_compute:
                if not 0 <= op.peer < S:
                    raise BadStream(f"stage {r}: {op} talks to stage {op.peer}, which does not exist")
                if op in have:
                    raise BadStream(f"stage {r}: {op} appears twice in the iteration")
                if op.kind.is_send and Op(op.kind.payload, op.mb, r) not in have:
                    raise BadStream(f"stage {r}: {op} sends before {Op(op.kind.payload, op.mb, r)} produced it")
                book, key = (sends, (r, op.peer)) if op.kind.is_send else (recvs, (op.peer, r))
                book.setdefault(key, []).append((r, i))
            have[op] = i
    partner = {}
    for src, dst in sorted(set(sends) | set(recvs)):
        ss, rr = sends.get((src, dst), []), recvs.get((src, dst), [])
        for k, (a, b) in enumerate(zip(ss, rr)):
            send, recv = streams[a[0]][a[1]], streams[b[0]][b[1]]
            if (send.kind.payload, send.mb) != (recv.kind.payload, recv.mb):
                raise BadStream(
                    f"stage {dst}'s receive no. {k + 1} from stage {src} is {recv} but stage {src}'s send no."
                    f" {k + 1} to it is {send} (NCCL matches a pair's messages in issue order, whatever their tags)")
            partner[a], partner[b] = b, a
        if len(ss) != len(rr):
            extra = streams[src][ss[len(rr)][1]] if len(ss) > len(rr) else streams[dst][rr[len(ss)][1]]
            raise BadStream(f"stage {extra.stage}: {extra} is never matched: stage {src} sends {len(ss)}"
                            f" messages to stage {dst}, which posts {len(rr)} receives from it")
    return partner, consumed


def _group_starts(streams: Sequence[Stream], groups: Optional[Groups]) -> list[dict[int, range]]:
    """Per rank: first index of a group -> its range, after checking the groups are well formed."""
    if groups is None:
        return [{} for _ in streams]
    if len(groups) != len(streams):
        raise BadStream(f"groups are given for {len(groups)} ranks, the streams are {len(streams)}")
    out = []
    for r, (stream, ranges) in enumerate(zip(streams, groups)):
        starts, end = {}, 0
        for g in ranges:
            ops = stream[g.start:g.stop]
            if g.step != 1 or g.start < end or g.stop > len(stream) or not ops:
                raise BadStream(f"rank {r}: group {g} is empty, overlaps another or leaves the stream")
            if any(op.is_compute for op in ops) or len({op.peer for op in ops}) != 1:
                raise BadStream(f"stage {r}: a group holds sends and receives with one peer, "
                                f"not {' '.join(map(str, ops))}")
            starts[g.start], end = g, g.stop
        out.append(starts)
    return out


def nccl_groups(streams: Sequence[Stream]) -> Groups:
    """Per rank, the index ranges of its stream's runs of two or more adjacent sends and receives
    with one peer: each run is issued as one group (``dist.batch_isend_irecv``)."""
    out = []
    for stream in streams:
        ranges, i = [], 0
        while i < len(stream):
            j = i + 1
            if not stream[i].is_compute:
                while j < len(stream) and not stream[j].is_compute and stream[j].peer == stream[i].peer:
                    j += 1
                if j - i > 1:
                    ranges.append(range(i, j))
            i = j
        out.append(ranges)
    return out


def grouped_lines(streams: Sequence[Stream], groups: Groups) -> list[str]:
    """One line per rank, as ``lower.format_streams`` prints it, with each group in brackets:
    ``0F0 0SEND_F0 0F1 [0SEND_F1 0RECV_B0] 0B0 ...``."""
    lines = []
    for stream, ranges in zip(streams, groups):
        opens = {g.start for g in ranges}
        closes = {g.stop - 1 for g in ranges}
        lines.append(" ".join(("[" if i in opens else "") + str(op) + ("]" if i in closes else "")
                              for i, op in enumerate(stream)))
    return lines
