"""Ending a training process in order, so that no background thread outlives the interpreter.

A process group's gloo worker threads run until the group is destroyed, and the group lives as long
as anything refers to it: DeepSpeed keeps its pipeline grid (and with it every group) in module
globals, and a group can stay referenced from C++ after ``destroy_process_group``. Such a group's
threads are still there while Python finalizes; a worker that releases its last work then (the
tensors it holds have Python objects, so it needs the GIL) is ended by Python with
``pthread_exit``, whose unwinding through C++ destructors calls ``std::terminate``: the process
aborts with "terminate called without an active exception" after training finished, now and then,
more often on a loaded host.

``exit_process`` ends the process so that this cannot happen: the engine's own workers stop
(``engine.destroy``: delegate processes, receive threads, the re-plan worker), every process group
is destroyed and DeepSpeed's references to them are dropped (the groups nothing else holds are
freed now, which joins their threads), the ``atexit`` handlers run, the output is flushed (Python's
streams and the C library's buffers), and the process exits with ``os._exit``, without the interpreter
teardown a remaining gloo thread could run into. Call it from a training script's entry point, on
every rank, after the last step::

    code = main()          # returns once training is done (engine.destroy() at its end, or pass engine=)
    exit_process(code)

A script that simply returns needs none of it: ``ds_pipemorph.initialize`` registers
``release_at_exit``, so a normal interpreter exit stops the engines' workers and releases the
groups (joining their threads) before Python finalizes.
"""
from __future__ import annotations

import atexit
import ctypes
import gc
import logging
import os
import sys
import weakref
from typing import NoReturn


def release_process_groups() -> None:
    """Destroy every process group and drop DeepSpeed's module-level references to them, then collect:
    a group nothing else holds is freed here, which stops and joins its threads."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    try:
        from deepspeed.runtime.pipe import p2p
        from deepspeed.utils import groups
    except ImportError:  # pragma: no cover - DeepSpeed is a dependency
        pass
    else:
        p2p._groups, p2p._grid, p2p._async = None, None, []
        groups.mpu = None
    gc.collect()


_engines: "weakref.WeakSet" = None


def release_at_exit(engine) -> None:
    """At a normal interpreter exit, before finalization: stop ``engine``'s workers (if nobody did)
    and release the process groups. Registered once per process; every engine built is remembered
    weakly."""
    global _engines
    if _engines is None:
        _engines = weakref.WeakSet()
        atexit.register(_release_all)
    _engines.add(engine)


def skip_release() -> None:
    """An exit on an error (``runtime.errors``): the engines are not stopped in order and the groups
    not released at exit, either of which could wait on a lock a background thread holds or on a
    peer that no longer answers (the process ends with ``os._exit`` right after)."""
    atexit.unregister(_release_all)


def _release_all() -> None:
    for engine in list(_engines or ()):
        try:
            engine.destroy()
        except Exception as e:  # noqa: BLE001  (at exit: say it, release the groups anyway)
            print(f"ds_pipemorph: stopping the engine at exit failed: {e}", file=sys.stderr, flush=True)
    _engines.clear()
    release_process_groups()


def exit_process(code: int = 0, engine=None) -> NoReturn:
    """Stop ``engine``'s workers (if given), release the process groups, run the ``atexit`` handlers,
    flush, and exit with ``code`` without the interpreter teardown (see the module docstring)."""
    if engine is not None:
        engine.destroy()
        del engine
    release_process_groups()
    atexit._run_exitfuncs()  # what a normal exit runs first: the control loop's profile, logging's flush
    logging.shutdown()
    flush_all()
    os._exit(code)


def flush_all() -> None:
    """Flush Python's standard streams and the C library's buffers (before an ``os._exit``)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to say
            pass
    _flush_c_stdio()


def _flush_c_stdio() -> None:
    """Flush the C library's stdio buffers (output of C/C++ code, fully buffered when stdout is a
    file), which ``os._exit`` would drop."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to load, or one without fflush
        pass
