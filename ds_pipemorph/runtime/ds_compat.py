"""Whether the installed DeepSpeed has the ``PipelineEngine`` hooks ``PipeMorphEngine`` runs through.

``PipeMorphEngine`` replaces DeepSpeed's training schedule by overriding ``_train_schedule`` (which
``train_batch`` calls from DeepSpeed 0.19.8 on; earlier versions build their 1F1B schedule inline)
and ``_exec_schedule``, extends ``_INSTRUCTION_MAP``, and calls a few of the engine's own methods.
On a DeepSpeed without them the override would simply not be called and stock 1F1B would train
instead, so ``ds_pipemorph.initialize`` refuses to start (``require_pipeline_hooks``) before it
touches the process group.
"""
from __future__ import annotations

import inspect

# The first DeepSpeed whose PipelineEngine.train_batch gets its schedule from ``_train_schedule``.
REQUIRED_DEEPSPEED = "0.19.8"

# Class attributes of PipelineEngine that PipeMorphEngine overrides or calls.
ENGINE_ATTRIBUTES = ("_train_schedule", "_exec_schedule", "_INSTRUCTION_MAP", "train_batch",
                     "reset_activation_shape", "_reserve_pipe_buffers", "_next_batch", "_scale_loss_by_gas",
                     "is_first_stage", "is_last_stage", "_configure_python_gc")
# Methods train_batch must call for the overrides to take effect.
TRAIN_BATCH_CALLS = ("_train_schedule", "_exec_schedule")


class UnsupportedDeepSpeedError(RuntimeError):
    """The installed DeepSpeed cannot run PipeMorph schedules; the message names the version needed."""


def missing_hooks(engine_cls=None) -> list[str]:
    """What ``PipeMorphEngine`` needs and ``engine_cls`` (DeepSpeed's PipelineEngine) lacks, in words."""
    if engine_cls is None:
        from deepspeed.runtime.pipe.engine import PipelineEngine as engine_cls
    from deepspeed.runtime.pipe import schedule

    missing = [name for name in ENGINE_ATTRIBUTES if not hasattr(engine_cls, name)]
    train_batch = getattr(engine_cls, "train_batch", None)
    if train_batch is not None:
        train_batch = inspect.unwrap(train_batch)  # through decorators made with functools.wraps
    called = set(getattr(getattr(train_batch, "__code__", None), "co_names", ()))
    missing += [f"a train_batch that calls {name}" for name in TRAIN_BATCH_CALLS
                if train_batch is not None and name not in called]
    handlers = getattr(engine_cls, "_INSTRUCTION_MAP", None)
    if handlers is not None:  # PipeMorph schedules end with DeepSpeed's own reductions and step
        missing += [f"a {kind} handler in _INSTRUCTION_MAP"
                    for kind in ("ReduceTiedGrads", "ReduceGrads", "OptimizerStep")
                    if getattr(schedule, kind, None) not in handlers]
    return missing


def require_pipeline_hooks(engine_cls=None) -> None:
    """Raise ``UnsupportedDeepSpeedError`` (one sentence) if the installed DeepSpeed lacks a hook."""
    missing = missing_hooks(engine_cls)
    if missing:
        import deepspeed

        raise UnsupportedDeepSpeedError(
            f"ds_pipemorph needs DeepSpeed >= {REQUIRED_DEEPSPEED} (installed: {deepspeed.__version__}): its "
            f"PipelineEngine lacks {_and(missing)}, so DeepSpeed's own 1F1B would train instead of the "
            f"PipeMorph schedule")


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
