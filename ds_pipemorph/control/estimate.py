"""Per-link delay of one iteration, from the times the training itself sent and received its messages.

Each rank knows, per message of the iteration, when its sends ended and when its receives started
and ended (its op records), and the offset of its clock to each neighbour's (estimated at start-up).
A message's receive end minus its send end, clocks aligned, bounds its transit from above: a
receive that started after the message came reads late. It is exact when the receive started
before the send ended: the receiver was waiting all along (as for the first activation of an
iteration). A receive that merely took long is no proof: on a loaded host a process is descheduled
after its message came. The link's delay is the median of the exact samples of both directions
(the delay under a static delay, a typical one when it changes within the iteration), else the
smallest bound. Nothing extra travels, and a slow or delegated link is measured as training uses it.

Layout of one rank's times (``message_times``), N micro-batches, ns, -1 = none: SEND_F ends [0, N),
SEND_B ends [N, 2N), RECV_F (start, end) pairs [2N, 4N), RECV_B pairs [4N, 6N), then this rank's clock
minus its upstream and its downstream neighbour's.

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from ..plan.ir.ops import Kind, recorded_op

_BASE = {Kind.SEND_F: 0, Kind.SEND_B: 1, Kind.RECV_F: 2, Kind.RECV_B: 4}  # block offsets in units of N


def message_times(records: Iterable, microbatches: int, stage: int, clock_offsets: Mapping[int, float]) -> list[float]:
    """This rank's row of message times (layout above) from its op records (``op``, ``start_ns``,
    ``end_ns``; op texts such as ``SEND_F3``, ``RECV_B0``); ``clock_offsets``: per neighbouring
    stage, this rank's clock minus that stage's (ns; a missing one counts as 0)."""
    N = microbatches
    out = [-1.0] * (6 * N + 2)
    for r in records:
        op = recorded_op(r.op)
        if op is None or op.kind not in _BASE or op.mb >= N:
            continue
        m, base = op.mb, _BASE[op.kind] * N
        if op.kind.is_send:
            out[base + m] = float(r.end_ns)
        else:
            out[base + 2 * m] = float(r.start_ns)
            out[base + 2 * m + 1] = float(r.end_ns)
    out[6 * N] = float(clock_offsets.get(stage - 1, 0))
    out[6 * N + 1] = float(clock_offsets.get(stage + 1, 0))
    return out


@dataclass(frozen=True)
class Neighbours:
    """The global ranks of a stage's upstream (stage s-1) and downstream (stage s+1) neighbours in
    its pipeline; None where the stage has none (the first stage has no upstream, the last no
    downstream)."""

    upstream: Optional[int]
    downstream: Optional[int]


@dataclass(frozen=True)
class RankTimes:
    """One rank's contribution: its stage, its pipeline neighbours and its ``message_times`` row."""

    stage: int
    neighbours: Neighbours
    times: Sequence[float]


def link_delays(ranks: Mapping[int, RankTimes], links: int, microbatches: int,
                fifos: Sequence[Optional[int]]) -> list[Optional[float]]:
    """Per link, its delay in this iteration in ms, rounded to the µs (None: no message seen).

    ``ranks``: every rank's ``RankTimes`` by global rank; a receiver pairs with its sender by global
    rank, so each pipeline of a data-parallel job is measured on its own and the slowest one counts.
    ``fifos``: per link, the delegate FIFOs per direction it ran with in this iteration (None:
    direct), see ``add_transits``. A link slow in one direction only reads as a mix of both: the
    plan's model has one delay per link.
    """
    N = microbatches
    per_replica: list[dict[int, tuple[list, list]]] = [{} for _ in range(links)]  # link -> {pipeline: (exact, bounds)}
    for r, me in ranks.items():
        t = me.times
        for sender, link, off_col, send_base, recv_base in (
                (me.neighbours.upstream, me.stage - 1, 6 * N, 0, 2 * N),
                (me.neighbours.downstream, me.stage, 6 * N + 1, N, 4 * N)):
            if sender is None or sender not in ranks:
                continue
            sent = list(ranks[sender].times[send_base: send_base + N])
            exact, bounds = per_replica[link].setdefault(min(r, sender), ([], []))
            add_transits(exact, bounds, sent, list(t[recv_base: recv_base + 2 * N]), t[off_col], fifos[link])
    out: list[Optional[float]] = []
    for v in per_replica:
        est = [link_delay_ms(exact, bounds) for exact, bounds in v.values() if bounds]
        out.append(round(max(est), 3) if est else None)
    return out


def add_transits(exact: list, bounds: list, sent: Sequence[float], recv: Sequence[float], offset: float,
                 fifos: Optional[int] = None) -> None:
    """One direction of a link in one iteration: per message m, ``sent[m]`` is its send's end and
    ``recv[2m]``, ``recv[2m+1]`` its receive's start and end (ns; -1: none), the receiver's clock
    being ``offset`` ns ahead of the sender's. Appends every transit in ms to ``bounds`` and the
    exact ones (the receive started before the send ended) also to ``exact``.

    ``fifos``: the link is delegated with that many FIFOs, whose sender does not wait: a message
    may then queue behind the one before it in its FIFO (``fifos`` messages earlier), which is not
    the link's delay. Its sample counts as exact only when that one had surely arrived (was
    received) before it was sent."""
    for m, s in enumerate(sent):
        start, end = recv[2 * m], recv[2 * m + 1]
        if s < 0 or end < 0:
            continue
        transit = max(0.0, (end - offset - s) / 1e6)
        bounds.append(transit)
        if start - offset > s:  # the receiver was not waiting before the message left
            continue
        j = m - (fifos or 0)  # round robin: the message before it in its FIFO (sends go in micro-batch order)
        if fifos is not None and j >= 0 and sent[j] >= 0 and not 0 <= recv[2 * j + 1] - offset <= s:
            continue  # it may have queued behind that one
        exact.append(transit)


def link_delay_ms(exact: Sequence[float], bounds: Sequence[float]) -> float:
    """The median exact transit, else the smallest bound."""
    return statistics.median(exact) if exact else min(bounds)
