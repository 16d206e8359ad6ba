"""The control loop inside the engine (PipeMorph §6): measure, detect, re-plan — no oracle.

After every iteration each rank contributes what it measured itself: the median F, B and W times
of its stage (from the op records) and the one-way delay of its links, probed at the iteration
boundary: every rank sends one stamped message down and one up through the engine's own transport
(so a slow or delegated link is measured as training uses it) and the receivers subtract the send
stamp, corrected by the clock offset between the two neighbours estimated at start-up. (Stamping
every training message was tried first: on gloo a message's receive can complete late because it
queues behind the process group's other pending operations, which read as link delay.) The
numbers are all-gathered, so every rank feeds the identical detector the identical input; when it
asks for a re-plan, every rank runs the same deterministic search (bounded by evaluations, not by
time) and adopts the same plan at the next iteration. A hash of the plan is compared across ranks
to prove it. Nothing here reads the injection settings.
"""
from __future__ import annotations

import hashlib
import logging
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..control.detector import DetectorConfig, LinkDetector
from ..plan.profile import Costs
from ..plan.search import search
from ..plan.simulate import Schedule, replay, warmup_counts
from ..plan.tolerance import link_tolerances

logger = logging.getLogger(__name__)

PROBE_MB = (1 << 18) - 1  # a micro-batch id no plan uses: probe messages get their own tags
REPLAN_EVALS = 2000
# Links run on the direct transport: a slow one holds one message in flight and blocks its sender,
# so plans are scored with that model (a burst of warm-up sends costs what it costs on the wire).
HOL = True  # search effort per re-plan; an evaluation bound keeps every rank's plan identical
_CLOCK_TAG = 3 << 24
_PINGS = 5


@dataclass
class Replan:
    iteration: int  # decided after this iteration (0-based); in force from the next one
    measured_ms: list[Optional[float]]
    target_ms: list[float]
    predicted_ms: float
    warmup: list[int]
    plan: list[list[str]]


def estimate_clock_offsets(grid, stage_id: int, stages: int) -> dict[int, int]:
    """Clock offset (this rank's monotonic clock minus the neighbour's) per neighbouring stage.

    NTP-style ping-pong on each link in turn (the sample with the smallest round trip wins). On one
    host the offsets come out near zero; across hosts they make the send-time stamps comparable.
    """
    out: dict[int, int] = {}
    for link in range(stages - 1):
        if stage_id not in (link, link + 1):
            continue
        peer_stage = link + 1 if stage_id == link else link
        peer = grid.stage_to_global(peer_stage)
        best = None
        buf = torch.zeros(2, dtype=torch.int64)
        for _ in range(_PINGS):
            if stage_id == link:  # initiator
                t0 = time.monotonic_ns()
                dist.send(torch.tensor([t0, 0], dtype=torch.int64), peer, tag=_CLOCK_TAG)
                dist.recv(buf, peer, tag=_CLOCK_TAG)
                t3 = time.monotonic_ns()
                t1, t2 = buf.tolist()
                rtt = (t3 - t0) - (t2 - t1)
                offset = ((t1 - t0) + (t2 - t3)) // 2  # peer clock minus mine
                if best is None or rtt < best[0]:
                    best = (rtt, offset)
            else:
                dist.recv(buf, peer, tag=_CLOCK_TAG)
                t1 = time.monotonic_ns()
                dist.send(torch.tensor([t1, time.monotonic_ns()], dtype=torch.int64), peer, tag=_CLOCK_TAG)
        if stage_id == link:
            out[peer_stage] = -best[1]
            dist.send(torch.tensor([best[1], 0], dtype=torch.int64), peer, tag=_CLOCK_TAG)
        else:
            dist.recv(buf, peer, tag=_CLOCK_TAG)
            out[peer_stage] = int(buf[0].item())
    return out


