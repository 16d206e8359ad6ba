"""Shared by the benchmark scripts: a rich table when available, an atomic JSON write, the malloc
settings that keep freed memory, re-launching a script under torchrun, and work folders that are
removed when the script succeeds."""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ds_pipemorph.fileio import BadInput, check_writable, write_atomic  # noqa: E402
from ds_pipemorph.procs import torchrun  # noqa: E402

# glibc settings (read at process start) that keep freed memory, as GPU caching allocators do: no
# trimming, no mmap per large block, so nothing is faulted in again (GPU users never pay that).
CACHING_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 32),
                  "MALLOC_TOP_PAD_": str(1 << 28)}


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover
        print(title)
        print(" | ".join(columns))
        for r in rows:
            print(" | ".join(str(x) for x in r))
        return
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(*[str(x) for x in r])
    Console(width=160).print(t)


def write_json(path: str, payload: dict) -> None:
    payload = dict(payload)
    payload.setdefault("machine", {"python": platform.python_version(), "cpus": __import__("os").cpu_count()})
    payload.setdefault("written_at", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    write_atomic(path, json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")


def gain_share(measured: float, predicted: float, least: float = 0.01):
    """The part of a predicted gain that was measured: (measured - 1) / (predicted - 1) of two
    speed-ups over the same baseline; None where the prediction is no gain of ``least`` or more
    (the share of a gain that small is noise over nothing). The quotient of the speed-ups is no
    such measure: it reads 0.9 or more for almost any small gain."""
    return (measured - 1) / (predicted - 1) if predicted >= 1 + least else None


def relaunch(script: str, nproc: int, *args: str) -> int:
    """Run ``script`` with ``args`` (default: this process's) under ``torchrun --standalone`` with
    ``nproc`` ranks on CPU unless ``DS_ACCELERATOR`` says otherwise; its exit code."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
           "PYTHONPATH": os.pathsep.join([str(repo), str(Path(script).resolve().parent),
                                          os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory(prefix="relaunch-") as logs:
        return subprocess.call(torchrun(logs, "--standalone", f"--nproc_per_node={nproc}", script,
                                        *(args or sys.argv[1:])), env=env)


_WORK_FOLDERS: list[Path] = []
_KEPT: set[Path] = set()


def work_folder(prefix: str) -> Path:
    """A new temporary folder for a run's logs and files. The ``exit_on_bad_input`` call the run is in
    removes it when the run succeeds (unless ``keep`` was called) and names it when the run fails."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    _WORK_FOLDERS.append(path)
    return path


def keep(path: Path) -> Path:
    """Keep the ``work_folder`` ``path`` whatever the run returns (it holds the log of a rank that
    failed); it is named when the run ends."""
    _KEPT.add(path)
    return path


def exit_on_bad_input(main) -> int:
    """Run a benchmark's ``main``; bad input (a rate, a path, no privilege for the lab) ends it with one
    ``error:`` sentence and exit code 2 instead of a traceback. The ``work_folder``s this run made are
    removed when it returns (or exits with) 0, or 2 for bad input; those of a failed run, and those it
    kept, are kept and named."""
    first = len(_WORK_FOLDERS)
    code = 1
    try:
        code = main() or 0
        return code
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
        return code
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        raise
    finally:
        for path in _WORK_FOLDERS[first:]:
            if code in (0, 2) and path not in _KEPT:
                shutil.rmtree(path, ignore_errors=True)
            elif path.exists():
                print(f"the run's files are kept under {path}", file=sys.stderr)
            _KEPT.discard(path)
        del _WORK_FOLDERS[first:]


def check_out(path: str) -> None:
    """Refuse, before any work, an ``--out`` that cannot be written (one sentence, ``BadInput``)."""
    check_writable(path, "--out")


def two_rank_job(name: str, config: dict, tmp: Path, script: Path, args: list[str], expect, missing: str,
                 timeout: float = 3600):
    """Write ``config`` as ``tmp/<name>.json`` and run ``script CONFIG_PATH-args`` under ``torchrun
    --standalone`` with 2 ranks of one intra-op thread each (no more ranks than this machine's cores);
    ``args`` may hold ``{config}``. Returns (the first match of ``expect`` in the output, the output);
    a failed job or no match ends the benchmark with the output's tail (``missing``: what was not logged)."""
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    cmd = torchrun(tmp / f"{name}-torchrun", "--standalone", "--nproc_per_node=2", str(script),
                   *[a.format(config=path) for a in args])
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    out = p.stdout + p.stderr
    m = expect.search(out)
    if p.returncode or not m:
        raise SystemExit(f"{name}: the job failed or {missing} (exit {p.returncode}):\n{out[-3000:]}")
    return m, out
