"""Launch ``worker.py`` under torchrun with a list of jobs and read back what each rank wrote."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from ds_pipemorph.procs import run_group

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@dataclass
class Launch:
    returncode: int
    output: str
    out_dir: Path

    def result(self, name: str, rank: int) -> dict:
        path = self.out_dir / f"{name}.rank{rank}.pt"
        assert path.exists(), f"{path.name} missing; launch output:\n{self.output[-4000:]}"
        return torch.load(path)

    def error(self, name: str, rank: int) -> str:
        path = self.out_dir / f"{name}.rank{rank}.err"
        assert path.exists(), f"{path.name} missing; launch output:\n{self.output[-4000:]}"
        return path.read_text()


def launch(nproc: int, jobs: list[dict], out_dir: Path, timeout: float) -> Launch:
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = out_dir / "jobs.json"
    spec.write_text(json.dumps(jobs))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(HERE / "worker.py"), str(spec), str(out_dir)]
    p = run_group(cmd, timeout, cwd=REPO, env=env)
    return Launch(p.returncode, p.stdout + p.stderr, out_dir)


def max_param_diff(a: dict, b: dict) -> float:
    assert a["params"].keys() == b["params"].keys()
    return max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"])
