"""A 2-stage PipeMorph engine per delegation mode; records what each rank's process holds
before its first ``train_batch``.

    python tests/runtime/forkrun.py 2 tests/delegated/engine_start_worker.py OUT_DIR MODE [MODE ...]

Per mode and rank it writes OUT_DIR/<mode>.rank<r>.json: whether the staging op's shared library was mapped
into the process (``/proc/self/maps``) right after the engine was built, the command lines of the rank's
child processes then and after the steps (``/proc``: the fork server delegates come from shows there), the
losses of 2 steps, and the messages each link sent through delegates (none: no link is slow). The modes
run in order in the same processes; a library once loaded stays mapped and a fork server once started
keeps running, so a mode that must not load or start them goes first.
"""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "runtime"))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import deepspeed  # noqa: E402
import psutil  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ds_pipemorph  # noqa: E402
from ds_pipemorph.staging.builder import StagingRingBuilder  # noqa: E402
from models import batches, build_model, ds_config  # noqa: E402

N, STEPS = 4, 2


def mapped(library: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith("/" + library) for line in f)


def children() -> list[str]:
    """Command lines of this process's live child processes."""
    lines = []
    for child in psutil.Process().children():
        try:
            lines.append(" ".join(child.cmdline()))
        except psutil.NoSuchProcess:  # ended meanwhile
            pass
    return lines


def run(mode: str, out_dir: str, rank: int) -> None:
    model = build_model(2, seed=1234)
    cfg = ds_config(N, pipemorph={"schedule": "zb", "delegation": {"mode": mode}})
    engine, _, _, _ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    loaded_at_start = mapped(f"{StagingRingBuilder().name}.so")
    children_at_start = children()
    it = iter(batches(N * STEPS, 2, seed=99))
    losses = [float(engine.train_batch(it)) for _ in range(STEPS)]
    delegated = engine.transport.delegated
    sent = {str(k): v for k, v in delegated.sent.items()}
    children_after = children()
    engine.transport.close()
    with open(os.path.join(out_dir, f"{mode}.rank{rank}.json"), "w") as f:
        json.dump({"loaded_at_start": loaded_at_start, "losses": losses, "delegated_sent": sent,
                   "children_at_start": children_at_start, "children_after": children_after}, f)


def main() -> int:
    out_dir, modes = sys.argv[1], sys.argv[2:]
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        for mode in modes:
            run(mode, out_dir, dist.get_rank())
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
