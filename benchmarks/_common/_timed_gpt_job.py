"""One timed job of the GPT recipe on 2 stages, one thread per rank: each ``train_batch`` timed from a
barrier to a barrier; rank 0 prints one JSON line of the times (ms).

    torchrun --standalone --nproc_per_node 2 _timed_gpt_job.py CONFIG STEPS [stock]

``stock``: plain ``deepspeed.initialize`` on the same model and config, its pipemorph section
dropped (as ``recipes/gpt/train.py --stock`` does). Used by ``transport/startup_cost.py`` and
``engine/real_compute_ab.py``.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes" / "gpt"))
sys.path.insert(0, str(ROOT))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.utils import RepeatingLoader  # noqa: E402

import ds_pipemorph  # noqa: E402
from ds_pipemorph.runtime.shutdown import release_process_groups  # noqa: E402
from data import VOCAB, ByteWindows  # noqa: E402
from model import gpt  # noqa: E402


def main() -> None:
    config_path, steps = sys.argv[1], int(sys.argv[2])
    stock = sys.argv[3:] == ["stock"]
    torch.set_num_threads(1)
    deepspeed.init_distributed()
    torch.manual_seed(0)
    t_init = time.perf_counter()
    model = gpt(vocab=VOCAB, stages=2, max_seq=64)
    if stock:
        config = json.loads(Path(config_path).read_text())
        config.pop("pipemorph", None)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        engine, _, _, _ = ds_pipemorph.initialize(model=model, config=config_path)
    init_ms = (time.perf_counter() - t_init) * 1e3
    per_batch = engine.train_micro_batch_size_per_gpu() * engine.gradient_accumulation_steps()
    data = ByteWindows("train", 64, size=steps * per_batch)
    it = iter(RepeatingLoader(torch.utils.data.DataLoader(data, batch_size=engine.train_micro_batch_size_per_gpu())))
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_batch(it)
        dist.barrier()
        times.append((time.perf_counter() - t0) * 1e3)
    if dist.get_rank() == 0:
        print("STARTUP_TIMES " + json.dumps({"init_ms": init_ms, "times": times}), flush=True)
    engine.destroy()
    release_process_groups()  # before the interpreter's exit tears gloo's threads down (the stock engine too)


if __name__ == "__main__":
    main()
