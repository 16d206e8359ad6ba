"""The rebalance loop in the engine: measure every stage, decide (``control.rebalance``), migrate.

At each iteration boundary every rank contributes one row: its stage's mean F, B and W per
micro-batch (from the op records, so an injected or real slowdown counts) and, for each layer it
holds, its parameter count and its signature (``layer_signature``: layers with equal signatures
cost the same on every stage, which is how the loop tells a stage slow from the start from a healthy
one). The rows travel in the boundary's one all-gather (``runtime.boundary``; a
few hundred bytes), and every rank runs the same ``Rebalancer`` on the same table (the slowest
replica of each stage; no wall clock in the decision), so every rank reaches the same ``Migration``
without another message. The engine runs it (``LayerMigrator.migrate`` on every rank); if it
succeeds everywhere, the partition's plan replaces a ``zb`` schedule's (``1f1b`` and ``plan`` keep
the order the user chose; ``adaptive`` re-plans from its own measurements, which now come from the
new partition).
"""
from __future__ import annotations

import hashlib
import logging
from typing import Optional

import torch
from deepspeed.pipe import TiedLayerSpec

from ..control.rebalance import Rebalancer
from ..fileio import BadInput
from ..plan.partition.layer_profile import read_layer_profile
from .boundary import Migration
from .config import PipeMorphConfigError
from .oprecords import fbw_ms_per_microbatch

logger = logging.getLogger(__name__)


class RebalanceLoop:
    """The rebalance loop's ``runtime.boundary.BoundaryLoop``: its row, and every rank's same ``Migration``."""

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
        self.S, self.layers = S, layers
        self.events: list[dict] = []  # one per decision: what was decided and what the migration did

    @property
    def width(self) -> int:
        return 3 * self.S + 2 * self.layers

    def row(self, engine, records) -> torch.Tensor:
        """This rank's stage's F, B, W per micro-batch, then its layers' parameter counts, then their
        signatures (zeros for the layers it does not hold)."""
        S, L = engine.num_stages, self.layers
        row = torch.zeros(self.width, dtype=torch.float64)
        row[3 * engine.stage_id: 3 * engine.stage_id + 3] = torch.tensor(fbw_ms_per_microbatch(records, engine.micro_batches))
        for i, func in enumerate(engine.module.forward_funcs):
            if isinstance(func, torch.nn.Module):
                layer = engine.module._local_start + i
                row[3 * S + layer] = sum(p.numel() for p in func.parameters())
                row[3 * S + L + layer] = layer_signature(func)
        return row

    def decide(self, engine, table: torch.Tensor, sync_ms: float, exchange_ms: float) -> Optional[Migration]:
        """The same ``Migration`` on every rank, or None; per stage, its slowest replica counts."""
        S = self.S
        L = self.layers
        table = table.amax(dim=0)
        self.rebalancer.iteration = engine.boundary.iteration  # exchanges may skip iterations: count these
        decision = self.rebalancer.observe(table[:3 * S].view(S, 3).tolist(), table[3 * S:3 * S + L].tolist(),
                                           [int(x) for x in table[3 * S + L:].tolist()])
        if decision is None:
            return None
        event = {"iteration": decision.iteration, "parts": decision.parts,
                 "slowdown": [round(x, 3) for x in decision.slowdown], "current_ms": round(decision.current_ms, 3),
                 "predicted_ms": round(decision.predicted_ms, 3)}
        # ``zb`` follows the partition; ``1f1b`` and ``plan`` keep the order the user chose, and
        # ``adaptive`` re-plans from its own measurements, which now come from the new partition.
        plan = decision.plan if engine.pipemorph.schedule == "zb" else None
        return Migration(list(decision.parts), plan, event)

    def quiet(self) -> bool:
        """Layer costs known and, at the last observation, every stage within ``noise`` of its
        reference: a drift must last ``patience`` observations, and one that starts brings the next
        exchange to the next iteration, so they are iterations in a row."""
        r = self.rebalancer
        if r.profile is None or not r.history:  # learning, or nothing observed since the last decision
            return False
        return all(ref / (1.0 + r.noise) <= x <= ref * (1.0 + r.noise) for x, ref in zip(r.history[-1], r.reference))

    def applied(self, engine, migration: Migration, report, seconds: float) -> None:
        """Every rank, after the engine ran ``migration``: the loop's bookkeeping and one log line."""
        event = {**migration.event, "ok": report.ok, "seconds": round(seconds, 4), "bytes_sent": report.bytes_sent,
                 "bytes_received": report.bytes_received, "reason": report.reason}
        if report.ok:
            self.rebalancer.moved(migration.parts)
        else:
            self.rebalancer.failed()
        self.events.append(event)
        if engine.global_rank == 0:
            logger.warning(f"pipemorph: rebalance: predicted slowdowns {event['slowdown']} -> parts {migration.parts} "
                           f"({event['current_ms']:.0f} -> {event['predicted_ms']:.0f} ms predicted): "
                           f"{report.describe()}")


# Signatures travel in the float64 boundary row: below 2**53 every integer is exact.
SIGNATURE_BITS = 52


def layer_signature(module: torch.nn.Module) -> int:
    """A number equal for layers that compute the same thing with the same parameters' shapes, on
    every rank (a hash of the layer's type and its parameters' names, shapes, dtypes and whether
    they train: a frozen layer has no W); 0 for a layer without parameters, which joins no class.
    Python's own ``hash`` of a string differs between processes, so a fixed digest is used."""
    params = [(name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in module.named_parameters()]
    if not params:
        return 0
    text = f"{type(module).__module__}.{type(module).__qualname__}:{params}"
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
    return 1 + digest % (2**SIGNATURE_BITS - 1)
