"""Checkpoints of a job whose layers moved (live migration): the partition travels with them.

DeepSpeed saves a pipeline's layers by their index in the model (``layer_05-model_states.pt``),
whichever stage runs them, but each stage's optimizer state in one file per stage: that file only
fits an engine whose stage holds the same layers. So ``save_checkpoint`` first writes the partition
in force into the checkpoint's directory (``pipemorph_parts.json``, a parts file as ``pipemorph
partition`` writes it, written atomically by global rank 0 before DeepSpeed writes ``latest``), and
``load_checkpoint`` moves the layers to that partition by live migrations before DeepSpeed loads the
states. A checkpoint without the file (DeepSpeed's own, or an older one) loads as before, and so does
one loaded without optimizer states (``load_module_only``, ``load_optimizer_states=False``) or as a
universal checkpoint: layers load by their index wherever they run, so the partition in force stays.
"""
from __future__ import annotations

import os
from typing import Optional

import torch.distributed as dist

from ..fileio import write_atomic
from ..plan.partition.parts import PartsFile, neighbour_steps, read_parts

PARTS_FILE = "pipemorph_parts.json"


class CheckpointPartitionError(RuntimeError):
    """The layers could not be moved to a checkpoint's partition, or its parts file does not fit."""


def default_tag(engine) -> str:
    """DeepSpeed's tag when none is given."""
    return f"global_step{engine.global_steps}"


def save_parts(engine, save_dir: str, tag: str) -> None:
    """Global rank 0 writes the partition in force into ``save_dir/tag``."""
    if engine.global_rank != 0:
        return
    path = os.path.join(save_dir, tag, PARTS_FILE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, PartsFile(parts=list(engine.module.parts)).model_dump_json(exclude_none=True) + "\n")


def latest_tag(load_dir: str) -> Optional[str]:
    """The tag DeepSpeed's ``latest`` file names, or None without one (DeepSpeed then warns)."""
    path = os.path.join(load_dir, "latest")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip()


def saved_parts(load_dir: str, tag: Optional[str], layers: int, stages: int) -> Optional[list[int]]:
    """The partition the checkpoint was saved on, or None if it does not say; BadInput (one sentence)
    for a parts file that does not fit this model."""
    tag = latest_tag(load_dir) if tag is None else str(tag)
    if tag is None:
        return None
    path = os.path.join(load_dir, tag, PARTS_FILE)
    if not os.path.isfile(path):
        return None
    return read_parts(path, layers=layers, stages=stages).parts


def restore_parts(engine, load_dir: str, tag: Optional[str]) -> list[list[int]]:
    """Move this job's layers to the partition the checkpoint was saved on, in live-migration steps;
    every rank calls it (as ``load_checkpoint``) and returns the steps taken. Global rank 0 reads
    the checkpoint (the rank that wrote the file, so node-local storage works too) and tells the
    others, so every rank takes the same steps or raises the same error. Raises
    ``CheckpointPartitionError`` if a step failed: every rank then holds the partition the last
    good step reached."""
    now = list(engine.module.parts)
    said: list = [None, None]  # the saved partition, or the error reading it
    if engine.global_rank == 0:
        try:
            said[0] = saved_parts(load_dir, tag, layers=now[-1], stages=len(now) - 1)
        except Exception as e:  # noqa: BLE001 - told to every rank, which all raise it, rather than left waiting
            said[1] = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(said, src=0, group=engine.migrator.vote_group())
    saved, error = said
    if error is not None:
        raise CheckpointPartitionError(f"load_checkpoint {load_dir}: {error}")
    if saved is None:
        return []
    steps = neighbour_steps(now, saved)
    for parts in steps:
        report = engine.repartition(parts)
        if not report.ok:
            raise CheckpointPartitionError(
                f"stage {engine.stage_id}: could not move layers to the partition {saved} the checkpoint in "
                f"{load_dir} was saved on; every rank holds {list(engine.module.parts)}: {report.reason}")
    return steps
