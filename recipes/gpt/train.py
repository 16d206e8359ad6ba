"""Train the GPT on bytes of Python's standard library source with ds_pipemorph (or, with --stock,
plain DeepSpeed) on 4 pipeline stages; prints the training loss and a held-out validation loss.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 4 recipes/gpt/train.py --steps 300
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 4 recipes/gpt/train.py --steps 300

Data: random windows of the standard library's ``*.py`` files (``data.py``), vocabulary 256 bytes;
the validation windows come from other files. The config's ``pipeline.activation_checkpoint_interval``
goes into the PipelineModule, as GPT-NeoX passes it, with ``Block`` as the checkpointable layer. A
config the engine cannot use ends the job with one sentence on rank 0 and exit code 2.
"""
from __future__ import annotations

import argparse
import math
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
from ds_pipemorph.runtime.initialize import load_config  # noqa: E402
from ds_pipemorph.staging.builder import prepare_comm_op  # noqa: E402
from ds_pipemorph.runtime.shutdown import release_process_groups  # noqa: E402
from data import VOCAB, ByteWindows  # noqa: E402
from model import gpt  # noqa: E402

UNIFORM = math.log(VOCAB)  # the loss of a uniform guess over the bytes: where an untrained model starts


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=positive, default=300)
    ap.add_argument("--seq", type=positive, default=64, help="window length in bytes (the model's max_seq)")
    ap.add_argument("--stages", type=positive, default=4)
    ap.add_argument("--log-every", type=positive, default=10, help="print the loss every N steps (and at step 1)")
    ap.add_argument("--val-batches", type=positive, default=4,
                    help="evaluation batches (of the config's micro-batches) for the validation loss")
    ap.add_argument("--config", default=str(HERE / "ds_config.json"), help="DeepSpeed config with a pipemorph section")
    ap.add_argument("--stock", action="store_true",
                    help="train with plain deepspeed.initialize (the pipemorph section is dropped) for comparison")
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    return ap.parse_args(argv)


def build(args):
    """The engine (ds_pipemorph's, or with --stock DeepSpeed's) and the model it trains."""
    prepare_comm_op()  # the first start on a CPU builds DeepSpeed's collectives op: say so, and guard its build
    config = load_config(args.config)
    interval = int(config.get("pipeline", {}).get("activation_checkpoint_interval", 0) or 0)
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = gpt(vocab=VOCAB, stages=args.stages, max_seq=args.seq, checkpoint_interval=interval)
    if args.stock:
        config.pop("pipemorph", None)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:  # the path, not the dict: relative paths in the pipemorph section are read against its directory
        engine, _, _, _ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(),
                                                  config=args.config)
    return engine


def windows_per_batch(engine) -> int:
    """Windows one ``train_batch`` (or ``eval_batch``) reads over all data-parallel replicas."""
    return engine.train_micro_batch_size_per_gpu() * engine.gradient_accumulation_steps() * engine.dp_world_size


def loader(engine, data, repeat: bool):
    """This data-parallel rank's share of ``data`` in micro-batches, in index order."""
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=engine.dp_world_size,
                                                  rank=engine.mpu.get_data_parallel_rank(), shuffle=False)
    batches = torch.utils.data.DataLoader(data, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler)
    return RepeatingLoader(batches) if repeat else batches


def main() -> int:
    args = parse_args()
    engine = build(args)  # a setting it refuses: one sentence from rank 0, exit 2 (ds_pipemorph.initialize)
    rank0 = dist.get_rank() == 0
    train = ByteWindows("train", args.seq, size=args.steps * windows_per_batch(engine))
    it = iter(loader(engine, train, repeat=True))
    losses = []
    t0 = time.monotonic()
    for step in range(1, args.steps + 1):
        losses.append(float(engine.train_batch(it)))
        if rank0 and (step == 1 or step % args.log_every == 0 or step == args.steps):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  ({time.monotonic() - t0:.1f} s)", flush=True)
    train_s = time.monotonic() - t0
    val = validation_loss(engine, args)
    if rank0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps in {train_s:.1f} s "
              f"({'stock DeepSpeed' if args.stock else 'ds_pipemorph'})", flush=True)
        print(f"final train loss {losses[-1]:.3f} (uniform baseline ln {VOCAB} = {UNIFORM:.3f})", flush=True)
        print(f"validation loss {val:.3f} on held-out files", flush=True)
    engine.destroy()  # ds_pipemorph's workers stop now (an exit would stop them too)
    # Every process group destroyed and DeepSpeed's references to them dropped, which joins gloo's
    # threads: left to the interpreter's exit, one could abort the process (a stock engine has no
    # ds_pipemorph exit handler to do it).
    release_process_groups()
    return 0


def validation_loss(engine, args) -> float:
    """Mean loss of ``--val-batches`` evaluation batches of held-out windows (no gradient, no step)."""
    val = ByteWindows("val", args.seq, size=args.val_batches * windows_per_batch(engine))
    it = iter(loader(engine, val, repeat=False))
    losses = [float(engine.eval_batch(it)) for _ in range(args.val_batches)]
    return sum(losses) / len(losses)


if __name__ == "__main__":
    sys.exit(main())
