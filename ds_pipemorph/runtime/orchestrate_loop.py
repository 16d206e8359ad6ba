"""The orchestrator in the engine: measure every stage's all-reduce, detect on every rank, search on rank 0, re-map.

At each exchange of the boundary every rank contributes its ``ReduceGrads`` time, its stage's mean
F, B and W per micro-batch and its stage's gradient MB; the rows travel in the boundary's one
all-gather (``runtime.boundary``), so every rank holds the same table and runs the same torch-free
``control.orchestrate.Orchestrator`` on it. Its cheap part (``Orchestrator.due``: the iterations
kept, the noise and patience of the straggler detection) runs on every rank and keeps the same
state everywhere; only when it says a placement search is due (once to learn what the best rings
cost, then when a stage is a straggler) does rank 0 run the search (bounded by replays, but only
one rank needs to run it) and broadcast what it found: the decision, what the best rings cost and
whether the orchestrator acted, or its error, which then fails every rank. An exchange where no
search is due costs no broadcast. The decision is a ``Remap``; ``quiet`` (the boundary's next
exchange) is the orchestrator's ``settled``, the same on every rank. The engine stores the
decision as ``engine.pending_remap``, and ``EngineHandle.train_batch`` re-maps right after the
``train_batch`` that produced it (a re-mapping makes a new engine, which only the handle the
training loop holds can swap in).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from ..control.orchestrate import Orchestrator
from ..fileio import BadInput, load_model
from ..plan.files.linkmatrix import LinkMatrix
from ..plan.ir.memory import MemoryBudget
from ..plan.place.placement import Placement
from .boundary import Remap
from .config import PipeMorphConfigError
from .oprecords import fbw_ms_per_microbatch

logger = logging.getLogger(__name__)


class OrchestrateLoop:
    """The orchestrator's ``runtime.boundary.BoundaryLoop``: its row, and on rank 0 the decision to re-map."""

    def __init__(self, engine, budget: MemoryBudget):
        cfg = engine.pipemorph.orchestrate
        try:
            matrix = load_model(cfg.matrix, LinkMatrix)
        except BadInput as e:
            raise PipeMorphConfigError(f"orchestrate.matrix: {e}") from None
        if matrix.world_size != dist.get_world_size():
            raise PipeMorphConfigError(f"orchestrate.matrix {cfg.matrix} is for {matrix.world_size} ranks; the job "
                                       f"has {dist.get_world_size()}")
        topo = engine.module._topo
        P, D = engine.num_stages, engine.grid.data_parallel_size
        self.placement = Placement.from_ranks([[topo.get_rank(pipe=s, data=d) for d in range(D)] for s in range(P)])
        self.cfg, self.budget, self.matrix, self.S = cfg, budget, matrix, P  # the engine's budget, read when deciding
        self.orchestrator: Optional[Orchestrator] = None  # built at the first boundary (gradient sizes gathered)
        self._settled = False  # ``Orchestrator.settled`` after the last exchange (the same on every rank)

    @property
    def width(self) -> int:
        return 5 * self.S

    def row(self, engine, records) -> torch.Tensor:
        """This rank's stage's all-reduce ms, F/B/W per micro-batch and gradient MB (zeros elsewhere)."""
        S, s = self.S, engine.stage_id
        row = torch.zeros(self.width, dtype=torch.float64)
        row[s] = sum(r.end_ns - r.start_ns for r in records if r.op == "ReduceGrads") / 1e6
        row[S + 3 * s: S + 3 * s + 3] = torch.tensor(fbw_ms_per_microbatch(records, engine.micro_batches))
        row[4 * S + s] = sum(p.numel() * p.element_size() for p in engine.module.parameters()) / 1e6
        return row

    def decide(self, engine, table: torch.Tensor, sync_ms: float, exchange_ms: float) -> Optional[Remap]:
        """The same ``Remap`` or None on every rank, for the slowest replica of each stage: every rank
        detects, and rank 0 searches and broadcasts only when the detection says a search is due."""
        table = table.amax(dim=0)
        S = self.S
        orchestrator = self._orchestrator(engine, table)
        if not orchestrator.due(table[:S].tolist()):
            self._settled = orchestrator.settled
            return None
        box = [None]
        if dist.get_rank() == 0:
            try:
                box[0] = {"ranks": self._search(orchestrator, table), "searched": orchestrator.searched()}
            except Exception as e:  # noqa: BLE001 - every rank waits in the broadcast: tell them, then fail
                box[0] = {"error": f"{type(e).__name__}: {e}"}
        dist.broadcast_object_list(box, src=0, group=engine.migrator.vote_group())
        if "error" in box[0]:
            raise RuntimeError(f"orchestrate: rank 0 failed to decide: {box[0]['error']}")
        if dist.get_rank() != 0:
            orchestrator.adopt(*box[0]["searched"])
        self._settled = orchestrator.settled
        return None if box[0]["ranks"] is None else Remap(box[0]["ranks"])

    def quiet(self) -> bool:
        """The orchestrator (the same on every rank) acted already or sees every stage's all-reduce
        within its noise."""
        return self._settled

    def _orchestrator(self, engine, table) -> Orchestrator:
        """The orchestrator, built at the first exchange (the gradient sizes come with the table),
        told the boundary's iteration and the caps in force."""
        S = self.S
        if self.orchestrator is None:
            grad = [self.cfg.grad_mb if self.cfg.grad_mb is not None else table[4 * S + k].item() for k in range(S)]
            self.orchestrator = Orchestrator(self.matrix, self.placement, engine.micro_batches, grad,
                                             self.cfg.chunk_mb, list(self.budget.caps), self.cfg.noise,
                                             self.cfg.patience, self.cfg.min_gain)
        self.orchestrator.iteration = engine.boundary.iteration  # exchanges may skip iterations: count these
        self.orchestrator.caps = list(self.budget.caps)
        return self.orchestrator

    def _search(self, orchestrator: Orchestrator, table) -> Optional[list[list[int]]]:
        """Rank 0, when a search is due: the placement to re-map to, or None."""
        S = self.S
        d = orchestrator.search(table[S:4 * S].view(S, 3).tolist())
        if d is None:
            return None
        logger.warning(f"pipemorph: orchestrate: the all-reduce of stages took {[round(x, 1) for x in d.measured_allreduce_ms]} "
                       f"ms (fixed cost per all-reduce {d.overhead_ms:.1f} ms); re-mapping to {d.ranks} (predicted "
                       f"{d.current_ms:.0f} -> {d.predicted_ms:.0f} ms; decided in {d.seconds:.1f} s)")
        return d.ranks
