"""What builds an engine again: ``ds_pipemorph.initialize``'s inputs and its build function.

``initialize`` makes one ``EngineBuilder`` per engine and hands it to the engine
(``engine.builder``); a re-mapping (``runtime.remap``) asks it for the same engine on a new topology
(``rebuild``). The builder carries the build function, so nothing that rebuilds an engine imports
the module that builds one: imports point from ``initialize`` down to the engine, never back.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class EngineBuilder:
    """``build`` is ``initialize.build_engine``; the rest is what it was given (``config``: the
    DeepSpeed config as given, ``pipemorph`` section included), except the model and its
    parameters, which a rebuild replaces."""

    build: Callable[..., tuple]
    args: Any = None
    optimizer: Any = None
    lr_scheduler: Any = None
    training_data: Any = None
    collate_fn: Any = None
    config: Optional[dict] = None

    def refusal(self) -> Optional[str]:
        """One sentence if an engine built from these inputs cannot be rebuilt on new parameters,
        else None: a client optimizer or scheduler given as an object (a callable or the config's
        can be made anew), or a DeepSpeed data loader (its position cannot move to another replica)."""
        for what in ("optimizer", "lr_scheduler"):
            given = getattr(self, what)
            if given is not None and not callable(given):
                return (f"re-mapping cannot rebuild a client {what} object for new parameters: give it in "
                        f"the DeepSpeed config or as a callable")
        if self.training_data is not None:
            return ("re-mapping cannot carry a DeepSpeed data loader's position to the new replica: feed "
                    "train_batch an iterator of the rank's replica's batches instead of training_data")
        return None

    def rebuild(self, model, model_parameters):
        """The engine again on ``model`` (a PipelineModule on the new topology) with
        ``model_parameters`` (its optimizer groups): the same config, optimizer and scheduler
        settings, without the start-up log line. Every rank calls it together (DeepSpeed forms its
        groups collectively). Returns the engine itself, not the handle ``initialize`` gives with
        ``orchestrate``."""
        args = copy.copy(self.args)
        for attr in ("deepspeed_config", "deepscale_config"):  # the config goes as config=, once
            if getattr(args, attr, None) is not None:
                setattr(args, attr, None)
        fresh, *_ = self.build(args=args, model=model, optimizer=self.optimizer, model_parameters=model_parameters,
                               lr_scheduler=self.lr_scheduler, collate_fn=self.collate_fn, config=self.config,
                               announce=False)
        return getattr(fresh, "engine", fresh)
