"""Checkpoints of a job whose layers moved (live migration): the partition travels with them.

DeepSpeed saves a pipeline's layers by their index in the model (``layer_05-model_states.pt``),
whichever stage runs them, but each stage's optimizer state in one file per stage: that file only
fits an engine whose stage holds the same layers. So ``save_checkpoint`` first writes the partition
in force into the checkpoint's directory (``pipemorph_parts.json``, a parts file as ``pipemorph
partition`` writes it, written atomically by global rank 0 before DeepSpeed writes ``latest``), and
``load_checkpoint`` moves the layers to that partition by live migrations before DeepSpeed loads the
states. A checkpoint without the file (DeepSpeed's own, or an older one) loads as before.
"""
from __future__ import annotations

import os
from typing import Optional

from ..fileio import write_atomic
from ..plan.parts import PartsFile, neighbour_steps, read_parts

PARTS_FILE = "pipemorph_parts.json"


class CheckpointPartitionError(RuntimeError):
    """The layers could not be moved to a checkpoint's partition (every rank kept its layers)."""


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


def restore_parts(engine, load_dir: str, tag: Optional[str]) -> list[list[int]]:
    """Move this job's layers to the partition the checkpoint was saved on, in live-migration steps
    (every rank calls it, as ``load_checkpoint``); returns the steps taken. Raises
    ``CheckpointPartitionError`` if a step failed (every rank keeps the partition it had then)."""
    tag = latest_tag(load_dir) if tag is None else str(tag)
    if tag is None:
        return []
    path = os.path.join(load_dir, tag, PARTS_FILE)
    if not os.path.isfile(path):
        return []
    now = list(engine.module.parts)
    saved = read_parts(path, layers=now[-1], stages=len(now) - 1).parts
    steps = neighbour_steps(now, saved)
    for parts in steps:
        report = engine.repartition(parts)
        if not report.ok:
            raise CheckpointPartitionError(
                f"stage {engine.stage_id}: could not move layers to the partition {saved} the checkpoint "
                f"{path} was saved on (stopped at {engine.module.parts}): {report.reason}")
    return steps
