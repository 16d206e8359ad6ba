"""The session's shared launches: the jobs every module registered with ``launch.shared_jobs`` for a
rank count, one after another in one start of torchrun and DeepSpeed (modules in collection order)."""
import pytest

from .launch import SHARED, SHARED_CEILING, launch_shared


def _shared(ranks: int, out):
    """key -> the view of that module's jobs (``view.files``: the folder its builder wrote to)."""
    registered = SHARED.get(ranks, {})
    timeout = sum(t for _, t in registered.values())
    assert timeout <= SHARED_CEILING, f"the shared launch's ceiling is {SHARED_CEILING} s, its jobs' {timeout} s"
    tests, folders = {}, {}
    for key, (build, _) in registered.items():
        folders[key] = out / f"files_{key}"
        folders[key].mkdir()
        tests[key] = build(folders[key])
    views = launch_shared(ranks, tests, out, timeout=timeout)
    for key, view in views.items():
        view.files = folders[key]
    return views


@pytest.fixture(scope="session")
def shared4(tmp_path_factory):
    return _shared(4, tmp_path_factory.mktemp("shared4"))


@pytest.fixture(scope="session")
def shared3(tmp_path_factory):
    return _shared(3, tmp_path_factory.mktemp("shared3"))
