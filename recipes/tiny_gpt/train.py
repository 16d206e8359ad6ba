"""Train the tiny GPT with ds_pipemorph on 4 pipeline stages (CPU or GPU); prints the loss.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 4 recipes/tiny_gpt/train.py --steps 40
    deepspeed --num_gpus 4 recipes/tiny_gpt/train.py --steps 40
    deepspeed --num_gpus 8 recipes/tiny_gpt/train.py --stages 2 --tensor-parallel 2 --config CONFIG

With ``--tensor-parallel T`` each stage runs on T ranks (``tp_layers.py``; the ds_config needs
``"pipeline": {"pipe_partitioned": false, "grad_partitioned": false}``) and the job has
world / (stages x T) data-parallel replicas.

Data: character-level next-token prediction on random windows of a small built-in text. A config
the engine cannot use ends the job with one sentence on rank 0 and exit code 2.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.utils import RepeatingLoader  # noqa: E402

import ds_pipemorph  # noqa: E402
from ds_pipemorph.runtime.shutdown import release_process_groups  # noqa: E402
from ds_pipemorph.staging.builder import prepare_comm_op  # noqa: E402
from model import tiny_gpt  # noqa: E402
from tp_layers import tiny_gpt_tensor_parallel  # noqa: E402

TEXT = (
    "pipeline parallel training splits a model into stages that work on micro-batches in turn. "
    "a slow link between two stages stalls everything behind it unless the schedule leaves slack. "
    "zero bubble schedules split the backward pass into an input part and a weight part. "
) * 8


class CharWindows(torch.utils.data.Dataset):
    """Random windows of TEXT as (input ids, next ids), deterministic per index."""

    def __init__(self, seq: int, size: int):
        self.chars = sorted(set(TEXT))
        self.ids = torch.tensor([self.chars.index(c) for c in TEXT])
        self.seq, self.size = seq, size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        start = int(torch.randint(0, len(self.ids) - self.seq - 1, (1,), generator=g))
        w = self.ids[start: start + self.seq + 1]
        return w[:-1], w[1:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--tensor-parallel", type=int, default=1, metavar="T",
                    help="ranks per stage that split its layers (1: the dense model); must divide the 4 heads")
    ap.add_argument("--config", default=str(HERE / "ds_config.json"), help="DeepSpeed config with a pipemorph section")
    ap.add_argument("--save-params", metavar="DIR",
                    help="write each stage's final parameters and every step's loss to DIR/stage<s>.pt")
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args = ap.parse_args()
    if args.tensor_parallel < 1:
        ap.error(f"--tensor-parallel must be a positive integer, not {args.tensor_parallel}")

    prepare_comm_op()  # the first start on a CPU builds DeepSpeed's collectives op: say so, and guard its build
    deepspeed.init_distributed()
    torch.manual_seed(0)
    data = CharWindows(args.seq, size=100_000)
    tp, world = args.tensor_parallel, dist.get_world_size()
    if tp == 1:
        model = tiny_gpt(vocab=len(data.chars), stages=args.stages, max_seq=args.seq)
    elif world % (args.stages * tp):
        return refuse(f"--stages x --tensor-parallel ({args.stages} x {tp}) must divide the {world} ranks")
    else:
        try:
            model = tiny_gpt_tensor_parallel(vocab=len(data.chars), stages=args.stages, tensor_parallel=tp,
                                             data_parallel=world // (args.stages * tp), max_seq=args.seq)
        except ValueError as e:  # a size the model cannot split into
            return refuse(str(e))
    engine, _, _, _ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(),
                                              config=args.config)
    loader = RepeatingLoader(torch.utils.data.DataLoader(
        data, batch_size=engine.train_micro_batch_size_per_gpu(),
        sampler=torch.utils.data.DistributedSampler(data, num_replicas=engine.dp_world_size,
                                                    rank=engine.mpu.get_data_parallel_rank(), shuffle=False)))
    it = iter(loader)
    first = last = None
    losses = []
    t0 = time.monotonic()
    for step in range(1, args.steps + 1):
        loss = float(engine.train_batch(it))
        first = loss if first is None else first
        last = loss
        losses.append(loss)
        if dist.get_rank() == 0 and (step == 1 or step % 5 == 0):
            print(f"step {step:4d}  loss {loss:.4f}  ({time.monotonic() - t0:.1f} s)", flush=True)
    if dist.get_rank() == 0:
        print(f"layout: {args.stages} stages x {tp} tensor-parallel x {engine.dp_world_size} data-parallel "
              f"ranks", flush=True)
        print(f"loss {first:.4f} -> {last:.4f} over {args.steps} steps "
              f"(peak in-flight activations on stage 0: {engine.measured_peak_inflight})", flush=True)
    if args.save_params:
        save_stage(args.save_params, engine, losses)
    engine.destroy()  # its workers stop now (an exit would stop them too)
    # Every process group destroyed and DeepSpeed's references to them dropped, which joins gloo's
    # threads: left to the interpreter's exit, one could abort the process (a stock engine has no
    # ds_pipemorph exit handler to do it).
    release_process_groups()
    return 0


def refuse(sentence: str) -> int:
    """Every rank ends with exit code 2; rank 0 says why."""
    if dist.get_rank() == 0:
        print(f"error: {sentence}", file=sys.stderr, flush=True)
    return 2


def save_stage(out_dir: str, engine, losses: list[float]) -> None:
    """This rank's stage parameters and the loss of every step, written atomically to stage<s>.pt,
    or stage<s>.tp<t>.pt for tensor-parallel rank t (its shards) with tensor parallelism."""
    import io

    from ds_pipemorph.fileio import write_atomic

    tp, t = engine.grid.get_slice_parallel_world_size(), engine.grid.get_slice_parallel_rank()
    name = f"stage{engine.stage_id}.pt" if tp == 1 else f"stage{engine.stage_id}.tp{t}.pt"
    buf = io.BytesIO()
    torch.save({"stage": engine.stage_id, "losses": losses, "params": engine.module.state_dict()}, buf)
    write_atomic(Path(out_dir) / name, buf.getvalue())


if __name__ == "__main__":
    sys.exit(main())
