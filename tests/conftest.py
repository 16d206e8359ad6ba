"""Stable CLI output for tests (Typer reads these at import), a version-keyed extension cache, no
shared memory left behind by the session's jobs, CPU burners (``cpu_burners`` for the tests that
must hold on a busy host, and ``PIPEMORPH_TEST_BURNERS=N`` to run the whole session beside N of them:
``PIPEMORPH_TEST_BURNERS=2 python -m pytest`` is a 2-core host with two CPU-bound processes beside),
and tests marked ``alone``, which run while no other test is in its setup, call or teardown.

The session runs on two pytest-xdist workers (``pytest.ini``), each module's tests on one worker (its
module-scoped jobs start once), the modules in the order ``pytest_collection_modifyitems`` gives: most
jobs wait on sleeps, links and timeouts more than they compute, so a second job beside them uses cores
the first leaves idle. ``-n 0`` runs everything in one process, one test at a time."""
import compileall
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack, contextmanager
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
# every job: the answer is kept for this boot of this machine; and its garbage collector does not walk
# what importing torch and DeepSpeed made, nor, at exit, what it still holds (tests/_site/sitecustomize.py
# says what that costs and changes).
_SITE = Path(__file__).resolve().parent / "_site"
_BOOT = Path("/proc/sys/kernel/random/boot_id")
if _BOOT.exists() and "PIPEMORPH_TEST_CPUINFO" not in os.environ:
    Path(os.environ["TORCH_EXTENSIONS_DIR"]).mkdir(parents=True, exist_ok=True)
    os.environ["PIPEMORPH_TEST_CPUINFO"] = str(Path(os.environ["TORCH_EXTENSIONS_DIR"]) /
                                               f"cpuinfo-{_BOOT.read_text().strip()}.json")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(_SITE), os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("PIPEMORPH_TEST_GC_FREEZE", "1")


# Every process the session starts imports the package and the tests' helpers, about a hundred modules.
# Where Python does not write bytecode (``PYTHONDONTWRITEBYTECODE``), each of them compiled all of that
# again: about 0.2 s of CPU per rank of every job. Compiled here once, into the checkout's own
# ``__pycache__`` folders (the controller, before any worker starts), they read it. An up-to-date file
# is not compiled again; a folder that cannot be written is left as it is.
_CHECKOUT_DIR = Path(__file__).resolve().parents[1]
if "PYTEST_XDIST_WORKER" not in os.environ:
    for _folder in ("ds_pipemorph", "tests", "benchmarks", "recipes", "scripts", "cli"):
        if (_CHECKOUT_DIR / _folder).is_dir():
            compileall.compile_dir(_CHECKOUT_DIR / _folder, quiet=2, workers=1)


# The files the session's processes leave in the temporary folder (torchrun's log folders, the socket
# folders of multiprocessing in a process that was killed, a benchmark's work folder, pytest's own
# ``tmp_path`` folders) go to one folder of the session's: removed when the session passes, kept and
# named when it fails, the newest ``KEEP_FAILED`` of those kept (as pytest keeps its last three). Set
# here, in the controller before any worker starts: the workers and every process they start inherit it.
_SESSION_TMP = None  # the folder, in the process that made it
KEEP_FAILED = 3
_FAILED = "SESSION_FAILED"  # written into a folder kept after a failed session (a live one has none)


def _kept_folders() -> list[Path]:
    """The folders failed sessions kept, oldest first."""
    kept = []
    for d in Path(tempfile.gettempdir()).glob("pipemorph-tests-*"):
        try:
            kept.append(((d / _FAILED).stat().st_mtime, d))
        except OSError:  # a live session's, or one removed meanwhile
            continue
    return [d for _, d in sorted(kept)]


if "PYTEST_XDIST_WORKER" not in os.environ and "PIPEMORPH_TEST_TMPDIR" not in os.environ:
    for _old in _kept_folders()[:-(KEEP_FAILED - 1)]:  # with this session's, if it fails, KEEP_FAILED
        shutil.rmtree(_old, ignore_errors=True)
    _SESSION_TMP = tempfile.mkdtemp(prefix="pipemorph-tests-")
    os.environ["PIPEMORPH_TEST_TMPDIR"] = os.environ["TMPDIR"] = _SESSION_TMP
    tempfile.tempdir = None  # read TMPDIR again


# Shared memory a killed or early-exiting rank never removes: DeepSpeed's CPU all-reduce buffers and
# the delegated transport's staging rings (``pm_<pid>_...``). Left in /dev/shm they hold RAM.
_SHM_LEFTOVERS = ("deepspeed_allreduce_buffer_*", "pm_[0-9]*_*")


