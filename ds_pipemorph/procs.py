"""Child process groups that never outlive a timeout (torchrun's ranks included), and torchrun
commands that leave nothing behind."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def torchrun(log_dir: "Path | str", *args: str) -> list[str]:
    """``torchrun --log-dir=LOG_DIR ARGS`` with this interpreter. Left to itself, torchrun makes a
    ``torchelastic_*`` folder in the temporary folder for every job and never removes it, so a
    command run again and again fills that folder; given ``log_dir`` (a folder of the caller's work,
    removed with it), it makes its per-rank folders there."""
    return [sys.executable, "-m", "torch.distributed.run", f"--log-dir={log_dir}", *args]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a launcher's ``--master_port``, a store's port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list:
    """Every process below ``pid`` (torchrun starts each rank in a session of its own: the group of
    ``pid`` does not hold them)."""
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:  # noqa: BLE001  (gone already, or no psutil)
        return []


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads (it was started with ``start_new_session=True``) and
    every process below it, in its group or not."""
    below = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in below:
        try:
            p.kill()
        except Exception:  # noqa: BLE001  (gone already)
            pass
    proc.wait()


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop ``proc`` (a launcher) as Ctrl-C would: SIGTERM to it, which passes it on to its ranks; what
    still runs after ``grace_s`` (the launcher or any process that was below it) is killed."""
    below = _descendants(proc.pid) if proc.poll() is None else []
    try:
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=grace_s)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        deadline = time.monotonic() + 2.0  # the ranks' exits may trail the launcher's a moment
        while any(_alive(p) for p in below) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:  # a second Ctrl-C meanwhile: kill at once
        for p in below:
            if _alive(p):
                try:
                    p.kill()
                except Exception:  # noqa: BLE001  (gone meanwhile)
                    pass
        kill_group(proc)


def _alive(p) -> bool:
    try:
        return p.is_running() and p.status() != "zombie"
    except Exception:  # noqa: BLE001
        return False


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
    except BaseException:  # Ctrl-C: the launcher and its ranks stop in order, then whatever is left is killed
        stop_group(proc)
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
