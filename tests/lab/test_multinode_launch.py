"""recipes/tiny_gpt trained across 4 lab nodes x 1 rank, launched as on a cluster (torchrun per node;
the deepspeed launcher per node without ssh), matches the single-host run: every step's loss and
every final parameter within 1e-5."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_pipemorph.lab import Lab
from ds_pipemorph.procs import run_group

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "recipes" / "tiny_gpt" / "train.py")
STEPS = 4
NODES = 4
# torchrun gives each of several local ranks one thread, a node with one rank gets them all; Adam
# turns the rounding of a different reduction order into 1e-5 steps on parameters whose gradient is
# ~0 (the attention key bias). The same thread count on both sides makes the arithmetic the same.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def train_args(out: Path) -> list[str]:
    return [TRAIN, "--steps", str(STEPS), "--save-params", str(out)]


def load(out: Path) -> dict[int, dict]:
    return {s: torch.load(out / f"stage{s}.pt") for s in range(NODES)}


def run_single_host(out: Path) -> None:
    # A first start builds DeepSpeed's FusedAdam op (minutes on a loaded machine); a timeout kills
    # the ranks with torchrun.
    res = run_group([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                     str(NODES), *train_args(out)], timeout=1500, env={**os.environ, **ONE_THREAD})
    assert res.returncode == 0, res.stderr[-3000:]


def run_in_lab(lab: Lab, commands: list[list[str]], logs: Path) -> None:
    procs = []
    for k, cmd in enumerate(commands):
        log = open(logs / f"node{k}.log", "w")
        procs.append(lab.popen(k, cmd, env={**os.environ, **ONE_THREAD, **lab.node_env(k)}, stdout=log, stderr=subprocess.STDOUT,
                               cwd=str(ROOT)))
    for k, p in enumerate(procs):
        try:
            code = p.wait(timeout=600)
        except subprocess.TimeoutExpired:
            code = "timeout"
        assert code == 0, f"node {k} ({code}): {(logs / f'node{k}.log').read_text()[-3000:]}"


def torchrun(lab: Lab, k: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc_per_node", "1",
            "--node_rank", str(k), "--master_addr", lab.addr(0), "--master_port", "29611", *train_args(out)]


def deepspeed_launcher(lab: Lab, k: int, out: Path, hostfile: Path) -> list[str]:
    return ["deepspeed", "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(k),
            "--master_addr", lab.addr(0), "--master_port", "29612", *train_args(out)]


def sent_bytes(lab: Lab, node: int) -> int:
    out = subprocess.run(["tc", "-n", lab.ns(node), "-s", "qdisc", "show", "dev", lab.ifname()],
                         capture_output=True, text=True, check=True).stdout
    return int(re.search(r"Sent (\d+) bytes", out).group(1))


def assert_same_training(got: dict, want: dict) -> None:
    for s in range(NODES):
        assert got[s]["stage"] == s
        assert len(got[s]["losses"]) == STEPS
        assert got[s]["losses"] == pytest.approx(want[s]["losses"], abs=1e-5)
        assert got[s]["params"].keys() == want[s]["params"].keys()
        for name, w in want[s]["params"].items():
            torch.testing.assert_close(got[s]["params"][name], w, atol=1e-5, rtol=0, msg=f"stage {s} {name}")


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_tiny_gpt_on_4_lab_nodes_trains_as_on_one_host(lab_capable, tmp_path):
    ref = tmp_path / "single_host"
    run_single_host(ref)
    want = load(ref)
    # The single-host run itself trains: the loss of the last step is below the first one's.
    assert want[0]["losses"][-1] < want[0]["losses"][0]
    hostfile = tmp_path / "hostfile"
    with Lab(nodes=NODES) as lab:
        hostfile.write_text("".join(f"{lab.addr(k)} slots=1\n" for k in range(NODES)))
        for name, cmd in (("torchrun", torchrun), ("deepspeed", deepspeed_launcher)):
            out, logs = tmp_path / name, tmp_path / f"{name}_logs"
            logs.mkdir()
            run_in_lab(lab, [cmd(lab, k, out, *([hostfile] if name == "deepspeed" else []))
                             for k in range(NODES)], logs)
            assert_same_training(load(out), want)
        # Activations and gradients crossed the lab's network: every node sent through its interface.
        assert all(sent_bytes(lab, k) > 100_000 for k in range(NODES))
