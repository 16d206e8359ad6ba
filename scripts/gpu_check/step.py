"""What the drivers of gpu_check's steps share: an exit through Python's cleanup on SIGTERM, the
time left of the step's budget, a torchrun launch within it and the key file a step writes.

GNU ``timeout`` signals only its own process group, and ``procs.run_group`` starts launchers in
sessions of their own: exiting on SIGTERM runs ``run_group``'s cleanup, which ends the launcher's
whole session. ``gpu_check.sh`` passes each step what is left of its budget as ``GPU_CHECK_STEP_S``.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional


def start_step(reserve_s: float = 10.0) -> Callable[[], float]:
    """Install the SIGTERM exit; the seconds left of this step's budget, less ``reserve_s`` to write
    its result, as a function."""
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    deadline = time.monotonic() + float(os.environ.get("GPU_CHECK_STEP_S", "300")) - reserve_s
    return lambda: deadline - time.monotonic()


def launch(cmd: list[str], left_s: Callable[[], float], cwd: Path, env: dict) -> tuple[Optional[int], str, str]:
    """(exit code, stdout, stderr) of ``cmd`` run within what ``left_s()`` says is left (exit code None:
    it did not end in time). The log folder of a torchrun ``cmd`` (``--log-dir=``) is removed after
    it: the ranks' output is in ours, the folder holds nothing else."""
    from ds_pipemorph.procs import run_group  # the drivers put the checkout on sys.path first

    timeout = left_s()
    try:
        if timeout <= 0:
            raise subprocess.TimeoutExpired(cmd, 0)
        p = run_group(cmd, timeout, cwd=cwd, env=env)  # on timeout the launcher's children go too
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired:
        return None, "", f"the launch did not end within the {max(timeout, 0):.0f} s left of the step's budget"
    finally:
        for arg in cmd:
            if arg.startswith("--log-dir="):
                shutil.rmtree(arg.split("=", 1)[1], ignore_errors=True)


def launch_worker(repo: Path, work: Path, jobs: list, nproc: int, backend: str, accelerator: str,
                  left_s: Callable[[], float]) -> tuple[Optional[int], str]:
    """``jobs`` for tests/runtime/worker.py on ``nproc`` ranks under ``torchrun --standalone``, with
    ``backend`` and DeepSpeed's ``accelerator``; writes ``work/jobs.json`` and ``work/launch.log``,
    prints the log's tail and returns (exit code, output)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "DS_ACCELERATOR": accelerator, "WORKER_DIST_BACKEND": backend,
           "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    from ds_pipemorph.procs import torchrun

    cmd = [*torchrun(work / "torchrun", "--standalone", f"--nproc_per_node={nproc}"),
           str(repo / "tests" / "runtime" / "worker.py"), str(work / "jobs.json"), str(work)]
    code, out, err = launch(cmd, left_s, repo, env)
    output = out + err
    (work / "launch.log").write_text(output)
    print(output[-4000:])
    return code, output


def write_keys(path: Path, failures: list[str], keys: dict) -> int:
    """Write the step's key file ({"ok", "failures", "key_numbers"}) atomically, print it; the exit code."""
    from ds_pipemorph.fileio import write_atomic

    result = {"ok": not failures, "failures": failures, "key_numbers": keys}
    write_atomic(path, json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 1 if failures else 0
