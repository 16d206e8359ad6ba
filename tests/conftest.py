"""Stable CLI output for tests (Typer reads these at import), a version-keyed extension cache, no
shared memory left behind by the session's jobs, and CPU burners: ``cpu_burners`` for the tests that
must hold on a busy host, and ``PIPEMORPH_TEST_BURNERS=N`` to run the whole session beside N of them
(``PIPEMORPH_TEST_BURNERS=2 python -m pytest``: a 2-core host with two CPU-bound processes beside)."""
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds_pipemorph.procs import versioned_extensions_dir

os.environ.setdefault("TYPER_USE_RICH", "0")
os.environ.setdefault("TERMINAL_WIDTH", "200")
os.environ.setdefault("COLUMNS", "200")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


# A cache built by another DeepSpeed version breaks the next job with an AttributeError. Keyed by the
# checkout as well: the staging op's source paths are part of its build, so two checkouts sharing one
# cache (a clone beside a worktree) would rebuild it in turn, each build taking a minute of a job's start.
_CHECKOUT = hashlib.sha1(str(Path(__file__).resolve().parents[1]).encode()).hexdigest()[:8]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", f"{versioned_extensions_dir()}-{_CHECKOUT}")


# Every process the session starts asks py-cpuinfo about this machine once, not twice per rank of
# every job (tests/_site/sitecustomize.py): the answer is kept for this boot of this machine.
_SITE = Path(__file__).resolve().parent / "_site"
_BOOT = Path("/proc/sys/kernel/random/boot_id")
if _BOOT.exists() and "PIPEMORPH_TEST_CPUINFO" not in os.environ:
    Path(os.environ["TORCH_EXTENSIONS_DIR"]).mkdir(parents=True, exist_ok=True)
    os.environ["PIPEMORPH_TEST_CPUINFO"] = str(Path(os.environ["TORCH_EXTENSIONS_DIR"]) /
                                               f"cpuinfo-{_BOOT.read_text().strip()}.json")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(_SITE), os.environ.get("PYTHONPATH")) if p)


# Shared memory a killed or early-exiting rank never removes: DeepSpeed's CPU all-reduce buffers and
# the delegated transport's staging rings (``pm_<pid>_...``). Left in /dev/shm they hold RAM.
_SHM_LEFTOVERS = ("deepspeed_allreduce_buffer_*", "pm_[0-9]*_*")


@pytest.fixture(scope="session", autouse=True)
def _remove_shared_memory_left_behind():
    """After the session: remove those created while it ran (not in its last seconds, when another run's
    rank may still be writing one it has not mapped yet) that no live process maps or holds open."""
    start = time.time()
    yield
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return
    scan = time.time()
    in_use = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            in_use.update(line.rsplit(None, 1)[-1] for line in (proc / "maps").read_text().splitlines()
                          if "/dev/shm/" in line)
            in_use.update(os.readlink(fd) for fd in (proc / "fd").iterdir())
        except OSError:  # the process ended meanwhile, or is not ours to read
            continue
    for pattern in _SHM_LEFTOVERS:
        for f in shm.glob(pattern):
            try:
                if start <= f.stat().st_mtime < scan - 5 and str(f) not in in_use:
                    f.unlink()
            except OSError:
                continue


# A CPU-bound loop that ends by itself once the process that started it is gone (pytest killed).
_BURN = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(200000): pass\n"
_session_burners: list = []


def _start_burners(n: int) -> list:
    return [subprocess.Popen([sys.executable, "-c", _BURN], stdin=subprocess.DEVNULL, start_new_session=True)
            for _ in range(n)]


def _stop_burners(procs: list) -> None:
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture(scope="session", autouse=True)
def _burners_beside_the_session():
    """``PIPEMORPH_TEST_BURNERS=N``: N CPU-bound processes run beside the whole session."""
    n = int(os.environ.get("PIPEMORPH_TEST_BURNERS", "0") or 0)
    _session_burners[:] = _start_burners(n)
    yield
    _stop_burners(_session_burners)


@pytest.fixture
def cpu_burners():
    """Two CPU-bound processes beside the test (fewer if the session already runs some): on 2 cores,
    every process of the test then waits for a CPU about half the time, in slices of the scheduler's."""
    own = _start_burners(max(0, 2 - len(_session_burners)))
    yield len(own) + len(_session_burners)
    _stop_burners(own)
