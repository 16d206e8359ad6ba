"""DeepSpeed op builders that JIT-build the host-staging ring from ``cuda_ext/``.

Cache keying: the op NAME carries the DeepSpeed and torch versions (and the CUDA version for the CUDA op), e.g.
``pipemorph_staging_cpu_ds0_19_8_torch2_13_0_cpu``. torch caches a JIT build in
``$TORCH_EXTENSIONS_DIR/<py>_<cpu|cuXY>/<NAME>`` and DeepSpeed keeps loaded ops in a dict keyed by NAME, so a
build left by another DeepSpeed or torch version is never picked up (that stale cache is what breaks a job with
an AttributeError). We do not set TORCH_EXTENSIONS_DIR: it is process-global and would also move DeepSpeed's own
ops and any other extension the user builds (tests/conftest.py does set a version-keyed one for the test
session; the two compose). torch rebuilds when a source file or a flag changes, ninja's depfiles when a header
does. Sources: ``cuda_ext_dir()``.

A build interrupted by Ctrl-C or a kill leaves torch's build lock (``<NAME>/lock``, a plain file with
no owner) behind, and every later job waits for it forever without a word. So our ops build under
``build_guard``: an advisory lock beside the cache (``<NAME>.lock``, released by the kernel when its
holder dies, however it dies) is taken first; whoever holds it is the only process of ours building
that op, so a torch lock found then is left by a dead build and is removed, with one warning.

A JIT build takes tens of seconds to minutes on the first start and none later; ``announce_build`` logs one
line before a build that will really compile (no prebuilt op, nothing in the extension cache), for our
ring (``load``) and for the ops DeepSpeed builds inside its own code: its CPU collectives op, which
``deepspeed.init_distributed`` builds on a CPU accelerator (``announce_comm_build``, called before it), and
its FusedAdam op, which its engine builds for an "Adam" optimizer section (``announce_adam_build``).
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import sys
from pathlib import Path

import torch
from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder

_SOURCES_ENV = "PIPEMORPH_CUDA_EXT_DIR"
logger = logging.getLogger(__name__)
_announced: set[str] = set()  # op names this process has announced a build of


def extension_dir(name: str) -> Path:
    """Where torch's JIT ``load`` builds and caches the extension ``name`` (torch's own rule:
    ``$TORCH_EXTENSIONS_DIR/<name>``, else ``<user cache>/torch_extensions/py<XY>_<cpu|cuXY|rocmXY>/<name>``)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        if torch.version.hip is not None:
            accel = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            accel = f"cu{torch.version.cuda.replace('.', '')}"
        else:
            accel = "cpu"
        py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{py}_{accel}")
    return Path(root) / name


def needs_build(builder: OpBuilder) -> bool:
    """True when ``builder.load()`` will compile: the op is not prebuilt into DeepSpeed, not loaded in
    this process yet, and torch's extension cache holds no build of it."""
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get(builder.name, False) or builder.name in OpBuilder._loaded_ops:
        return False
    return not (extension_dir(builder.name) / f"{builder.name}.so").exists()


def announce_build(builder: OpBuilder, what: str) -> bool:
    """Log one line before a build that will really compile (once per process, on rank 0 or when
    there are no ranks: the other ranks wait for the same build); True if it will compile."""
    if not needs_build(builder):
        return False
    if builder.name not in _announced and os.environ.get("RANK", "0") == "0":
        _announced.add(builder.name)
        logger.warning(f"pipemorph: building {what} in {extension_dir(builder.name)} "
                       f"(first start only, this takes a while; later starts load it)")
    return True


@contextlib.contextmanager
def build_guard(name: str):
    """Hold the build of op ``name`` to this process (see the module docstring): waits while another
    process of ours builds or loads it; removes torch's lock left by an interrupted build."""
    ext = extension_dir(name)
    try:
        ext.parent.mkdir(parents=True, exist_ok=True)
        guard = open(ext.parent / f"{name}.lock", "a")
    except OSError:  # a cache we cannot write: a prebuilt op still loads, and torch says why a build cannot
        yield
        return
    with guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released at close, or by the kernel when this process dies
        try:
            stale = ext / "lock"
            if stale.exists():
                logger.warning(f"pipemorph: removing {stale}, left by a build of {name} that was interrupted "
                               f"(no process is building it now); building again")
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def announce_comm_build() -> bool:
    """Before ``deepspeed.init_distributed`` on a CPU accelerator: log that it will JIT-build DeepSpeed's
    shared-memory collectives op, if it will (its first call makes DeepSpeed's torch backend, which loads
    the op)."""
    from deepspeed import comm
    from deepspeed.accelerator import get_accelerator

    import deepspeed.ops

    accel = get_accelerator()
    if comm.comm.cdb is not None or accel.device_name() != "cpu" or accel.communication_backend_name() == "ccl":
        return False
    builder = accel.create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return False
    return announce_build(builder, f"DeepSpeed's CPU collectives op {builder.name}")


def announce_adam_build(config_class, client_optimizer) -> bool:
    """Before DeepSpeed's engine is built: log that it will JIT-build its FusedAdam op, if it will (an
    "Adam"/"AdamW" optimizer section without ``torch_adam`` and no optimizer object of the user's)."""
    from deepspeed.accelerator import get_accelerator

    name = (getattr(config_class, "optimizer_name", None) or "").lower()
    params = getattr(config_class, "optimizer_params", None) or {}
    if client_optimizer is not None or name not in ("adam", "adamw") or params.get("torch_adam", False):
        return False
    builder = get_accelerator().create_op_builder("FusedAdamBuilder")
    if builder is None:
        return False
    return announce_build(builder, f"DeepSpeed's FusedAdam op {builder.name}")


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

    def load(self, verbose: bool = False):
        announce_build(self, f"the staging ring op {self.name}")
        with build_guard(self.name):
            return super().load(verbose)

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

    def load(self, verbose: bool = False):
        announce_build(self, f"the CUDA staging ring op {self.name}")
        with build_guard(self.name):
            return super().load(verbose)

    def is_compatible(self, verbose: bool = False) -> bool:
        if not torch.cuda.is_available():
            self.warning(f"{self.name} needs a CUDA GPU and a CUDA build of torch; none is available here")
            return False
        if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
            self.warning(f"{self.name} needs nvcc (CUDA toolkit) to JIT-build")
            return False
        return _sources_present(self) and super().is_compatible(verbose)
