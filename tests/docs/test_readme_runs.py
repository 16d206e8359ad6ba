"""The README's long commands, run for real in shorter form: the demo, the GPT recipe, and the GPU
cluster's launch commands as their CPU equivalents (4 gloo ranks on this host, the GPU recipe's config).

tests/docs/test_readme_commands.py maps each README command to the test here that runs it.
"""
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import yaml

from ds_pipemorph.procs import free_port, run_group

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "recipes" / "tiny_gpt" / "train.py"
GPT_TRAIN = ROOT / "recipes" / "gpt" / "train.py"
GPU_CONFIG = ROOT / "recipes" / "gpu_cluster" / "ds_config.json"


# The module each console script runs, for an environment whose scripts live elsewhere (a venv
# made with --system-site-packages has pipemorph in its own bin, deepspeed and torchrun in the base one).
SCRIPT_MODULES = {"pipemorph": "ds_pipemorph_cli.app", "deepspeed": "deepspeed.launcher.runner",
                  "torchrun": "torch.distributed.run"}


def command(name: str) -> list[str]:
    """The README's ``name`` command as this interpreter runs it: its console script, or the module
    the script runs."""
    here = Path(sys.executable).parent / name
    return [str(here)] if here.exists() else [sys.executable, "-m", SCRIPT_MODULES[name]]


def run(argv, cwd, timeout):
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    r = run_group([str(a) for a in argv], timeout, cwd=cwd, env=env)  # a timeout kills the ranks too
    assert r.returncode == 0, f"{' '.join(map(str, argv))} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def losses(stdout: str, steps: int) -> tuple[float, float]:
    m = re.search(rf"loss (\S+) -> (\S+) over {steps} steps", stdout)
    assert m, stdout[-2000:]
    first, last = float(m.group(1)), float(m.group(2))
    assert math.isfinite(first) and math.isfinite(last)
    return first, last


def gpu_config_copy(cwd: Path) -> Path:
    """The GPU recipe's config, unchanged, beside the run: its relative profile_out lands in ``cwd``."""
    copy = cwd / "ds_config.json"
    copy.write_text(GPU_CONFIG.read_text())
    return copy


def check_measured_profile(cwd: Path) -> None:
    """The GPU config's profile_out, written by rank 0's control loop at the end of training."""
    config = json.loads(GPU_CONFIG.read_text())
    profile = yaml.safe_load((cwd / config["pipemorph"]["profile_out"]).read_text())
    assert profile["stages"] == 4 and profile["microbatches"] == config["gradient_accumulation_steps"]
    assert len(profile["links_ms"]) == 3 and all(t > 0 for t in profile["compute_ms"]["forward"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpt_recipe_trains_under_the_deepspeed_launcher_on_four_cpu_ranks(tmp_path):
    """README's training command, 20 steps: bf16, ZeRO-1, checkpointed blocks and a tied embedding
    through ds_pipemorph on 4 stages; the loss starts at a uniform guess over the bytes and falls."""
    port = free_port()
    stdout = run([*command("deepspeed"), "--num_gpus", "4", "--master_port", str(port), GPT_TRAIN, "--steps", "20"],
                 tmp_path, timeout=880)
    first, last = losses(stdout, 20)
    assert abs(first - math.log(256)) < 0.1 and last < first - 1.0, stdout[-2000:]
    assert re.search(r"^validation loss \d+\.\d+ on held-out files$", stdout, re.M), stdout[-2000:]
    # DeepSpeed's CPU all-reduce made a shared-memory buffer per rank; each rank removed its own.
    assert sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*")) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_cluster_config_trains_under_the_deepspeed_launcher_on_cpu(tmp_path):
    stdout = run([*command("deepspeed"), "--num_gpus", "4", "--master_port", str(free_port()), TRAIN,
                  "--config", gpu_config_copy(tmp_path), "--steps", "2"], tmp_path, timeout=880)
    losses(stdout, 2)
    check_measured_profile(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_cluster_config_trains_under_torchrun_c10d_rendezvous_on_cpu(tmp_path):
    stdout = run([*command("torchrun"), "--nnodes", "1", "--nproc_per_node", "4", "--rdzv_backend", "c10d",
                  "--rdzv_endpoint", f"127.0.0.1:{free_port()}", TRAIN, "--config", gpu_config_copy(tmp_path),
                  "--steps", "2"],
                 tmp_path, timeout=880)
    losses(stdout, 2)
    check_measured_profile(tmp_path)
