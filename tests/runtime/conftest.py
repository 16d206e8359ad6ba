"""The session's shared launches: the jobs every module registered with ``launch.shared_jobs`` for a
rank count, one after another in one start of the ranks and DeepSpeed (modules in collection order).

Under pytest-xdist each worker is a session of its own and collects every module: the first worker to
ask for a launch runs it in the folder the workers share, under a file lock, and writes down how it
ended; a worker that asks later waits on the lock and reads the same results."""
import fcntl
import json
import os
from pathlib import Path

import pytest

from .launch import SHARED, SHARED_CEILING, Launch, launch_shared, views_of


def _shared(ranks: int, out: Path) -> dict:
    """key -> the view of that module's jobs (``view.files``: the folder its builder wrote to)."""
    registered = SHARED.get(ranks, {})
    timeout = sum(t for _, t in registered.values())
    assert timeout <= SHARED_CEILING, f"the shared launch's ceiling is {SHARED_CEILING} s, its jobs' {timeout} s"
    ended = out / "launch.json"  # written last, whole: the launch ran and its results are in ``out``
    with open(f"{out}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        folders = {key: out / f"files_{key}" for key in registered}
        if ended.exists():
            done = json.loads(ended.read_text())
            views = views_of(Launch(done["returncode"], done["output"], out), registered)
        else:
            tests = {}
            for key, (build, _) in registered.items():
                folders[key].mkdir(parents=True, exist_ok=True)
                tests[key] = build(folders[key])
            views = launch_shared(ranks, tests, out, timeout=timeout)
            run = next(iter(views.values())).shared
            tmp = ended.with_suffix(f".{os.getpid()}")
            tmp.write_text(json.dumps({"returncode": run.returncode, "output": run.output}))
            os.replace(tmp, ended)
    for key, view in views.items():
        view.files = folders[key]
    return views


def _folder(tmp_path_factory, name: str) -> Path:
    """``name`` in the session's temporary folder, or in the folder all xdist workers' sessions share."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name


@pytest.fixture(scope="session")
def shared4(tmp_path_factory):
    return _shared(4, _folder(tmp_path_factory, "shared4"))


@pytest.fixture(scope="session")
def shared3(tmp_path_factory):
    return _shared(3, _folder(tmp_path_factory, "shared3"))