def _worker(config) -> bool:
    """This process is a pytest-xdist worker (not the session's controller, not a session without xdist)."""
    return hasattr(config, "workerinput")


def pytest_configure(config):
    """The controller names the run (pytest-xdist hands the name to its workers): the lock files of
    ``alone`` are named by it, and the controller removes them at the end."""
    if not _worker(config) and getattr(config.option, "testrunuid", "") is None:
        config.option.testrunuid = uuid.uuid4().hex


def pytest_collection_modifyitems(config, items):
    """The modules that hold an ``alone`` test first, then the modules of long jobs, those of unit tests
    last (each module's tests in their order). While an ``alone`` test runs, the other worker waits; it
    first waits for the other worker's test to end. At the start of the session the two workers run the
    ``alone`` modules one after the other, each wait short; spread over the session, each would wait for
    a long job to end. After them the two workers end on short tests together, not one on a long job
    while the other waits. A module's length is read from the longest timeout its tests set; tests that
    set none are quick."""
    def ceiling(item) -> float:
        mark = item.get_closest_marker("timeout")
        return float(mark.args[0]) if mark and mark.args else 0.0
    module = lambda item: item.nodeid.split("::")[0]  # noqa: E731
    longest: dict[str, float] = {}
    alone: set[str] = set()
    for item in items:
        longest[module(item)] = max(longest.get(module(item), 0.0), ceiling(item))
        if item.get_closest_marker("alone"):
            alone.add(module(item))
    # stable: a module's tests keep their order
    items.sort(key=lambda item: (module(item) not in alone, -longest[module(item)]))


def pytest_sessionstart(session):
    session.config.stash[_STARTED] = time.time()
    if not _worker(session.config):
        _session_burners[:] = _start_burners(_session_burner_count())


def pytest_sessionfinish(session, exitstatus):
    """Once, in the process that outlives every test: stop the burners, remove the lock files of
    ``alone``, the shared memory the session's jobs left behind and, when the session passed, its
    temporary folder."""
    if _worker(session.config):
        return
    _stop_burners(_session_burners)
    for f in _lock_files(session.config):
        f.unlink(missing_ok=True)
    _remove_shared_memory_left_behind(session.config.stash[_STARTED])
    if _SESSION_TMP is None:
        return
    if exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        shutil.rmtree(_SESSION_TMP, ignore_errors=True)
    else:
        Path(_SESSION_TMP, _FAILED).write_text(f"pytest exit status {int(exitstatus)}\n")
        print(f"\nthe session's temporary files are kept under {_SESSION_TMP}")


_STARTED = pytest.StashKey[float]()


def _remove_shared_memory_left_behind(start: float) -> None:
    """Remove those created while the session ran (not in its last seconds, when another run's rank may
    still be writing one it has not mapped yet) that no live process maps or holds open."""
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


def _session_burner_count() -> int:
    return int(os.environ.get("PIPEMORPH_TEST_BURNERS", "0") or 0)


@pytest.fixture
def cpu_burners(request):
    """Two CPU-bound processes beside the test (fewer if the session already runs some): on 2 cores,
    every process of the test then waits for a CPU about half the time, in slices of the scheduler's.
    A test that asks for them is marked ``alone``: another worker's job would add to them."""
    assert request.node.get_closest_marker("alone"), f"{request.node.nodeid} asks for cpu_burners: mark it alone"
    session = _session_burner_count()
    own = _start_burners(max(0, 2 - session))
    yield len(own) + session
    _stop_burners(own)


# ``alone``: every test holds a shared lock on one file from its setup to its teardown, a test marked
# ``alone`` an exclusive one. A turnstile before it keeps the workers' stream of shared locks from
# starving the exclusive one: an ``alone`` test takes the turnstile first, and no test takes the
# shared lock while the turnstile is held.
def _lock_files(config) -> list[Path]:
    run = config.workerinput["testrunuid"] if _worker(config) else getattr(config.option, "testrunuid", None)
    if run is None:
        return []
    base = Path(tempfile.gettempdir()) / f"pipemorph-tests-{run}"
    return [base.with_suffix(".turnstile"), base.with_suffix(".lock")]


@contextmanager
def _flock(path: Path, mode: int):
    with open(path, "a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Outermost, so that a test's timeout does not count the time it waits for the lock."""
    if not _worker(item.config):
        yield
        return
    turnstile, lock = _lock_files(item.config)
    if item.get_closest_marker("alone"):
        with _flock(turnstile, fcntl.LOCK_EX), _flock(lock, fcntl.LOCK_EX):
            yield
        return
    with ExitStack() as held:
        with _flock(turnstile, fcntl.LOCK_SH):  # passed through: released once the shared lock is held
            held.enter_context(_flock(lock, fcntl.LOCK_SH))
        yield
