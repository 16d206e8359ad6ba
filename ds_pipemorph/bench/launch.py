"""Start the ranks of ``pipemorph bench`` (torchrun, one rank per stage) and follow them to the end.

The ranks append a JSON line per iteration to the spec's progress file (``worker.progress_line``);
``run_job`` reads the complete lines while it waits and hands the newest to ``on_progress``. A job
that outlives its timeout is killed with its whole process group.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

from ..procs import kill_group, stop_group, torchrun, versioned_extensions_dir
from .spec import BenchSpec

POLL_S = 0.5


class JobFailed(RuntimeError):
    """The ranks did not deliver results; the message says why and where their log is."""


def complete_lines(path: Path) -> list[str]:
    """The non-blank lines of a file another process appends to, without the part after the last
    newline (it may be half written); none while the file does not exist."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [ln for ln in text.split("\n")[:-1] if ln.strip()]


def read_progress(path: Path) -> Optional[dict]:
    """The newest complete line of the progress file, or None before the first one."""
    lines = complete_lines(path)
    return json.loads(lines[-1]) if lines else None


def run_job(spec: BenchSpec, spec_path: Path, work: Path, timeout_s: float,
            on_progress: Callable[[Optional[dict]], None] = lambda line: None) -> dict:
    """Run the ranks on ``spec_path``; their results (the JSON at ``spec.out``) once they exit.

    Results written by this job count even after a non-zero exit code (a DeepSpeed CPU job may
    abort at process exit after finishing); a file left by an earlier run does not."""
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", versioned_extensions_dir())}
    cmd = torchrun(work / "torchrun", "--standalone", f"--nproc_per_node={spec.stages}",
                   "-m", "ds_pipemorph.bench.worker", str(spec_path))
    log_path = work / "ranks.log"
    progress_file = Path(spec.progress_file)
    out = Path(spec.out)
    before = _stamp(out)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None:
                if time.monotonic() - t0 > timeout_s:
                    kill_group(proc)
                    raise JobFailed(f"the benchmark did not finish within {timeout_s:g} s; see {log_path}")
                on_progress(read_progress(progress_file))
                time.sleep(POLL_S)
        except BaseException:  # Ctrl-C or SIGTERM: the ranks stop in order, then whatever is left is killed
            stop_group(proc)
            raise
    if _stamp(out) in (None, before):
        raise JobFailed(f"the ranks exited with code {proc.returncode} before writing results; see {log_path}")
    return json.loads(out.read_text())


def _stamp(path: Path) -> Optional[tuple[int, int]]:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns
