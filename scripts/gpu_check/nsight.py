"""A real Nsight Systems capture of a 4-rank job on one GPU, read back by ``pipemorph trace inspect``.

    python scripts/gpu_check/nsight.py WORK_DIR KEYS.json

``nsys profile --trace nvtx,cuda`` of ``tests/nvtx/nvtx_job.py`` under torchrun (2 stages x 2 replicas,
all on cuda:0 through ``on_gpu0.py``, gloo, NVTX on, 3 micro-batches, 2 batches; ``delegation.mode``
"always" as in ``one_gpu_job.py``, so messages cross through the staging rings and the delegates' CPU
gloo groups), ``nsys export --type sqlite``, then ``pipemorph trace inspect --json``. Checked as ``tests/nvtx/test_nsys_capture.py`` checks
the injection-recorded export: no warnings, iterations 0 and 1, each rank with the stage and pid it wrote,
the F/B/W and send/receive ops of every iteration, every message of the link paired. On a GPU these NVTX
ranges time kernel launches, not kernels. The three commands share what is left of the step's budget
(``GPU_CHECK_STEP_S``). Writes KEYS.json; exit 1 on a failure.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from step import launch, start_step, write_keys  # noqa: E402  (this directory is the script's: first on sys.path)

left_s = start_step()  # SIGTERM exits through run_group's cleanup; the budget left, less 10 s for the key file


REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from ds_pipemorph.procs import torchrun  # noqa: E402


STAGES, DP, N, STEPS = 2, 2, 3, 2


def expected_ops(stage: int) -> dict[str, int]:
    ops = {"F": N, "B": N, "W": N}
    if stage > 0:
        ops.update(RECV_F=N, SEND_B=N)
    if stage < STAGES - 1:
        ops.update(SEND_F=N, RECV_B=N)
    return dict(sorted(ops.items()))


def run(cmd: list[str], log, env: dict) -> subprocess.CompletedProcess:
    """Runs CMD within what is left of the step's budget (exit 124 when it does not end in time)."""
    log.write(f"$ {' '.join(cmd)}\n")
    code, out, err = launch(cmd, left_s, REPO, env)
    p = subprocess.CompletedProcess(cmd, 124 if code is None else code, out, err)
    log.write(p.stdout + p.stderr + f"(exit {p.returncode})\n")
    log.flush()
    return p


def main() -> int:
    work, keys_path = Path(sys.argv[1]), Path(sys.argv[2])
    work.mkdir(parents=True, exist_ok=True)
    rep, sqlite = work / "job.nsys-rep", work / "job.sqlite"
    env = {**os.environ, "DS_ACCELERATOR": "cuda", "GPU_CHECK_DELEGATION": "always", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    failures: list[str] = []
    keys: dict = {}
    with open(work / "nsight.log", "w") as log:
        job = [*torchrun(work / "torchrun", "--standalone", f"--nproc_per_node={STAGES * DP}"),
               str(REPO / "scripts" / "gpu_check" / "on_gpu0.py"), str(REPO / "tests" / "nvtx" / "nvtx_job.py"),
               str(work), str(STAGES), str(DP), str(N), str(STEPS)]
        steps = [
            ["nsys", "profile", "--trace=nvtx,cuda", "--sample=none", "--cpuctxsw=none", "--force-overwrite=true",
             f"--output={work / 'job'}", *job],
            ["nsys", "export", "--type=sqlite", "--force-overwrite=true", f"--output={sqlite}", str(rep)],
            [shutil.which("pipemorph") or "pipemorph", "trace", "inspect", str(sqlite), "--json"],
        ]
        for cmd in steps:
            p = run(cmd, log, env=env)
            if p.returncode != 0:
                failures.append(f"`{' '.join(cmd[:3])} ...` exited with {p.returncode} (see {work / 'nsight.log'})")
                break
        else:
            out = json.loads(p.stdout)
            ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(STAGES * DP)]
            truth = sorted((me["rank"], me["stage"], me["pid"]) for me in ranks)
            seen = [(x["rank"], x["stage"], x["pid"]) for x in out["ranks"]]
            if out["warnings"]:
                failures.append(f"trace inspect warned: {out['warnings'][:3]}")
            if out["iterations"] != list(range(STEPS)):
                failures.append(f"iterations {out['iterations']}, expected {list(range(STEPS))}")
            if seen != truth:
                failures.append(f"(rank, stage, pid) read back {seen}, the ranks wrote {truth}")
            for x in out["ranks"]:
                got = [it["ops"] for it in x["per_iteration"]]
                if got != [expected_ops(x["stage"])] * STEPS:
                    failures.append(f"rank {x['rank']}: ops per iteration {got}")
            links = out.get("links", [])
            if [(lk["link"], lk["unmatched"], lk["messages"]) for lk in links] != [(0, 0, DP * STEPS * N * 2)]:
                failures.append(f"links read back: {links}")
            keys = {"ranks": len(out["ranks"]), "iterations": out["iterations"],
                    "median_iteration_ms": {str(x["rank"]): x["iteration_ms"]["median"] for x in out["ranks"]},
                    "nvtx_active": [me["nvtx_active"] for me in ranks]}
    shutil.rmtree(work / "torchrun", ignore_errors=True)  # torchrun's log folder: the ranks' output is in ours
    return write_keys(keys_path, failures, keys)


if __name__ == "__main__":
    sys.exit(main())
