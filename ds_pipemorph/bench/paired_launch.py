"""Launching a paired comparison: one alternating job, or whole short jobs alternating.

``run(spec, work, timeout_s, progress)`` starts the ranks with torchrun (one per stage), follows
their progress and returns the results with the comparison (``paired.compare``) added; the caller
writes them. Sides that share a job run ``paired_worker`` once. Otherwise (``stock-1f1b``,
``pipemorph``) every job runs one side as a row of ``pipemorph bench`` (its worker, unchanged), in
the order ``A B A' B ...``, and a job's sample is the median of its measured iterations. Errors
raise ``PairedRunError`` with one sentence naming the log.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from statistics import median
from typing import Callable, Optional

from ..procs import stop_group, torchrun, versioned_extensions_dir
from .launch import complete_lines
from ..paired import A_SIDE, compare, sequence
from .paired_spec import PairedSpec
from .spec import BenchSpec, Scenario

Progress = Callable[[int, int, str], None]  # (done, total, what)

ONE_JOB = "one job, the sides switched at every iteration boundary (A B A' B ...)"
WHOLE_JOBS = ("whole jobs alternating (A B A' B ...): {a} and {b} cannot share one job; each sample is "
              "the median of one job's {n} measured iterations")


class PairedRunError(RuntimeError):
    """The ranks failed or timed out; the message names the log to read."""


def start_ranks(module: str, spec_path: Path, nproc: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", versioned_extensions_dir())}
    cmd = torchrun(log.parent / "torchrun", "--standalone", f"--nproc_per_node={nproc}",
                   "-m", module, str(spec_path))
    with open(log, "a") as f:
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(proc: subprocess.Popen, deadline: float, log: Path, poll: Optional[Callable[[], None]] = None) -> None:
    """Until the ranks exit; past the deadline, or when the caller is interrupted, their whole group is killed."""
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise PairedRunError(f"the paired run did not finish in time; see {log}")
            if poll is not None:
                poll()
            time.sleep(0.5)
    except BaseException:
        stop_group(proc)
        raise


def run(spec: PairedSpec, work: Path, timeout_s: float, progress: Optional[Progress] = None) -> dict:
    """Run ``spec`` (ranks under torchrun) and return the results with the comparison."""
    work.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    result = _one_job(spec, work, deadline, progress) if spec.one_job else _whole_jobs(spec, work, deadline, progress)
    rows = result["iterations"]
    warmup = spec.warmup if spec.one_job else 0
    cmp = compare([r["side"] for r in rows], [r["ms"] for r in rows], warmup, seed=spec.seed)
    result["comparison"] = cmp.as_dict()
    return result


def read_paired_progress(path: Path) -> Optional[tuple[int, int, str]]:
    """(iterations done, iterations in all, side of the newest) from the complete lines rank 0 has
    appended (``i total side``), or None before the first one."""
    lines = complete_lines(path)
    if not lines:
        return None
    _, total, side = lines[-1].split()
    return len(lines), int(total), side


def _one_job(spec: PairedSpec, work: Path, deadline: float, progress: Optional[Progress]) -> dict:
    spec_path, log = work / "paired.json", work / "ranks.log"
    spec_path.write_text(spec.model_dump_json())
    progress_file = Path(spec.progress_file)

    def poll() -> None:
        seen = read_paired_progress(progress_file)
        if progress is not None and seen is not None:
            done, total, side = seen
            progress(done, total, f"iteration {done} ({side})")

    proc = start_ranks("ds_pipemorph.bench.paired_worker", spec_path, spec.stages, log)
    _wait(proc, deadline, log, poll)
    if not Path(spec.out).exists():
        raise PairedRunError(f"the ranks exited with code {proc.returncode} before writing results; see {log}")
    result = json.loads(Path(spec.out).read_text())
    result["mode"] = ONE_JOB
    return result


def _whole_jobs(spec: PairedSpec, work: Path, deadline: float, progress: Optional[Progress]) -> dict:
    sides = sequence(spec.iterations)
    scenario = Scenario(name="paired", links_ms=spec.links_ms)
    rows = []
    for k, label in enumerate(sides):
        side = spec.a if label in A_SIDE else spec.b
        schedule, dispatch = side.bench_row()
        out = work / f"job{k}.json"
        job = BenchSpec(stages=spec.stages, microbatches=spec.microbatches, op_ms=spec.op_ms, scenarios=[scenario],
                        schedules=[schedule], dispatches=[dispatch], iterations=spec.job_iterations,
                        warmup=spec.warmup, progress_file=str(work / f"job{k}.progress"), out=str(out),
                        budget=spec.budget)
        spec_path, log = work / f"job{k}.spec.json", work / f"job{k}.log"
        spec_path.write_text(job.model_dump_json())
        if progress is not None:
            progress(k, len(sides), f"job {k + 1} of {len(sides)} ({label}: {side.text})")
        proc = start_ranks("ds_pipemorph.bench.worker", spec_path, spec.stages, log)
        _wait(proc, deadline, log)
        if not out.exists():
            raise PairedRunError(f"job {k + 1} ({side.text}) exited with code {proc.returncode} before writing "
                                 f"results; see {log}")
        times = json.loads(out.read_text())["results"][0]["iterations_ms"]
        rows.append({"index": k, "side": label, "config": side.text, "ms": median(times), "measured": True,
                     "job_iterations_ms": times})
    if progress is not None:
        progress(len(sides), len(sides), "done")
    return {"spec": spec.model_dump(), "iterations": rows,
            "mode": WHOLE_JOBS.format(a=spec.a.text, b=spec.b.text, n=spec.job_iterations)}
