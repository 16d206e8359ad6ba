"""A training script as the README writes one, no helper calls: the jobs of test_stopping.py.

    torchrun --standalone --nproc_per_node 4 tests/runtime/life_job.py OUT_DIR MODE STEPS [KEY=VALUE ...]

Each rank writes OUT_DIR/rank<r>.pid (its pid, and its delegates' pids once they run) and touches
OUT_DIR/step<k>.rank<r> after step k. MODE: "direct" (every link direct) or "delegated" (every link
through delegates: staging rings in /dev/shm). KEY=VALUE pairs go into the pipemorph section (a
number, or text): e.g. timeline=/proc/no/t.json; job.sigstop_rank=R job.sigstop_step=K: rank R stops
itself with SIGSTOP after step K (between two steps: every rank's next wait is then on a link).
A rank that returns writes OUT_DIR/exit.rank<r>: whether its process groups were released before
the exit handlers registered ahead of ``initialize`` ran (they run after the package's own).
"""
import atexit
import json
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import deepspeed  # noqa: E402

import ds_pipemorph  # noqa: E402
from models import batches, build_model, ds_config  # noqa: E402

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
out_dir, mode, steps = args[0], args[1], int(args[2])
extra = {}
for kv in args[3:]:
    k, v = kv.split("=", 1)
    extra[k] = json.loads(v) if v[:1].isdigit() or v[:1] in "[{" else v
rank = int(os.environ["RANK"])
stages = int(os.environ["WORLD_SIZE"])
N = 4
job = {k[4:]: extra.pop(k) for k in list(extra) if k.startswith("job.")}  # the script's own options
pm = {"schedule": "zb", "timeout_s": 60, "delegation": {"mode": "always" if mode == "delegated" else "off"}, **extra}
deepspeed.init_distributed(dist_backend="gloo")


@atexit.register
def _note_exit():
    import torch.distributed as dist

    with open(os.path.join(out_dir, f"exit.rank{rank}"), "w") as f:
        f.write("released" if not dist.is_initialized() else "groups still there")


model = build_model(stages, seed=1)
config = ds_config(N, pipemorph=pm)
# No gradient clipping: its norm is an all-reduce over the stages that waits DeepSpeed's timeout
# (30 min), not pipemorph's timeout_s, for a rank that makes no progress.
config.pop("gradient_clipping")
engine, _, _, _ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(), config=config)
data = batches(N, 2, seed=2)


def pids():
    d = engine.transport.delegated
    return [os.getpid()] + [q.proc.pid for x in list(d._dirs.values()) for q in x.queues]


for step in range(steps):
    engine.train_batch(iter(data))
    if step < 3 or step % 10 == 0:  # written whole (the test reads it at any moment)
        tmp = os.path.join(out_dir, f".rank{rank}.pid")
        with open(tmp, "w") as f:
            f.write(" ".join(map(str, pids())))
        os.replace(tmp, os.path.join(out_dir, f"rank{rank}.pid"))
    open(os.path.join(out_dir, f"step{step}.rank{rank}"), "w").close()
    if job.get("sigstop_rank") == rank and job.get("sigstop_step") == step:  # stopped between two steps
        os.kill(os.getpid(), signal.SIGSTOP)
