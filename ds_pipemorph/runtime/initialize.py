"""``ds_pipemorph.initialize``: ``deepspeed.initialize`` for a PipelineModule, running a PipeMorph plan.

Same parameters (names, order, defaults) and return value as ``deepspeed.initialize``, and the same
config forms: a dict, the path of a JSON file, or base64-encoded JSON (what the deepspeed launcher's
``--deepspeed_config`` may carry), read by DeepSpeed's own ``load_ds_config``; ``config`` and
``args.deepspeed_config`` together are refused as DeepSpeed refuses them. The ``"pipemorph"``
section of the config is validated, removed from what DeepSpeed sees, and turned into a plan.

Refused in one sentence on every rank before any training step: a DeepSpeed without the engine
hooks PipeMorph runs through (``UnsupportedDeepSpeedError``, checked before the process group is
touched), and every config problem (bad key, unknown schedule, a plan for another pipeline, an
invalid plan: ``PipeMorphConfigError``).

Relative file paths in the ``pipemorph`` section (``plan_file``, ``inject.trace``, ...:
``config.path_keys()``) are resolved against the config file's directory when the config is a file,
else against the working directory (``paths_base``); errors name the absolute path tried.

On a CPU accelerator with ``OMP_NUM_THREADS`` unset, each rank's intra-op threads are set to its
share of the host's cores (``cpu_threads``), and rank 0 logs the choice. Once the engine is built,
rank 0 logs one line naming the schedule, the dispatch and the plan in force with its predicted
iteration time.
"""
from __future__ import annotations

import copy
import logging
import os
from typing import Any, Optional

from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT

from ..fileio import first_line

logger = logging.getLogger(__name__)


def initialize(args: Any = None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, mpu=None,
               dist_init_required: Optional[bool] = None, collate_fn=None, config=None, mesh_param=None,
               config_params=None):
    from .errors import install

    install()  # an error of ours that the script does not catch: one sentence, no traceback (runtime.errors)
    return build_engine(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                        training_data=training_data, lr_scheduler=lr_scheduler, distributed_port=distributed_port,
                        mpu=mpu, dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                        mesh_param=mesh_param, config_params=config_params, announce=True)


def _release_cpu_buffers_at_exit(dist) -> None:
    """On the CPU accelerator, once per process: this rank's DeepSpeed all-reduce buffer is removed
    at exit, or by its reaper if the process is killed (``runtime.cpu_shm``), after a barrier that
    every rank reaches once its start of communication opened every buffer. ``initialize`` runs it
    before reading the config when the script started communication itself (a refused config then
    leaves nothing behind), else right after starting it."""
    from deepspeed.accelerator import get_accelerator

    from . import cpu_shm, reaper

    if cpu_shm.registered() or get_accelerator().device_name() != "cpu":
        return
    dist.barrier()
    cpu_shm.remove_allreduce_buffer_at_exit(dist.get_rank())
    reaper.watch(cpu_shm.allreduce_buffer(dist.get_rank()))


