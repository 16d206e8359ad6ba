"""For training scripts: a config error ends the job with one sentence and exit code 2, no traceback.

``ds_pipemorph.initialize`` (and the engine it builds) raise ``PipeMorphConfigError`` on every rank
for a setting that cannot be used, and ``UnsupportedDeepSpeedError`` for a DeepSpeed without the
engine hooks; library code keeps raising them. A script's entry point wraps its start-up in
``exit_on_config_error()``: rank 0 prints the message once, every rank leaves its process groups
and exits 2, so a launcher shows one sentence per job instead of one traceback per rank::

    with exit_on_config_error():
        engine, *_ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(), config=path)
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager

from .config import PipeMorphConfigError
from .ds_compat import UnsupportedDeepSpeedError

EXIT_CODE = 2


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _leave_process_groups() -> None:
    """Destroy this process's groups before exiting (gloo's threads must not outlive the interpreter)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway; the message already says what to fix
            pass


@contextmanager
def exit_on_config_error(code: int = EXIT_CODE):
    """Turn ``PipeMorphConfigError`` / ``UnsupportedDeepSpeedError`` into ``error: <sentence>`` on rank 0's
    stderr and ``SystemExit(code)`` on every rank; anything else propagates unchanged."""
    try:
        yield
    except (PipeMorphConfigError, UnsupportedDeepSpeedError) as e:
        if _rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        _leave_process_groups()
        raise SystemExit(code) from None
