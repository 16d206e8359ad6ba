"""Launch ``worker.py`` with a list of jobs and read back what each rank wrote: its ranks forked from
one process that imported torch, DeepSpeed and the package once (``forkrun.py``), or under torchrun.

``launch_shared`` runs the jobs of several tests in one launch (one start of the ranks and DeepSpeed);
each test reads its own jobs through a ``Launch`` view, by the names it gave them. ``shared_jobs``
registers a module's jobs for the session's one shared launch of their rank count (the ``shared4`` and
``shared3`` fixtures, tests/runtime/conftest.py)."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from ds_pipemorph.procs import run_group

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@dataclass
class Launch:
    returncode: int
    output: str
    out_dir: Path

    def path_of(self, name: str, rank: int) -> Path:
        """Where the rank writes job ``name``'s result."""
        return self.out_dir / f"{name}.rank{rank}.pt"

    def result(self, name: str, rank: int) -> dict:
        path = self.path_of(name, rank)
        assert path.exists(), f"{path.name} missing; launch output:\n{self.output[-4000:]}"
        return torch.load(path)

    def error(self, name: str, rank: int) -> str:
        path = self.out_dir / f"{name}.rank{rank}.err"
        assert path.exists(), f"{path.name} missing; launch output:\n{self.output[-4000:]}"
        return path.read_text()


def launch(nproc: int, jobs: list[dict], out_dir: Path, timeout: float, *, torchrun: bool = False) -> Launch:
    """Run ``jobs`` on ``nproc`` ranks: forked by ``forkrun.py`` (its exit report: ``rank R exited with
    code C``), or under ``torchrun --standalone`` (``torchrun=True``, its own report)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = out_dir / "jobs.json"
    spec.write_text(json.dumps(jobs))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    starter = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if torchrun else \
        [str(HERE / "forkrun.py"), str(nproc)]
    cmd = [sys.executable, *starter, str(HERE / "worker.py"), str(spec), str(out_dir)]
    p = run_group(cmd, timeout, cwd=REPO, env=env)
    return Launch(p.returncode, p.stdout + p.stderr, out_dir)


def max_param_diff(a: dict, b: dict) -> float:
    assert a["params"].keys() == b["params"].keys()
    return max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"])


def _prefixed(prefix: str, job: dict) -> dict:
    """``job`` renamed, with the checkpoint folders it saves or loads, into the ``prefix`` namespace."""
    job = {**job, "name": prefix + job["name"]}
    if "save" in job:
        job["save"] = {step: prefix + d for step, d in job["save"].items()}
    if "load" in job:
        job["load"] = {**job["load"], "dir": prefix + job["load"]["dir"]}
    return job


@dataclass
class View:
    """One test's jobs in a shared launch: results and errors by the names the test gave them."""
    shared: Launch
    prefix: str
    files: Optional[Path] = None  # in the session's shared launch: the folder the test's builder wrote to

    @property
    def returncode(self) -> int:
        return self.shared.returncode

    @property
    def output(self) -> str:
        return self.shared.output

    def path_of(self, name: str, rank: int) -> Path:
        return self.shared.path_of(self.prefix + name, rank)

    def result(self, name: str, rank: int) -> dict:
        return self.shared.result(self.prefix + name, rank)

    def error(self, name: str, rank: int) -> str:
        return self.shared.error(self.prefix + name, rank)

    def path(self, folder: str) -> Path:
        """Where a checkpoint folder the test's jobs save (``"save": {step: folder}``) is."""
        return self.shared.out_dir / (self.prefix + folder)


def launch_shared(nproc: int, tests: dict[str, list[dict]], out_dir: Path, timeout: float) -> dict[str, View]:
    """The jobs of each test (by key) one after another in one launch, each test's in its own order and
    namespace (``<key>.<name>``, checkpoint folders too); a view per test. A job that raises ends the
    launch: the tests whose jobs came after it find their results missing, with the launch's output."""
    jobs = [_prefixed(f"{key}.", job) for key, test_jobs in tests.items() for job in test_jobs]
    return views_of(launch(nproc, jobs, out_dir, timeout), tests)


def views_of(run: Launch, keys) -> dict[str, View]:
    """A view per test key of a shared launch (its jobs named ``<key>.<name>``)."""
    return {key: View(run, f"{key}.") for key in keys}


# The session's shared launches: ranks -> key -> (a builder of the jobs, given a folder of their own
# for the files they read or write; the ceiling of those jobs as a launch of their own, in seconds).
SHARED: dict[int, dict[str, tuple[Callable[[Path], list[dict]], float]]] = {}
# The most the shared launch may take: the sum of the registered ceilings stays below it (a test's
# own timeout covers it: the first test to ask for the launch waits for all of it).
SHARED_CEILING = 1800


def shared_jobs(key: str, timeout: float, ranks: int = 4):
    """Register the decorated builder's jobs for the session's shared launch of ``ranks`` ranks, under ``key``."""
    def register(build: Callable[[Path], list[dict]]):
        assert key not in SHARED.setdefault(ranks, {}), key
        SHARED[ranks][key] = (build, timeout)
        return build
    return register
