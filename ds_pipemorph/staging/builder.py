"""DeepSpeed op builders that JIT-build the host-staging ring from ``cuda_ext/``.

Cache keying: the op NAME carries the DeepSpeed and torch versions (and the CUDA version for the CUDA op), e.g.
``pipemorph_staging_cpu_ds0_19_8_torch2_13_0_cpu``. torch caches a JIT build in
``$TORCH_EXTENSIONS_DIR/<py>_<cpu|cuXY>/<NAME>`` and DeepSpeed keeps loaded ops in a dict keyed by NAME, so a
build left by another DeepSpeed or torch version is never picked up (that stale cache is what breaks a job with
an AttributeError). We do not set TORCH_EXTENSIONS_DIR: it is process-global and would also move DeepSpeed's own
ops and any other extension the user builds (tests/conftest.py does set a version-keyed one for the test
session; the two compose). torch rebuilds when a source file or a flag changes, ninja's depfiles when a header
does. Sources: ``cuda_ext_dir()``.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import torch
from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder

_SOURCES_ENV = "PIPEMORPH_CUDA_EXT_DIR"


def cuda_ext_dir() -> Path:
    """Directory of the C++/CUDA sources: ``$PIPEMORPH_CUDA_EXT_DIR`` if set; else the copy an installed
    wheel carries as package data (``ds_pipemorph/staging/cuda_ext/``, see setup.py); else ``cuda_ext/``
    of the repository checkout this package runs from (an editable install, or tests)."""
    override = os.environ.get(_SOURCES_ENV)
    if override:
        return Path(override).resolve()
    packaged = Path(__file__).resolve().parent / "cuda_ext"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "cuda_ext"


def _ident(text: str) -> str:
    return re.sub(r"[^0-9A-Za-z]+", "_", text).strip("_")


def version_tag(with_cuda: bool = False) -> str:
    """``ds<deepspeed>_torch<torch>[_cu<cuda>]`` as a Python identifier (the op name must be one)."""
    import deepspeed

    tag = f"ds{_ident(deepspeed.__version__)}_torch{_ident(torch.__version__)}"
    if with_cuda:
        tag += f"_cu{_ident(torch.version.cuda or 'none')}"
    return tag


def _cxx_std() -> str:
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return "-std=c++20" if (major, minor) >= (2, 12) else "-std=c++17"


def _sources_present(builder: OpBuilder) -> bool:
    missing = [s for s in builder.sources() if not os.path.isfile(s)]
    if missing:
        builder.warning(f"{builder.name}: source files not found: {', '.join(missing)} (set {_SOURCES_ENV})")
    return not missing


class StagingRingBuilder(OpBuilder):
    """CPU staging ring: POSIX shared memory + atomic slot flags, memcpy in and out."""

    BUILD_VAR = "DS_BUILD_PIPEMORPH_STAGING"

    def __init__(self, name: str | None = None):
        super().__init__(name=name or f"pipemorph_staging_cpu_{version_tag()}")

    def absolute_name(self) -> str:
        return f"ds_pipemorph.staging.{self.name}"

    def core_sources(self) -> list[str]:
        d = cuda_ext_dir()
        return [str(d / "staging_ring.cpp"), str(d / "staging_ring_cpu.cpp")]

    def sources(self) -> list[str]:
        # Absolute paths: DeepSpeed resolves relative ones inside deepspeed/ops.
        return self.core_sources()

    def include_paths(self) -> list[str]:
        return [str(cuda_ext_dir())]

    def cxx_args(self) -> list[str]:
        return ["-O3", _cxx_std(), "-Wall", "-Wno-unused-function"]

    def extra_ldflags(self) -> list[str]:
        return ["-lrt"]

    def is_compatible(self, verbose: bool = False) -> bool:
        if not sys.platform.startswith("linux"):
            self.warning(f"{self.name} needs Linux (POSIX shared memory); this is {sys.platform}")
            return False
        return _sources_present(self) and super().is_compatible(verbose)


class StagingRingCUDABuilder(CUDAOpBuilder):
    """CUDA staging ring: the CPU ring plus pinned (cudaHostRegister'ed) slots and async D2H/H2D copies."""

    BUILD_VAR = "DS_BUILD_PIPEMORPH_STAGING_CUDA"

    def __init__(self, name: str | None = None):
        super().__init__(name=name or f"pipemorph_staging_cuda_{version_tag(with_cuda=True)}")

    def absolute_name(self) -> str:
        return f"ds_pipemorph.staging.{self.name}"

    def sources(self) -> list[str]:
        d = cuda_ext_dir()
        return StagingRingBuilder().core_sources() + [
            str(d / "staging_ring_cuda.cu"),
            str(d / "staging_ring_cuda_bind.cpp"),
        ]

    def include_paths(self) -> list[str]:
        return [str(cuda_ext_dir())]

    def cxx_args(self) -> list[str]:
        return super().cxx_args() + ["-DPIPEMORPH_STAGING_WITH_CUDA"]

    def extra_ldflags(self) -> list[str]:
        return ["-lrt"]

    def is_compatible(self, verbose: bool = False) -> bool:
        if not torch.cuda.is_available():
            self.warning(f"{self.name} needs a CUDA GPU and a CUDA build of torch; none is available here")
            return False
        if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
            self.warning(f"{self.name} needs nvcc (CUDA toolkit) to JIT-build")
            return False
        return _sources_present(self) and super().is_compatible(verbose)
