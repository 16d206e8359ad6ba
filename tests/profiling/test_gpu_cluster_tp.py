"""recipes/gpu_cluster/launch.sh's 3D layout, run for real: its CPU dry run trains the tensor-parallel
tiny GPT (recipes/tiny_gpt/tp_layers.py) on 2 stages x 2 tensor-parallel ranks, and the same dry run
with TP=1 trains the dense tiny GPT on 2 stages. The two must train alike: the same losses, and the
tensor-parallel ranks' shards put back together are the dense parameters (within 1e-5, fp32).

Both runs use the recipe's ds_config with ``gradient_clipping`` off: DeepSpeed's clip norm (``clip_grad_norm_``
with the pipeline grid) counts every rank's sharded parameters but the whole ones of the model group's rank 0
only, so it sums different parameters in a dense and a tensor-parallel pipeline, and a clipped step differs
between them. That the engine clips as stock DeepSpeed does under tensor parallelism is
tests/runtime/test_tensor_parallel.py's check.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ds_pipemorph.procs import free_port, run_group

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "recipes" / "gpu_cluster" / "launch.sh"
TRAIN = ROOT / "recipes" / "tiny_gpt" / "train.py"
CONFIG = ROOT / "recipes" / "gpu_cluster" / "ds_config.json"
STAGES, TP, STEPS, TOL = 2, 2, 3, 1e-5


def _env(**more) -> dict:
    # launch.sh calls `deepspeed`: this interpreter's, when it has one beside it.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            **more}


def _dry_run(tp: int, config: Path, out: Path) -> str:
    env = _env(LOCAL_CPU="1", TP=str(tp), STAGES=str(STAGES), STEPS="train", TRAIN_STEPS=str(STEPS),
               OUT=str(out), CONFIG=str(config), MASTER_PORT=str(free_port()))
    r = run_group(["bash", str(LAUNCH), "--save-params", str(out / "params")], 600, cwd=ROOT, env=env)
    assert r.returncode == 0, f"TP={tp} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_cluster_tp")
    cfg = json.loads(CONFIG.read_text())
    cfg["gradient_clipping"] = 0.0  # DeepSpeed: no clipping
    config = tmp / "ds_config.json"
    config.write_text(json.dumps(cfg))
    return {tp: (_dry_run(tp, config, tmp / f"tp{tp}"), tmp / f"tp{tp}") for tp in (TP, 1)}


def _full(name: str, shards: list[dict]) -> tuple[str, torch.Tensor]:
    """The dense parameter a tensor-parallel parameter ``name`` is a shard of (``tp_layers``' split,
    written out here again): its name in ``model.Block`` and the shards of every rank put together."""
    block, rest = name.split(".", 1)
    parts = [s[name] for s in shards]
    if rest.startswith("qkv.linear."):  # rows: each rank's heads of q, of k and of v
        return f"{block}.qkv.{rest.rsplit('.', 1)[1]}", torch.cat(
            [p.view(3, -1, *p.shape[1:]) for p in parts], dim=1).flatten(0, 1)
    if rest == "proj.linear.weight":  # columns: each rank's heads
        return f"{block}.proj.weight", torch.cat(parts, dim=1)
    if rest.startswith("fc1.linear."):
        return f"{block}.mlp.0.{rest.rsplit('.', 1)[1]}", torch.cat(parts, dim=0)
    if rest == "fc2.linear.weight":
        return f"{block}.mlp.2.weight", torch.cat(parts, dim=1)
    # Whole on every rank: the same on each.
    assert all(torch.equal(p, parts[0]) for p in parts), f"{name} differs between tensor-parallel ranks"
    return {"fc2.bias": f"{block}.mlp.2.bias"}.get(rest, name), parts[0]


@pytest.mark.slow
@pytest.mark.timeout(1260)
def test_launch_sh_trains_the_tensor_parallel_tiny_gpt_as_the_dense_one(runs):
    (tp_out, tp_dir), (dense_out, dense_dir) = runs[TP], runs[1]
    assert f"layout: {STAGES} stages x {TP} tensor-parallel x 1 data-parallel ranks" in tp_out, tp_out[-2000:]
    assert f"layout: {STAGES} stages x 1 tensor-parallel x 1 data-parallel ranks" in dense_out, dense_out[-2000:]
    for out in (tp_out, dense_out):
        m = re.search(rf"loss (\S+) -> (\S+) over {STEPS} steps", out)
        assert m and all(math.isfinite(float(x)) for x in m.groups()), out[-2000:]
    for s in range(STAGES):
        dense = torch.load(dense_dir / "params" / f"stage{s}.pt")
        ranks = [torch.load(tp_dir / "params" / f"stage{s}.tp{t}.pt") for t in range(TP)]
        for t, r in enumerate(ranks):
            assert len(r["losses"]) == STEPS and r["losses"] == pytest.approx(dense["losses"], abs=TOL), \
                f"stage {s} tensor-parallel rank {t}: {r['losses']} vs dense {dense['losses']}"
        shards = [r["params"] for r in ranks]
        full = dict(_full(name, shards) for name in shards[0])
        assert full.keys() == dense["params"].keys(), (sorted(full), sorted(dense["params"]))
        for name, p in full.items():
            assert (p - dense["params"][name]).abs().max().item() <= TOL, f"stage {s}: {name} differs"
    # The control loop ran on the 3D layout and wrote its measured profile (launch.sh: under $OUT).
    profile = yaml.safe_load((tp_dir / "measured_profile.yaml").read_text())
    assert profile["stages"] == STAGES and len(profile["links_ms"]) == STAGES - 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("tp", ["0", "two", "-1", "1.5"])
def test_launch_sh_refuses_a_tensor_parallel_size_that_is_not_a_positive_integer(tp):
    r = subprocess.run(["bash", str(LAUNCH)], cwd=ROOT, env=_env(TP=tp, STEPS="train"), capture_output=True,
                       text=True, timeout=20)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"error: TP must be a positive integer (tensor-parallel ranks per stage), not '{tp}'"


@pytest.mark.timeout(120)
def test_train_py_refuses_a_layout_the_ranks_do_not_fill():
    r = run_group([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", str(TRAIN),
                   "--stages", "2", "--tensor-parallel", "2"], 100, cwd=ROOT, env=_env(DS_ACCELERATOR="cpu"))
    assert r.returncode != 0
    assert "error: --stages x --tensor-parallel (2 x 2) must divide the 1 ranks" in r.stderr, r.stderr[-2000:]
