"""For training scripts: a config error ends the job with one sentence and exit code 2, no traceback.

``ds_pipemorph.initialize`` (and the engine it builds) raise ``PipeMorphConfigError`` on every rank
for a setting that cannot be used, and ``UnsupportedDeepSpeedError`` for a DeepSpeed without the
engine hooks; library code keeps raising them. A script's entry point wraps its start-up in
``exit_on_config_error()``: rank 0 prints the message once, every rank releases its process groups
and exits 2 (``shutdown.exit_process``), so a launcher shows one sentence per job instead of one
traceback per rank::

    with exit_on_config_error():
        engine, *_ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(), config=path)
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager

from .config import PipeMorphConfigError
from .ds_compat import UnsupportedDeepSpeedError
from .shutdown import exit_process

EXIT_CODE = 2


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


@contextmanager
def exit_on_config_error(code: int = EXIT_CODE):
    """Turn ``PipeMorphConfigError`` / ``UnsupportedDeepSpeedError`` into ``error: <sentence>`` on rank 0's
    stderr and exit code ``code`` on every rank; anything else propagates unchanged."""
    try:
        yield
    except (PipeMorphConfigError, UnsupportedDeepSpeedError) as e:
        if _rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        exit_process(code)  # the groups made so far released, no interpreter teardown (runtime.shutdown)
