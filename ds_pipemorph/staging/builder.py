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
``build_guard``: an advisory lock beside the cache (``<NAME>.lock``, an ``flock`` released by the kernel
when its holder dies, however it dies) is taken first; whoever holds it is the only process of ours
building that op. A torch lock found then is live while a process has it open (matched by device and
inode): torch keeps the file open from taking the lock to releasing it, and the kernel closes it when
its holder dies. That is how a build or load that does not take our guard holds it (stock DeepSpeed
loading its own ops, in this job's process or another): the guard waits (polling, one warning naming the
pids) until it is released, or its holder dies and leaves it stale. A lock no process has open was left
by a build that is over, unless that build's ninja or compilers outlived it (they survive a SIGKILL or
an OOM kill of the Python process that started them): torch runs ninja with the build directory as its
cwd, so while a live build tool has its cwd inside that directory the guard waits the same way. A lock
found with neither is checked once more a moment later (torch's release closes the file before it
removes it), then removed, with one warning, and the op is built again. Processes whose open files or
cwd we may not read (other users', or in another PID namespace) are not seen: a lock owned by another
user is therefore left as it is, with one warning. The guard file is opened read-only
(created with mode 0666 less the umask if missing), so users sharing a cache all take it. Where it cannot be created (a
read-only cache) or ``flock`` fails (NFS without a lock manager) the op loads as torch alone would,
nothing removed (the latter with one warning). A prebuilt op, or one already loaded in this process,
needs no guard and gets none.

A JIT build takes tens of seconds to minutes on the first start and none later; ``announce_build`` logs one
line before a build that will really compile (no prebuilt op, nothing in the extension cache), for our
ring (``load``) and for the ops DeepSpeed builds inside its own code: its CPU collectives op, which
``deepspeed.init_distributed`` builds on a CPU accelerator (``prepare_comm_op``, called before it), and
its Adam op (FusedAdam, or CPU Adam where ZeRO offloads the optimizer), which its engine builds for an
"Adam" optimizer section (``prepare_adam_op``). Those are loaded by us first, under the same guard (``load_guarded``), so that a lock an interrupted build
of theirs left behind is removed too; DeepSpeed keeps loaded ops by name, and its own load then finds
them loaded. Should our load fail, DeepSpeed's own load runs as it would have and reports the error.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import sys
import time
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
    if _prebuilt_or_loaded(builder.name):
        return False
    return not (extension_dir(builder.name) / f"{builder.name}.so").exists()


def _prebuilt_or_loaded(name: str) -> bool:
    """True when DeepSpeed's ``OpBuilder.load`` will not JIT-load op ``name``: it is loaded in this
    process already, or prebuilt into DeepSpeed (for this accelerator)."""
    from deepspeed.git_version_info import installed_ops

    if name in OpBuilder._loaded_ops:
        return True
    if not installed_ops.get(name, False):
        return False
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name

    return accelerator_name == get_accelerator()._name


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


_POLL_SECONDS = 2.0  # how often build_guard re-checks a process still working in a build directory
_SETTLE_SECONDS = 0.2  # a lock found with no holder is checked again after this, before it is removed
_flock_warned: set[str] = set()  # guard files this process has warned it cannot lock


# What torch's build runs in the build directory: only these hold a removal back, so that a shell (or
# a job launched) with its cwd there cannot keep the guard holder waiting for good.
_BUILD_TOOLS = ("ninja", "cc1plus", "cc1", "c++", "g++", "gcc", "clang", "clang++", "nvcc", "cicc", "ptxas",
                "cudafe++", "fatbinary", "nvlink", "ld", "ld.gold", "ld.lld", "as", "collect2", "hipcc")


def _build_tool(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        return False
    return comm in _BUILD_TOOLS or comm.startswith(("x86_64-", "aarch64-"))  # cross-named gcc/g++/ld


def _pids() -> list[str]:
    """The pids ``/proc`` lists (none where there is no ``/proc``)."""
    try:
        return [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []


def _processes_in(directory: Path) -> list[int]:
    """Pids of live build tools (ninja, compilers, linkers; ``_BUILD_TOOLS``) whose cwd is ``directory``
    or inside it, as far as ``/proc`` lets us see (processes whose cwd we may not read, or that vanish
    meanwhile, are skipped)."""
    root = os.path.realpath(directory)
    found = []
    for entry in _pids():
        if int(entry) == os.getpid():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:  # not ours to read, gone, or a zombie
            continue
        if (cwd == root or cwd.startswith(root + os.sep)) and _build_tool(entry):
            found.append(int(entry))
    return sorted(found)


def _holders_of(path: Path) -> list[int]:
    """Pids of the processes that have the file ``path`` open, this one included, as far as ``/proc``
    lets us see (file descriptors we may not read, and processes that vanish meanwhile, are skipped).
    Matched by device and inode, so a holder that opened it under another path (a bind mount, another
    mount namespace) is seen too."""
    try:
        st = os.stat(path)
    except OSError:
        return []
    target, base = (st.st_dev, st.st_ino), os.path.basename(path)
    found = []
    for entry in _pids():
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            where = f"/proc/{entry}/fd/{fd}"
            try:
                if base in os.readlink(where):  # only a file of that name is stat'ed
                    held = os.stat(where)
                    if (held.st_dev, held.st_ino) == target:
                        found.append(int(entry))
                        break
            except OSError:
                continue
    return sorted(found)


def _still_stale(lock: Path, ext: Path, inode: int) -> bool:
    """The same lock file (``inode``), still with no holder and no build tool in ``ext``, a moment after
    it was found so: torch's release closes the file before it removes it, and in between a live lock
    looks stale; a lock that exists keeps anyone else from taking a new one."""
    time.sleep(_SETTLE_SECONDS)
    try:
        same = os.stat(lock).st_ino == inode
    except OSError:  # released meanwhile: torch takes it from here
        return False
    return same and not _holders_of(lock) and not _processes_in(ext)


def _remove_stale_lock(name: str, ext: Path) -> None:
    """Called holding the guard: remove torch's lock in ``ext`` once no process has it open and no build
    tool works in ``ext``; while some process holds it, wait (polling, one warning) for it to be released
    or its holder to die. A lock of another user, whose processes we may not see, is left (one warning)."""
    lock = ext / "lock"
    warned = set()
    while True:
        try:
            st = os.stat(lock)
        except OSError:
            return  # no lock (or released while we waited): torch takes it from here
        holders = _holders_of(lock)
        pids = [] if holders else _processes_in(ext)
        if not holders and not pids:
            if st.st_uid != os.geteuid() and os.geteuid() != 0:
                logger.warning(f"pipemorph: {lock} belongs to another user, whose processes may not be visible "
                               f"here; leaving it (remove it by hand if no build of {name} runs: the load waits for it)")
                return
            if not _still_stale(lock, ext, st.st_ino):
                continue
            logger.warning(f"pipemorph: removing {lock}, left by a build of {name} that was interrupted "
                           f"(no process is building it now); building again")
            lock.unlink(missing_ok=True)
            return
        if holders and "held" not in warned:
            warned.add("held")
            logger.warning(f"pipemorph: {lock} is held by process(es) {', '.join(map(str, holders))} (a build or "
                           f"load of {name}, ours or not); waiting for it to be released")
        elif pids and "tools" not in warned:
            warned.add("tools")
            logger.warning(f"pipemorph: {lock} was left by an interrupted build of {name}, but process(es) "
                           f"{', '.join(map(str, pids))} still work in {ext} (a ninja or compiler that outlived "
                           f"it); waiting for them to finish before building again")
        time.sleep(_POLL_SECONDS)


@contextlib.contextmanager
def build_guard(name: str):
    """Hold the build of op ``name`` to this process (see the module docstring): waits while another
    process of ours builds or loads it; removes torch's lock left by an interrupted build once no process
    still works in the build directory. Nothing to do for an op prebuilt or loaded already."""
    if _prebuilt_or_loaded(name):
        yield
        return
    ext = extension_dir(name)
    path = ext.parent / f"{name}.lock"
    try:
        ext.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)  # read-only: flock needs no write permission
    except OSError:  # a cache we cannot write: torch loads a build already there, or says why it cannot build
        yield
        return
    try:
        locked = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released at close, or by the kernel when this process dies
        except OSError as e:  # e.g. ENOLCK on NFS without a lock manager: no guard, so remove nothing
            locked = False
            if str(path) not in _flock_warned:
                _flock_warned.add(str(path))
                logger.warning(f"pipemorph: cannot lock {path} ({e.strerror or e}); loading {name} without "
                               f"the guard, so a torch lock left in {ext} by an interrupted build is not "
                               f"removed (remove it by hand if the load waits forever)")
        if locked:
            _remove_stale_lock(name, ext)
        yield
    finally:
        os.close(fd)  # releases the flock


def load_guarded(builder: OpBuilder, what: str) -> bool:
    """Announce a build of ``builder``'s op (``announce_build``), then load it under ``build_guard``,
    before DeepSpeed's own code loads it (which then finds it loaded). True if it had to compile. A
    failed load is left to DeepSpeed's, which raises its own error where it would have."""
    will_build = announce_build(builder, what)
    try:
        with build_guard(builder.name):
            builder.load()
    except Exception as e:  # noqa: BLE001 - DeepSpeed's own load then runs as it would have, and raises its own
        if os.environ.get("RANK", "0") == "0":
            logger.warning(f"pipemorph: loading {what} ahead of DeepSpeed failed ({type(e).__name__}: {e}); "
                           f"DeepSpeed loads it itself")
    return will_build


def prepare_comm_op() -> bool:
    """Before ``deepspeed.init_distributed`` on a CPU accelerator: load DeepSpeed's shared-memory
    collectives op under the guard (``load_guarded``; its first call makes DeepSpeed's torch backend,
    which loads the op), logging that it will JIT-build it, if it will."""
    from deepspeed import comm
    from deepspeed.accelerator import get_accelerator

    import deepspeed.ops

    accel = get_accelerator()
    if comm.comm.cdb is not None or accel.device_name() != "cpu" or accel.communication_backend_name() == "ccl":
        return False
    builder = accel.create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return False
    return load_guarded(builder, f"DeepSpeed's CPU collectives op {builder.name}")


def prepare_adam_op(config_class, client_optimizer) -> bool:
    """Before DeepSpeed's engine is built: load the Adam op its engine will load under the guard
    (``load_guarded``), logging that it will JIT-build it, if it will: for an "Adam"/"AdamW" optimizer
    section without ``torch_adam`` and no optimizer object of the user's, FusedAdam, or CPU Adam where
    ZeRO offloads the optimizer to the CPU or NVMe (DeepSpeed's ``get_optimizer_configuration``)."""
    from deepspeed.accelerator import get_accelerator

    name = (getattr(config_class, "optimizer_name", None) or "").lower()
    params = getattr(config_class, "optimizer_params", None) or {}
    if client_optimizer is not None or name not in ("adam", "adamw") or params.get("torch_adam", False):
        return False
    offload = getattr(getattr(config_class, "zero_config", None), "offload_optimizer", None)
    device = getattr(getattr(offload, "device", None), "value", getattr(offload, "device", None))
    kind, what = ("CPUAdamBuilder", "CPU Adam") if device in ("cpu", "nvme") else ("FusedAdamBuilder", "FusedAdam")
    builder = get_accelerator().create_op_builder(kind)
    if builder is None:
        return False
    return load_guarded(builder, f"DeepSpeed's {what} op {builder.name}")


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