def build_engine(args: Any = None, model=None, optimizer=None, model_parameters=None, training_data=None,
                 lr_scheduler=None, distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, mpu=None,
                 dist_init_required: Optional[bool] = None, collate_fn=None, config=None, mesh_param=None,
                 config_params=None, *, announce: bool = True):
    """``initialize``'s work; with ``announce`` rank 0 logs the start-up line (``plans.describe_start``).
    A re-mapping builds its new engine without it: it logs its own line, and the plan in force carries over."""
    from .ds_compat import require_pipeline_hooks

    require_pipeline_hooks()  # before anything else: never train stock 1F1B in PipeMorph's place

    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.pipe.module import PipelineModule

    from ..fileio import BadInput
    from .config import PipeMorphConfigError, parse_config, pending_notes, resolve_paths
    from .cpu_threads import apply_cpu_threads
    from .engine_builder import EngineBuilder
    from .engine import PipeMorphEngine
    from .plans import build_plan, describe_start, w_share
    from ..staging.builder import prepare_adam_op, prepare_comm_op

    if dist.is_initialized():  # the script started communication itself: nothing it made may outlive a refusal
        _release_cpu_buffers_at_exit(dist)
    config = _config_source(args, config, config_params)
    if not isinstance(model, PipelineModule):
        raise PipeMorphConfigError("ds_pipemorph.initialize needs a deepspeed PipelineModule as model")
    if mpu is not None:
        raise PipeMorphConfigError("mpu must be None with pipeline parallelism (the PipelineModule provides it)")
    if mesh_param is not None:
        raise PipeMorphConfigError("mesh_param is not supported with pipeline parallelism")
    ds_dict = load_config(config)
    section = resolve_paths(ds_dict.pop("pipemorph", None), paths_base(config))
    pm = parse_config(section)
    as_given = dict(copy.deepcopy(ds_dict), pipemorph=copy.deepcopy(section) or {})
    # What re-mapping (runtime.remap) needs to build this engine again on another topology.
    builder = EngineBuilder(build_engine, args=args, optimizer=optimizer, lr_scheduler=lr_scheduler,
                            training_data=training_data, collate_fn=collate_fn, config=as_given)

    threads = apply_cpu_threads(get_accelerator().device_name())
    prepare_comm_op()  # the first start on a CPU builds DeepSpeed's collectives op in init_distributed
    deepspeed.zero.partition_parameters.shutdown_init_context()
    dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                          distributed_port=distributed_port, dist_init_required=dist_init_required)
    if threads is not None and dist.get_rank() == 0:
        logger.warning(threads.describe())
    _release_cpu_buffers_at_exit(dist)
    check_outputs(pm, dist)
    ds_mpu = model.mpu()
    config_class = DeepSpeedConfig(ds_dict, ds_mpu)
    deepspeed.set_optimizer_flags(config_class, model)
    share = w_share(getattr(model, "activation_checkpoint_interval", 0) > 0)
    plan = build_plan(pm, model.num_stages, config_class.gradient_accumulation_steps, share)
    if pm.delegation.mode != "off" and pm.delegation.interfaces:
        from .transport.delegated.delegate_proc import missing_interfaces

        missing = missing_interfaces(pm.delegation.interfaces)
        if missing:
            raise PipeMorphConfigError(missing)
    if dist.get_rank() == 0:
        for note in pending_notes(pm):
            logger.warning(note)
    prepare_adam_op(config_class, optimizer)
    engine = PipeMorphEngine(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                             training_data=training_data, lr_scheduler=lr_scheduler, mpu=ds_mpu,
                             dist_init_required=dist_init_required, collate_fn=collate_fn, config=ds_dict,
                             config_class=config_class, pipemorph=pm, plan=plan, builder=builder)
    deepspeed.zero.partition_parameters.restore_init_context()
    engine._configure_python_gc()
    _start_lifeline(engine)
    if announce and dist.get_rank() == 0:
        logger.warning(describe_start(pm, plan, model.num_stages, config_class.gradient_accumulation_steps, share))
    if pm.orchestrate.matrix:  # re-mapping replaces the engine: the training loop holds a handle to it
        from .engine_handle import EngineHandle
        from .remap import check_remappable

        try:  # now, not at the first re-mapping, hours into training
            check_remappable(engine, engine.module._topo)
        except BadInput as e:
            raise PipeMorphConfigError(f"orchestrate.matrix is set, but {e}") from None

        return EngineHandle(engine), engine.optimizer, engine.training_dataloader, engine.lr_scheduler
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def check_outputs(pm, dist) -> None:
    """The section's output files (``timeline``, ``profile_out``: rank 0 writes them) can be written:
    checked on rank 0 now, before any rank trains, and refused on every rank in one sentence."""
    from ..fileio import BadInput, check_writable
    from .config import PipeMorphConfigError

    problem = [None]
    if dist.get_rank() == 0:
        for key in ("timeline", "profile_out"):
            path = getattr(pm, key)
            if path:
                try:
                    check_writable(path, f"pipemorph.{key}")
                except BadInput as e:
                    problem[0] = str(e)
                    break
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise PipeMorphConfigError(problem[0])


