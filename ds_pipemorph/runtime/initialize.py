"""``ds_pipemorph.initialize``: ``deepspeed.initialize`` for a PipelineModule, running a PipeMorph plan.

Same arguments and return value as ``deepspeed.initialize``. The ``"pipemorph"`` section of the
config is validated, removed from what DeepSpeed sees, and turned into a plan; every problem
(bad key, unknown schedule, a plan for another pipeline, an invalid plan) raises
``PipeMorphConfigError`` with one sentence on every rank before any training step.
"""
from __future__ import annotations

import copy
import json
import logging
import os
from typing import Any, Optional

logger = logging.getLogger(__name__)


def initialize(args: Any = None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port: Optional[int] = None, mpu=None,
               dist_init_required: Optional[bool] = None, collate_fn=None, config=None, mesh_param=None,
               config_params=None):
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.pipe.module import PipelineModule

    from .config import PipeMorphConfigError, parse_config, pending_notes
    from ..fileio import BadInput
    from .engine import PipeMorphEngine
    from .inject import delay_schedule
    from .plans import build_plan

    if not isinstance(model, PipelineModule):
        raise PipeMorphConfigError("ds_pipemorph.initialize needs a deepspeed PipelineModule as model")
    if mpu is not None:
        raise PipeMorphConfigError("mpu must be None with pipeline parallelism (the PipelineModule provides it)")
    if mesh_param is not None:
        raise PipeMorphConfigError("mesh_param is not supported with pipeline parallelism")
    if config is None and config_params is not None:
        config = config_params
    if config is None and args is not None and getattr(args, "deepspeed_config", None):
        config = args.deepspeed_config
    if config is None:
        raise PipeMorphConfigError("no DeepSpeed config: pass config= (a dict or a JSON path)")
    ds_dict = _load_config(config)
    pm = parse_config(ds_dict.pop("pipemorph", None))
    from deepspeed.accelerator import get_accelerator
    from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT

    deepspeed.zero.partition_parameters.shutdown_init_context()
    dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                          distributed_port=distributed_port or TORCH_DISTRIBUTED_DEFAULT_PORT,
                          dist_init_required=dist_init_required)
    ds_mpu = model.mpu()
    config_class = DeepSpeedConfig(ds_dict, ds_mpu)
    deepspeed.set_optimizer_flags(config_class, model)
    plan = build_plan(pm, model.num_stages, config_class.gradient_accumulation_steps)
    try:
        delays = delay_schedule(pm.inject, model.num_stages)
    except BadInput as e:
        raise PipeMorphConfigError(str(e)) from None
    if pm.delegation.mode != "off" and pm.delegation.interfaces:
        from .delegate_proc import missing_interfaces

        missing = missing_interfaces(pm.delegation.interfaces)
        if missing:
            raise PipeMorphConfigError(missing)
    if dist.get_rank() == 0:
        for note in pending_notes(pm):
            logger.warning(note)
    engine = PipeMorphEngine(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                             training_data=training_data, lr_scheduler=lr_scheduler, mpu=ds_mpu,
                             dist_init_required=dist_init_required, collate_fn=collate_fn, config=ds_dict,
                             config_class=config_class, pipemorph=pm, plan=plan, delays=delays)
    deepspeed.zero.partition_parameters.restore_init_context()
    engine._configure_python_gc()
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _load_config(config) -> dict:
    from .config import PipeMorphConfigError

    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise PipeMorphConfigError(f"DeepSpeed config {config}: cannot be read as JSON ({e})") from None
        if not isinstance(data, dict):
            raise PipeMorphConfigError(f"DeepSpeed config {config}: expected a JSON object")
        return data
    raise PipeMorphConfigError(f"DeepSpeed config must be a dict or a JSON path, got {type(config).__name__}")
