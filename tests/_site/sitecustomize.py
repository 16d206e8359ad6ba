"""Loaded by every Python process the test session starts (``tests/conftest.py`` puts this folder
first on ``PYTHONPATH`` and names a file in ``PIPEMORPH_TEST_CPUINFO``).

DeepSpeed's CPU op builders ask py-cpuinfo what the CPU is each time a rank first loads an op
(``-march`` and SIMD flags, twice per process), and py-cpuinfo answers by starting two Python
processes: about 0.7 s of CPU per question, 1.4 s per rank of every job the session starts. The
answer is this machine's, the same for every process: the first process to ask writes it to the
file, the others read it there.

At its exit, after every other atexit handler (registered first, it runs last), a process moves the
objects it still holds out of the garbage collector's reach (``gc.freeze``), when
``PIPEMORPH_TEST_FREEZE_AT_EXIT`` is set: the interpreter's last collection then walks none of them.
That walk over torch's, DeepSpeed's and sympy's objects costs about 0.5 s of CPU in every process
that imported them, hundreds of processes per session. Objects are still freed as their references
go; only reference cycles alive at exit stay uncollected, whose finalizers Python does not promise to
run at exit. Nothing else changes; without the variables this module does nothing.
"""
import atexit
import gc
import importlib.abc
import importlib.machinery
import json
import os
import sys

_CACHE = os.environ.get("PIPEMORPH_TEST_CPUINFO")


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


class _WrapCpuinfo(importlib.abc.MetaPathFinder):
    """When ``cpuinfo`` is imported, replace its ``get_cpu_info`` with the cached one."""

    def find_spec(self, name, path, target=None):
        if name != "cpuinfo":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.get_cpu_info = _cached(module.get_cpu_info)
        spec.loader.exec_module = exec_module
        return spec


if _CACHE:
    sys.meta_path.insert(0, _WrapCpuinfo())

if os.environ.get("PIPEMORPH_TEST_FREEZE_AT_EXIT"):
    atexit.register(gc.freeze)
