"""Loaded by every Python process the test session starts (``tests/conftest.py`` puts this folder
first on ``PYTHONPATH`` and sets the variables below).

DeepSpeed's CPU op builders ask py-cpuinfo what the CPU is each time a rank first loads an op
(``-march`` and SIMD flags, twice per process), and py-cpuinfo answers by starting two Python
processes: about 0.7 s of CPU per question, 1.4 s per rank of every job the session starts. The
answer is this machine's, the same for every process: the first process to ask writes it to the
file ``PIPEMORPH_TEST_CPUINFO`` names, the others read it there.

With ``PIPEMORPH_TEST_GC_FREEZE`` set, the garbage collector stops walking every object alive when
``import torch`` and ``import deepspeed`` are done (``gc.freeze``; not once a process group exists:
what a job made is left to the collector), and, at exit, what the process still holds (``gc.freeze``
after every other atexit handler: registered first, it runs last). Those walks cost about 0.6 s of
CPU during a rank's run (a 4-rank ``recipes/tiny_gpt/train.py --steps 40``: 1.0 s of collection per
rank, 0.4 s frozen) and 0.5 s at its exit, in hundreds of processes per session. Frozen objects are
still freed as their references go; only reference cycles among them are never collected (and Python
does not promise to run finalizers at exit). Every script and worker the tests start imports torch
and DeepSpeed before it builds a model, a process group or an engine. The tests of how a process ends
run without it. Nothing else changes; without the variables this module does nothing.
"""
import atexit
import gc
import importlib.abc
import importlib.machinery
import json
import os
import sys

_CACHE = os.environ.get("PIPEMORPH_TEST_CPUINFO")
_FREEZE = bool(os.environ.get("PIPEMORPH_TEST_GC_FREEZE"))


def _cached(real):
    def get_cpu_info():
        try:
            with open(_CACHE) as f:
                return json.load(f)
        except (OSError, ValueError):
            pass
        info = real()
        if not info.get("arch"):  # py-cpuinfo's own process failed: ask again next time, keep nothing
            return info
        tmp = f"{_CACHE}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, _CACHE)  # whole or not at all: a reader never sees half of it
        return info
    return get_cpu_info


def _wrap_cpuinfo(module) -> None:
    module.get_cpu_info = _cached(module.get_cpu_info)


def _freeze(_module) -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return  # a job's objects exist: they stay the collector's
    gc.freeze()


# module name -> what runs once the module is imported
_AFTER = {**({"cpuinfo": _wrap_cpuinfo} if _CACHE else {}),
          **({"torch": _freeze, "deepspeed": _freeze} if _FREEZE else {})}


class _AfterImport(importlib.abc.MetaPathFinder):
    """When a module of ``_AFTER`` is imported, run its function on it."""

    def find_spec(self, name, path, target=None):
        if name not in _AFTER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run, after = spec.loader.exec_module, _AFTER[name]

        def exec_module(module):
            run(module)
            after(module)
        spec.loader.exec_module = exec_module
        return spec


if _AFTER:
    sys.meta_path.insert(0, _AfterImport())

if _FREEZE:
    atexit.register(gc.freeze)
