"""The rebalance loop in the engine: measure every stage, decide (``control.rebalance``), migrate.

At each iteration boundary every rank contributes one row: its stage's mean F, B and W per
micro-batch (from the op records, so an injected or real slowdown counts) and the parameter count
of each layer it holds. The rows are all-gathered over the migrator's gloo vote group (a few hundred
bytes), and every rank runs the same ``Rebalancer`` on the same table (the slowest replica of each
stage; no wall clock in the decision), so every rank reaches the same decision without another
message. A decision becomes ``LayerMigrator.migrate`` on every rank; if it succeeds everywhere, the
partition's plan replaces a ``zb`` schedule's (``1f1b`` and ``plan`` keep the order the user chose;
``adaptive`` re-plans from its own measurements, which now come from the new partition).
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch
from deepspeed.pipe import TiedLayerSpec

from ..control.rebalance import Rebalancer
from ..fileio import BadInput
from ..plan.layer_profile import read_layer_profile
from .config import PipeMorphConfigError
from .oprecords import fbw_ms_per_microbatch

logger = logging.getLogger(__name__)


class RebalanceHook:
    def __init__(self, engine, caps: list[int]):
        cfg = engine.pipemorph.rebalance
        S, N = engine.num_stages, engine.micro_batches
        layers = engine.module._num_layers
        profile = None
        if cfg.layer_profile:
            try:
                profile = read_layer_profile(cfg.layer_profile, stages=S, microbatches=N)
            except BadInput as e:
                raise PipeMorphConfigError(f"rebalance.layer_profile: {e}") from None
            if profile.num_layers != layers:
                raise PipeMorphConfigError(f"rebalance.layer_profile {cfg.layer_profile}: {profile.num_layers} layers, "
                                           f"but the model has {layers}")
        tied = tuple(i for i, spec in enumerate(engine.module._layer_specs) if isinstance(spec, TiedLayerSpec))
        self.rebalancer = Rebalancer(S, N, list(engine.module.parts), caps, noise=cfg.noise, patience=cfg.patience,
                                     min_gain=cfg.min_gain, warmup=cfg.warmup_iterations, profile=profile, pinned=tied)
        self.layers = layers
        self.events: list[dict] = []  # one per decision: what was decided and what the migration did

    def after_iteration(self, engine, records) -> Optional[dict]:
        S, L = engine.num_stages, self.layers
        row = torch.zeros(3 * S + L, dtype=torch.float64)
        row[3 * engine.stage_id: 3 * engine.stage_id + 3] = torch.tensor(fbw_ms_per_microbatch(records, engine.micro_batches))
        for i, func in enumerate(engine.module.forward_funcs):
            if isinstance(func, torch.nn.Module):
                row[3 * S + engine.module._local_start + i] = sum(p.numel() for p in func.parameters())
        table = engine.migrator.gather_max(row)  # per stage: its slowest replica
        stage_ms = table[:3 * S].view(S, 3).tolist()
        decision = self.rebalancer.observe(stage_ms, table[3 * S:].tolist())
        if decision is None:
            return None
        t = time.perf_counter()
        report = engine.migrator.migrate(engine, decision.parts)
        event = {"iteration": decision.iteration, "parts": decision.parts, "ok": report.ok,
                 "slowdown": [round(x, 3) for x in decision.slowdown], "current_ms": round(decision.current_ms, 3),
                 "predicted_ms": round(decision.predicted_ms, 3), "seconds": round(time.perf_counter() - t, 4),
                 "bytes_sent": report.bytes_sent, "bytes_received": report.bytes_received, "reason": report.reason}
        if report.ok:
            self.rebalancer.moved(decision.parts)
            if engine.pipemorph.schedule == "zb":
                engine._set_plan(decision.plan)
        else:
            self.rebalancer.failed()
        self.events.append(event)
        if engine.global_rank == 0:
            logger.warning(f"pipemorph: rebalance: predicted slowdowns {event['slowdown']} -> parts {decision.parts} "
                           f"({decision.current_ms:.0f} -> {decision.predicted_ms:.0f} ms predicted): "
                           f"{report.describe()}")
        return event
