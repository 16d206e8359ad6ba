"""Peak memory of an iteration against the engine's prediction: stock DeepSpeed 1F1B, ``zb``,
``adaptive`` and ``adaptive`` granted 1.5x, 4 ranks.

    python scripts/gpu_check/memory_job.py WORK_DIR KEYS.json                 # 4 ranks on cuda:0
    python scripts/gpu_check/memory_job.py WORK_DIR KEYS.json --device cpu    # the same on CPU

One torchrun launch of ``peak_memory.py`` (what each rank measures, and the checks: its docstring).
On a GPU every rank runs on cuda:0 through ``on_gpu0.py`` (gloo, point-to-point messages staged
through host memory) and the figure is ``torch.cuda.max_memory_allocated`` less what was allocated at
the iteration's start; with ``--device cpu`` (``DS_ACCELERATOR=cpu``) it is the engine's activation
meter, and ``tests/scripts/test_gpu_check.py`` runs it so. Prints the numbers (the step's log), writes
KEYS.json; exit 1 on a failure. The launch gets what is left of the step's budget (``GPU_CHECK_STEP_S``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from step import launch, start_step, write_keys  # noqa: E402  (this directory is the script's: first on sys.path)

left_s = start_step()  # SIGTERM exits through run_group's cleanup; the budget left, less 10 s for the key file

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from ds_pipemorph.procs import torchrun  # noqa: E402

from peak_memory import S, compare, table  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("keys", type=Path)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    result_path = a.work / "peak_memory.json"
    result_path.unlink(missing_ok=True)
    on_gpu = a.device == "cuda"
    env = {**os.environ, "DS_ACCELERATOR": "cuda" if on_gpu else "cpu",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    wrapper = [str(HERE / "on_gpu0.py")] if on_gpu else []
    cmd = [*torchrun(a.work / "torchrun", "--standalone", f"--nproc_per_node={S}"), *wrapper,
           str(HERE / "peak_memory.py"), str(result_path), "--device", "cuda:0" if on_gpu else "cpu"]
    code, out, err = launch(cmd, left_s, REPO, env)
    (a.work / "launch.log").write_text(out + err)
    if not result_path.is_file():
        print((out + err)[-4000:])
        return write_keys(a.keys, [f"the launch wrote no {result_path.name} (exit code {code})"],
                          {"launch_exit_code": code})
    result = json.loads(result_path.read_text())
    print(table(result))
    keys, failures = compare(result)
    keys["launch_exit_code"] = code  # judged by the file, as the other steps are (DeepSpeed may abort at exit)
    return write_keys(a.keys, failures, keys)


if __name__ == "__main__":
    sys.exit(main())
