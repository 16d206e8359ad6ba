"""What `pipemorph profile-stages` times in launch.sh: the tiny GPT of recipes/tiny_gpt and one
micro-batch of its data. Replace ``build``/``sample`` with your own model's (same signatures)."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

TINY_GPT = Path(__file__).resolve().parents[1] / "tiny_gpt"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"tiny_gpt_{name}", TINY_GPT / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _vocab() -> int:
    return len(set(_load("train").TEXT))  # the character vocabulary train.py builds


def build():
    """The PipelineModule as train.py builds it (``STAGES`` stages, default 4)."""
    return _load("model").tiny_gpt(vocab=_vocab(), stages=int(os.environ.get("STAGES", "4")),
                                   max_seq=int(os.environ.get("SEQ", "32")))


def sample():
    """One micro-batch (inputs, labels): token ids of shape (micro-batch size, SEQ)."""
    micro, seq = int(os.environ.get("MICRO_BATCH", "4")), int(os.environ.get("SEQ", "32"))
    ids = torch.randint(0, _vocab(), (micro, seq + 1), generator=torch.Generator().manual_seed(0))
    return ids[:, :-1], ids[:, 1:]