class Adapter:
    def __init__(self, stages: int, microbatches: int, stage_id: int, plan: Schedule, costs: Costs,
                 caps: Optional[list[int]], every: int, clock_offsets: dict[int, int],
                 delegation: str = "off", detector: DetectorConfig = DetectorConfig()):
        self.S, self.N, self.stage_id = stages, microbatches, stage_id
        self.caps = caps
        self.every = every
        self.clock_offsets = clock_offsets
        self.delegation = delegation
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pipemorph-probe")
        self.costs = costs
        self.detector = LinkDetector(stages - 1, detector)
        tol = link_tolerances(plan, costs, microbatches, resolution_ms=0.1, hol=self._direct([0.0] * (stages - 1)))
        self.detector.adopt([0.0] * (stages - 1), [t.replay_ms for t in tol])
        self.iteration = -1
        self.replans: list[Replan] = []
        self.measured: list[list[Optional[float]]] = []  # per iteration, per link

    def after_iteration(self, records, transport) -> Optional[Schedule]:
        """Called on every rank at the same iteration boundary; returns the new plan or None."""
        self.iteration += 1
        mine = self._local(records, transport)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        table = torch.stack(everyone)  # rows: [stage, f, b, w, delay in (link s-1), delay in (link s)]
        f, b, w, links = self._per_stage(table)
        self.measured.append(links)
        if self.iteration == 0 or (self.iteration + 1) % self.every:
            return None  # the first iteration exchanges layouts and warms up: not representative
        target = self.detector.observe(links)
        if target is None:
            return None
        costs = Costs(f, b, w, target)
        direct = self._direct(target)
        plan = search(costs, self.N, self._caps_for(target), budget_s=600.0, seed=0, exact=False,
                      max_evals=REPLAN_EVALS, hol=direct).schedule
        self._check_same_everywhere(plan)
        tol = [t.replay_ms for t in link_tolerances(plan, costs, self.N, resolution_ms=0.1, hol=direct)]
        self.detector.adopt(target, tol)
        self.costs = costs
        predicted = replay(plan, costs, self.N, hol=direct).iteration_ms
        ev = Replan(self.iteration, links, target, predicted, warmup_counts(plan), [[str(o) for o in r] for r in plan])
        self.replans.append(ev)
        if dist.get_rank() == 0:
            logger.warning("pipemorph: after iteration %d measured link delays %s ms -> re-planned for %s ms: "
                           "warm-up %s, predicted %.1f ms", ev.iteration, _fmt(links), target, ev.warmup, predicted)
        return plan

    def _direct(self, target: list[float]) -> list[bool]:
        """Per link, whether it runs direct under ``target``: there a slow link holds one message in
        flight and blocks its sender, so plans and tolerances are computed with that model."""
        if self.delegation == "always":
            return [False] * len(target)
        if self.delegation == "auto":
            return [d <= 0 for d in target]
        return [True] * len(target)

    def link_modes(self) -> dict[int, str]:
        """With delegation "auto": links planned for a delay go delegated, the others direct."""
        if self.delegation != "auto":
            return {}
        return {i: ("delegated" if d > 0 else "direct") for i, d in enumerate(self.detector.planned_for)}

    def _caps_for(self, target: list[float]) -> Optional[list[int]]:
        """§4.2: stages next to a delegated slow link stage their activations in host memory, so their
        cap is relaxed to N (the pipeline's micro-batch count)."""
        if self.caps is None or self.delegation == "off":
            return self.caps
        caps = list(self.caps)
        for i, d in enumerate(target):
            if d > 0:
                caps[i] = caps[i + 1] = self.N
        return caps

    def _local(self, records, transport) -> torch.Tensor:
        dur = {"F": [], "B": [], "W": []}
        for r in records:
            if r.op[:1] in dur and r.op[1:].isdigit():
                dur[r.op[0]].append((r.end_ns - r.start_ns) / 1e6)
        med = [statistics.median(dur[k]) if dur[k] else -1.0 for k in "FBW"]
        delays = self._probe(transport)
        return torch.tensor([float(self.stage_id), *med, *delays], dtype=torch.float64)

    def _probe(self, transport) -> list[float]:
        """[delay of the activation from stage s-1, of the gradient from stage s+1] in ms (-1: none).

        Every rank sends one stamped message down and one up at the same moment (after a barrier)
        and waits for its two incoming ones on two threads, each noting when its message is in; so
        neither arrival is read late because the rank was waiting for the other one. (gloo's
        ``is_completed`` only turns true inside ``wait``, so polling cannot do this.)
        """
        s, last = self.stage_id, self.S - 1
        incoming = [(kind, src) for kind, src in (("F", s - 1), ("B", s + 1)) if 0 <= src <= last]
        for kind, _ in incoming:
            transport.post_recv(kind, PROBE_MB)
        dist.barrier()
        waits = [self._pool.submit(_timed_recv, transport, kind) for kind, _ in incoming]
        now = torch.tensor([time.monotonic_ns()], dtype=torch.int64)
        if s < last:
            transport.send("F", PROBE_MB, now)
        if s > 0:
            transport.send("B", PROBE_MB, now)
        out = {"F": -1.0, "B": -1.0}
        for (kind, src), fut in zip(incoming, waits):
            sent, got = fut.result()
            out[kind] = max(0.0, (got - sent - self.clock_offsets.get(src, 0)) / 1e6)
        transport.wait_sends()
        return [out["F"], out["B"]]

    def _per_stage(self, table: torch.Tensor):
        """Max over data-parallel replicas of each stage; per link the slower of its two directions."""
        S = self.S
        rows = [table[table[:, 0] == s] for s in range(S)]
        f = [_round(r[:, 1].max().item(), self.costs.f[s]) for s, r in enumerate(rows)]
        b = [_round(r[:, 2].max().item(), self.costs.b[s]) for s, r in enumerate(rows)]
        w = [_round(r[:, 3].max().item(), self.costs.w[s]) for s, r in enumerate(rows)]
        links: list[Optional[float]] = []
        for i in range(S - 1):
            vals = [v for v in (rows[i + 1][:, 4].max().item(), rows[i][:, 5].max().item()) if v >= 0]
            links.append(round(max(vals), 3) if vals else None)
        return f, b, w, links

    def _check_same_everywhere(self, plan: Schedule) -> None:
        digest = int.from_bytes(hashlib.sha256(repr(plan).encode()).digest()[:7], "big")
        t = torch.tensor([digest, -digest], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if t[0].item() != digest or -t[1].item() != digest:
            raise RuntimeError(f"rank {dist.get_rank()}: ranks computed different plans at iteration {self.iteration}")


def _timed_recv(transport, kind: str) -> tuple[int, int]:
    """(send stamp, arrival time) of this rank's incoming probe of ``kind``."""
    stamp = transport.recv(kind, PROBE_MB)
    return int(stamp.item()), time.monotonic_ns()


def _round(ms: float, fallback: float) -> float:
    """Op times to 0.5 ms (stable plans); an op never seen keeps its previous estimate."""
    return fallback if ms < 0 else max(0.5, round(ms * 2) / 2)


def _fmt(links) -> str:
    return "[" + ", ".join("-" if v is None else f"{v:.1f}" for v in links) + "]"
