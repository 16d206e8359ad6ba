"""Micro-batches that differ in length, on the GPT recipe's blocks: two workloads for benchmarks and tests.

``multimodal``: every iteration a seeded quarter of the micro-batches, drawn anew (``heavy_set``),
is ``FACTOR`` times longer in sequence on the first half of the blocks, the "encoder", as the image
tokens of a multimodal batch are; the last encoder block pools its output to the common length
``seq`` (the mean of each group of ``FACTOR`` positions, ``PoolBlock``) before the text blocks. A
pooled position j predicts the byte after its group (byte ``(j + 1) x FACTOR`` of the window), so
the loss stays a causal next-byte loss. On 2 stages the encoder is stage 0; on 4, stages 0 and 1.

``varlen``: language only, every micro-batch's length drawn from a long tail (``lengths``: a
seeded Pareto draw per iteration and micro-batch, a multiple of 8 between ``seq`` / 2 and
``MAX_FACTOR x seq``); every block sees that length.

Both models are ``PipelineModule(dynamic_shape=True)`` of untied token embedding, learned
positions, ``blocks`` blocks cut by counting ``Block`` layers, a final LayerNorm and a linear head.
The text is the recipe's corpus (``data.corpus``): window starts come from a generator seeded with
the iteration and micro-batch, so every rank and every run reads the same batches.
"""
from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import torch
from deepspeed.pipe import LayerSpec, PipelineModule


def _recipe_module(name: str):
    """This recipe's ``name``.py by its path (another recipe's module of that name may be imported already)."""
    key = f"recipes_gpt_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).resolve().parent / f"{name}.py")
        sys.modules[key] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[key]


_model, _data = _recipe_module("model"), _recipe_module("data")
VOCAB, corpus = _data.VOCAB, _data.corpus
Block, FinalNorm, PositionEmbedding = _model.Block, _model.FinalNorm, _model.PositionEmbedding
TokenEmbedding, next_token_loss = _model.TokenEmbedding, _model.next_token_loss

MULTIMODAL, VARLEN = "multimodal", "varlen"
WORKLOADS = (MULTIMODAL, VARLEN)
FRACTION, FACTOR = 0.25, 4  # multimodal: the heavy quarter, 4x the sequence on the encoder
ALPHA, MAX_FACTOR = 1.5, 4  # varlen: Pareto tail index, the longest sequence over ``seq``
DESCRIPTION = {MULTIMODAL: f"a seeded quarter of the micro-batches {FACTOR}x longer on the encoder (first half of "
                           f"the blocks), pooled to the common length",
               VARLEN: f"sequence lengths long-tailed (Pareto {ALPHA}, seq/2 .. {MAX_FACTOR}x seq, seeded)"}


class EncoderBlock(Block):
    """A block of the encoder: it sees a heavy micro-batch at its full length."""


class PoolBlock(Block):
    """The encoder's last block, then the mean of each group of positions down to ``seq`` positions."""

    def __init__(self, d_model: int, heads: int, seq: int):
        super().__init__(d_model, heads)
        self.seq = seq

    def forward(self, x):
        x = super().forward(x)
        b, t, d = x.shape
        return x if t == self.seq else x.view(b, self.seq, t // self.seq, d).mean(2)


class Head(torch.nn.Linear):
    """The output head: vectors -> logits over the bytes."""

    def __init__(self, d_model: int, vocab: int):
        super().__init__(d_model, vocab, bias=False)


def layer_specs(workload: str, seq: int, d_model: int = 128, heads: int = 4, blocks: int = 4) -> list:
    longest = seq * (FACTOR if workload == MULTIMODAL else MAX_FACTOR)
    layers = [LayerSpec(TokenEmbedding, VOCAB, d_model), LayerSpec(PositionEmbedding, longest, d_model)]
    if workload == MULTIMODAL:
        enc = blocks // 2
        layers += [LayerSpec(EncoderBlock, d_model, heads) for _ in range(enc - 1)]
        layers += [LayerSpec(PoolBlock, d_model, heads, seq)]
        layers += [LayerSpec(Block, d_model, heads) for _ in range(blocks - enc)]
    elif workload == VARLEN:
        layers += [LayerSpec(Block, d_model, heads) for _ in range(blocks)]
    else:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, not {workload!r}")
    return layers + [LayerSpec(FinalNorm, d_model), LayerSpec(Head, d_model, VOCAB)]


def model(workload: str, stages: int, seq: int, d_model: int = 128, heads: int = 4, blocks: int = 4) -> PipelineModule:
    """The workload's model on ``stages`` stages (``blocks`` a multiple of ``stages``, even for
    multimodal, so that the encoder ends on a stage boundary). Needs torch.distributed initialized."""
    if blocks % stages or (workload == MULTIMODAL and (blocks // 2) % (blocks // stages)):
        raise ValueError(f"{blocks} blocks do not cut into {stages} equal stages with the encoder on whole stages")
    return PipelineModule(layers=layer_specs(workload, seq, d_model, heads, blocks), num_stages=stages,
                          loss_fn=next_token_loss, partition_method="type:Block", dynamic_shape=True)


def heavy_set(iteration: int, microbatches: int, seed: int = 0) -> frozenset[int]:
    """multimodal: the heavy micro-batches of ``iteration``, round(FRACTION x N) of them."""
    rng = random.Random(f"{MULTIMODAL}/{seed}/{iteration}")
    return frozenset(rng.sample(range(microbatches), int(FRACTION * microbatches + 0.5)))


def lengths(iteration: int, microbatches: int, seq: int, seed: int = 0) -> list[int]:
    """varlen: each micro-batch's sequence length in ``iteration`` (multiples of 8 when ``seq`` is)."""
    rng = random.Random(f"{VARLEN}/{seed}/{iteration}")
    step = 8 if seq % 8 == 0 else 1
    out = []
    for _ in range(microbatches):
        t = int(seq / 2 * rng.paretovariate(ALPHA))
        out.append(max(seq // 2, min(MAX_FACTOR * seq, t // step * step)))
    return out


class Batches:
    """The micro-batches of each iteration, (input ids, labels) of ``batch`` windows each."""

    def __init__(self, workload: str, microbatches: int, batch: int, seq: int, seed: int = 0):
        if workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, not {workload!r}")
        self.workload, self.n, self.batch, self.seq, self.seed = workload, microbatches, batch, seq, seed
        self.bytes = corpus("train")

    def shapes(self, iteration: int) -> list[int]:
        """Each micro-batch's input length in ``iteration``."""
        if self.workload == VARLEN:
            return lengths(iteration, self.n, self.seq, self.seed)
        heavy = heavy_set(iteration, self.n, self.seed)
        return [self.seq * FACTOR if m in heavy else self.seq for m in range(self.n)]

    def of(self, iteration: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for m, t in enumerate(self.shapes(iteration)):
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + iteration) * 1009 + m)
            starts = torch.randint(0, len(self.bytes) - t - 1, (self.batch,), generator=g).tolist()
            w = torch.stack([self.bytes[s: s + t + 1].long() for s in starts])
            f = t // self.seq if self.workload == MULTIMODAL else 1  # positions per pooled position
            out.append((w[:, :-1], w[:, f::f]))
        return out
