"""The engine handle ``ds_pipemorph.initialize`` returns when ``orchestrate.matrix`` is set.

A re-mapping (``runtime.remap``) builds a new engine on the new topology; the training loop holds
the engine ``initialize`` returned, so that object must be able to change what it stands for.
``EngineHandle`` forwards everything to the engine in force and, after a ``train_batch`` whose
boundary decided to re-map (``engine.pending_remap``), re-maps and trains with the new engine from
the next call on. ``optimizer`` and ``lr_scheduler`` read through it are always the current ones
(those ``initialize`` returned next to it belong to the first engine). After a re-mapping a rank may
serve another data-parallel replica: read ``engine.grid.data_parallel_id`` for which batches to feed.
"""
from __future__ import annotations


class EngineHandle:
    """Stands for the engine in force: forwards to it, and swaps in the new one after a re-mapping."""

    def __init__(self, engine):
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "remaps", [])  # RemapReport of every re-mapping on this rank

    @property
    def engine(self):
        """The engine in force."""
        return self._engine

    @property
    def __class__(self):
        """The engine's class: ``isinstance(handle, PipelineEngine)`` holds, as code written for
        DeepSpeed (checkpoint tools, training frameworks) checks it."""
        return type(self._engine)

    def train_batch(self, data_iter=None):
        loss = self._engine.train_batch(data_iter)
        ranks = getattr(self._engine, "pending_remap", None)
        if ranks is not None:  # decided at this batch's boundary, the same on every rank
            from .topology_file import PlacedTopology

            self._engine.pending_remap = None
            fresh, report = self._engine.remap(PlacedTopology(ranks))
            self.remaps.append(report)
            if report.ok:
                object.__setattr__(self, "_engine", fresh)
            elif fresh.orchestrate is not None and fresh.orchestrate.orchestrator is not None:
                fresh.orchestrate.orchestrator.failed()  # every rank: decide again from the next iterations
        return loss

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def __setattr__(self, name, value):
        setattr(self._engine, name, value)

    def __repr__(self) -> str:
        return f"EngineHandle({self._engine!r})"