def _start_lifeline(engine) -> None:
    """This process's lifeline (``runtime.lifeline``): its pipeline neighbours watched, SIGINT/SIGTERM
    caught, the delegates stopped and their rings unlinked when it stops the process. Needs the job's
    store (MASTER_ADDR, MASTER_PORT), as the delegated transport does."""
    from . import lifeline
    from .cpu_shm import remove_allreduce_buffer_now
    from .transport.delegated.transport import kill_all

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return
    ranks = [engine.grid.stage_to_global(s) for s in range(engine.num_stages)]
    stage_of = {r: s for s, r in enumerate(ranks)}
    fresh = lifeline.current() is None
    life = lifeline.start(engine.global_rank, addr, int(port), stage_of)
    life.set_timeout(engine.pipemorph.timeout_s)
    s = engine.stage_id
    life.watch_neighbours([ranks[i] for i in (s - 1, s + 1) if 0 <= i < len(ranks)], stage_of)
    if fresh:
        life.on_stop(kill_all)
        life.on_stop(remove_allreduce_buffer_now)
        life.catch_signals()


def _config_source(args, config, config_params):
    """The one config given, as ``deepspeed.initialize`` picks it (``config_params`` and
    ``args.deepscale_config`` are its older names)."""
    from .config import PipeMorphConfigError

    if config is None and config_params is not None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None)
    older = getattr(args, "deepscale_config", None)
    if older is not None:
        if from_args is not None:
            raise PipeMorphConfigError("args has both deepspeed_config and deepscale_config: keep deepspeed_config")
        logger.warning("--deepscale_config is deprecated, use --deepspeed_config")
        from_args = older
    if from_args is not None:
        if config is not None:
            raise PipeMorphConfigError(
                "the DeepSpeed config was given twice, as config= and as args.deepspeed_config "
                "(--deepspeed_config): pass only one")
        config = from_args
    if config is None:
        raise PipeMorphConfigError("no DeepSpeed config: pass config= (a dict, a JSON file path or base64-encoded "
                                   "JSON) or args.deepspeed_config (--deepspeed_config)")
    return config


def paths_base(config) -> str:
    """The directory relative paths of the ``pipemorph`` section are resolved against: the config
    file's when the config is a file, else the working directory (a dict, base64-encoded JSON)."""
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        return os.path.dirname(os.path.abspath(config))
    return os.getcwd()


def load_config(config) -> dict:
    """The config as a new dict: a dict (copied, since the pipemorph section is removed from it), a
    JSON file path (``str`` or ``os.PathLike``) or base64-encoded JSON, read as DeepSpeed reads it."""
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    from .config import PipeMorphConfigError

    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, os.PathLike):
        config = os.fspath(config)
    if not isinstance(config, str):
        raise PipeMorphConfigError(f"the DeepSpeed config must be a dict, a JSON file path or base64-encoded JSON, "
                                   f"got {type(config).__name__}")
    exists = os.path.exists(config)
    try:
        data = load_ds_config(config)
    except (OSError, ValueError) as e:
        if exists:
            raise PipeMorphConfigError(
                f"DeepSpeed config {config}: cannot be read as JSON ({first_line(e)})") from None
        raise PipeMorphConfigError(f"DeepSpeed config {_shorten(config)!r} is neither an existing file nor "
                                   f"base64-encoded JSON") from None
    if not isinstance(data, dict):
        where = config if exists else "(base64)"
        raise PipeMorphConfigError(f"DeepSpeed config {where}: expected a JSON object, got {type(data).__name__}")
    return dict(data)


def _shorten(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."
