"""Child process groups that never outlive a timeout (torchrun's ranks included)."""
from __future__ import annotations

import os
import signal
import subprocess


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads (it was started with ``start_new_session=True``)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_group(cmd: list[str], timeout: float, **popen_kw) -> subprocess.CompletedProcess:
    """Like ``subprocess.run(..., capture_output=True, text=True, timeout=...)``, but on timeout the
    whole process group is killed (a launcher's children too) before TimeoutExpired is raised."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **popen_kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise
    except BaseException:
        kill_group(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def versioned_extensions_dir() -> str:
    """A torch-extensions cache keyed by the DeepSpeed and torch versions: a cache built by another
    DeepSpeed version breaks the next job with an AttributeError."""
    from importlib import metadata

    def ver(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "none"

    return os.path.expanduser(f"~/.cache/torch_extensions/ds_pipemorph-ds{ver('deepspeed')}-torch{ver('torch')}")
