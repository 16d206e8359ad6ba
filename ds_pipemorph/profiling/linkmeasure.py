"""Measure latency and bandwidth of every link (r, r+1) over the real backend, one link at a time.

Method: ping-pong timed on one clock, so no clock offset between hosts enters the numbers.

- Latency: the initiator (stage r) sends a tiny message (4 bytes) to stage r+1, which answers with
  a tiny message; the one-way latency sample is half the round trip. One-way latency cannot be
  split by direction without synchronised clocks, so latency is per link, not per direction.
- Bandwidth, per direction: the sender of that direction sends a message of size s, the receiver
  answers with the tiny message; the one-way time sample of size s is the round trip minus the
  link's median tiny one-way latency. "down" is stage r -> r+1 (activations), "up" is r+1 -> r
  (input gradients). Each (direction, size) starts with ``warmup`` untimed exchanges (connection
  set-up, the first message's layout header) followed by ``reps`` timed ones; the latency step
  uses 4 more warm-up and twice as many timed exchanges, since everything else is relative to it.

Messages go through the runtime's own transport (``DirectTransport``: tagged isend/irecv of
gloo or NCCL, received into freshly allocated tensors as in training), optionally wrapped in the
testing-only ``DelayInjector``, so a measured link is the link the engine sees. While one link
is measured every other rank waits in a barrier (one barrier per direction and size), so links do
not disturb each other; rank 0 advances its progress bar at each barrier. Every rank's samples
are then gathered on rank 0.

All pairs (``measure_pairs``, ``pipemorph profile-links --all-pairs``): the same steps for every
pair of ranks (a, b), a < b, "down" being a -> b and "up" b -> a. The pairs are scheduled as a
round-robin tournament (``pairs.round_robin``): each round's pairs are disjoint and are measured
at the same time, every rank in the same barriers (a rank without a partner only waits), so W ranks
take W - 1 rounds (W when odd) instead of W(W-1)/2 pair measurements one after another. Each pair
gets its own two-stage ``DirectTransport`` (a is stage 0, b stage 1), wrapped in the
``DelayInjector`` when a delay is injected on the pair (testing only).
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..inject.delays import DelayInjector, DelaySchedule
from ..plan.ir.ops import Kind
from ..runtime.transport.direct import DirectTransport
from .distenv import sync
from .pairs import Pair, partner, round_robin

ACK_MB = 0  # micro-batch id of the tiny messages; message sizes use 1..len(sizes)
TINY_BYTES = 4
LATENCY_EXTRA_WARMUP = 4  # the first tiny exchanges after a barrier are slower (peer waking up)


def steps(sizes: Sequence[int]) -> list[tuple[str, Optional[int]]]:
    """The measurement steps of one link, in order: latency, then each size down, then each size up."""
    return [("latency", None)] + [("down", s) for s in sizes] + [("up", s) for s in sizes]


def make_transport(rank: int, world: int, device: torch.device, timeout_s: float,
                   inject_ms: Optional[Sequence[float]]):
    """The runtime's direct transport for stage ``rank``, wrapped in the delay injector (testing only)."""
    tr = DirectTransport(rank, rank, list(range(world)), timeout_s=timeout_s, device=device)
    if inject_ms is not None and any(c > 0 for c in inject_ms):
        tr = DelayInjector(tr, rank, DelaySchedule(list(inject_ms)), timeout_s=timeout_s)
    return tr


def make_pair_transport(rank: int, pair: Pair, device: torch.device, timeout_s: float, inject_ms: float = 0.0):
    """A transport between the two ranks of ``pair`` (its lower rank is stage 0, the other stage 1),
    wrapped in the delay injector when ``inject_ms`` > 0 (testing only)."""
    a, b = pair
    tr = DirectTransport(rank, 0 if rank == a else 1, [a, b], timeout_s=timeout_s, device=device)
    if inject_ms > 0:
        tr = DelayInjector(tr, 0 if rank == a else 1, DelaySchedule([inject_ms]), timeout_s=timeout_s)
    return tr


def _exchange(tr, device, initiator: bool, out_kind: Kind, back_kind: Kind, mb: int, payload: torch.Tensor,
              ack: torch.Tensor, warmup: int, reps: int) -> list[float]:
    """Ping-pong ``payload`` (as message (out_kind, mb)) against a tiny answer; round trips in ms."""
    rtts = []
    for i in range(warmup + reps):
        if initiator:
            # No receive posted ahead of the send: NCCL runs a pair's p2p ops in issue order on one
            # stream, so an early receive of the answer would wait in front of the send it answers.
            sync(device)
            t0 = time.perf_counter()
            tr.send(out_kind, mb, payload)
            tr.recv(back_kind, ACK_MB)
            sync(device)
            if i >= warmup:
                rtts.append((time.perf_counter() - t0) * 1000.0)
        else:
            tr.recv(out_kind, mb)
            sync(device)
            tr.send(back_kind, ACK_MB, ack)
    return rtts


def measure_links(tr, rank: int, world: int, device: torch.device, sizes: Sequence[int], warmup: int,
                  reps: int, on_step: Callable[[int, str, Optional[int]], None] = lambda *a: None) -> list[dict]:
    """Run every link's steps on every rank in the same order; return the samples (on rank 0 only:
    elsewhere an empty list). Per link: ``latency_ms`` one-way samples and ``down``/``up``
    ``{size: one-way ms samples}``."""
    ack = torch.zeros(TINY_BYTES, dtype=torch.uint8, device=device)
    mine: dict[int, dict] = {}
    for link in range(world - 1):
        lower, upper = link, link + 1
        rec = mine.setdefault(link, {"latency_ms": [], "down": {}, "up": {}})
        for kind, size in steps(sizes):
            if rank in (lower, upper):
                _step(tr, device, rank == lower, kind, size, sizes, ack, warmup, reps, rec)
            dist.barrier()
            on_step(link, kind, size)
        if rank in (lower, upper):
            tr.wait_sends()
        # The upper end's "up" round trips need the link's latency, which the lower end measured.
        lat = _share_latency(rec, link, rank, lower, upper, device)
        for kind in ("down", "up"):
            rec[kind] = {s: [r - lat for r in v] for s, v in rec[kind].items()}
    merged = _gather_samples(mine, rank, world, list(range(world - 1)))
    return [] if merged is None else [merged[link] for link in range(world - 1)]


def _gather_samples(mine: dict, rank: int, world: int, keys: list) -> Optional[dict]:
    """Every rank's samples per key (a link or a pair), merged on rank 0 (None on the others)."""
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {k: v for k, v in mine.items() if v["latency_ms"] or v["down"] or v["up"]})
    if rank != 0:
        return None
    out = {}
    for key in keys:
        merged = {"latency_ms": [], "down": {}, "up": {}}
        for part in gathered:
            got = part.get(key)
            if got:
                merged["latency_ms"] += got["latency_ms"]
                merged["down"].update(got["down"])
                merged["up"].update(got["up"])
        out[key] = merged
    return out


def measure_pairs(rank: int, world: int, device: torch.device, sizes: Sequence[int], warmup: int, reps: int,
                  timeout_s: float, inject_ms: Optional[dict[Pair, float]] = None,
                  on_step: Callable[[int, str, Optional[int]], None] = lambda *a: None) -> dict[Pair, dict]:
    """Every pair's steps, round by round (``round_robin``), on every rank; return the samples (on
    rank 0 only: elsewhere an empty dict) as ``{(a, b): {"latency_ms": [...], "down": {size: [...]},
    "up": {size: [...]}}}``, one-way ms, "down" = a -> b. ``on_step(round, kind, size)`` runs after
    each step's barrier."""
    ack = torch.zeros(TINY_BYTES, dtype=torch.uint8, device=device)
    inject_ms = inject_ms or {}
    mine: dict[Pair, dict] = {}
    for rnd, pairs in enumerate(round_robin(world)):
        pair = partner(pairs, rank)
        rec = {"latency_ms": [], "down": {}, "up": {}}
        tr = make_pair_transport(rank, pair, device, timeout_s, inject_ms.get(pair, 0.0)) if pair else None
        try:
            for kind, size in steps(sizes):
                if pair:
                    _step(tr, device, rank == pair[0], kind, size, sizes, ack, warmup, reps, rec)
                dist.barrier()
                on_step(rnd, kind, size)
            if tr is not None:
                tr.wait_sends()
        finally:
            if tr is not None:
                tr.close()
        # The upper ends' "up" round trips need their pair's latency, which the lower ends measured:
        # one collective per round, slot a holding the latency of the pair whose lower end is a.
        val = torch.zeros(world, dtype=torch.float64)
        if pair and rank == pair[0]:
            val[rank] = _median(rec["latency_ms"])
        val = val.to(device)
        dist.all_reduce(val)
        if pair:
            lat = float(val[pair[0]].item())
            for kind in ("down", "up"):
                rec[kind] = {s: [r - lat for r in v] for s, v in rec[kind].items()}
            mine[pair] = rec
    merged = _gather_samples(mine, rank, world, [pair for pairs in round_robin(world) for pair in pairs])
    return {} if merged is None else dict(sorted(merged.items()))


def _step(tr, device, is_lower: bool, kind: str, size: Optional[int], sizes: Sequence[int], ack: torch.Tensor,
          warmup: int, reps: int, rec: dict) -> None:
    """One measurement step of one link or pair, on one of its two ends (the lower end is the
    transport's stage 0: it sends Kind.F to the upper end, which sends Kind.B back); fills ``rec``."""
    if kind == "latency":
        rtts = _exchange(tr, device, is_lower, Kind.F, Kind.B, ACK_MB, ack, ack, warmup + LATENCY_EXTRA_WARMUP, 2 * reps)
        if is_lower:
            rec["latency_ms"] = [r / 2 for r in rtts]
        return
    mb = 1 + sizes.index(size)
    payload = torch.empty(size, dtype=torch.uint8, device=device)
    if kind == "down":
        rtts = _exchange(tr, device, is_lower, Kind.F, Kind.B, mb, payload, ack, warmup, reps)
    else:
        rtts = _exchange(tr, device, not is_lower, Kind.B, Kind.F, mb, payload, ack, warmup, reps)
    if rtts:
        rec[kind][size] = rtts


def _share_latency(rec: dict, link: int, rank: int, lower: int, upper: int, device) -> float:
    """The median one-way latency of ``link``, measured by its lower end, known to both ends."""
    val = torch.tensor([_median(rec["latency_ms"]) if rank == lower else 0.0], dtype=torch.float64)
    val = val.to(device)
    dist.all_reduce(val)  # only the lower end contributes; one collective per link, after its steps
    return float(val.item())


def _median(xs: Sequence[float]) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
