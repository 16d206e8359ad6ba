"""A tiny GPT (embedding, pre-LN transformer blocks, head) as a 4-stage DeepSpeed PipelineModule."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule


class Embedding(torch.nn.Module):
    """Token ids (batch, seq) -> token + position embeddings (batch, seq, d_model)."""

    def __init__(self, vocab: int, d_model: int, max_seq: int):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Parameter(torch.zeros(max_seq, d_model))
        torch.nn.init.normal_(self.pos, std=0.02)

    def forward(self, ids):
        return self.tok(ids) + self.pos[: ids.shape[1]]


class Block(torch.nn.Module):
    """Pre-LN block: causal multi-head self-attention and a GELU MLP, both residual."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d_model)
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.proj = torch.nn.Linear(d_model, d_model)
        self.ln2 = torch.nn.LayerNorm(d_model)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d_model, 4 * d_model), torch.nn.GELU(),
                                       torch.nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class Head(torch.nn.Module):
    def __init__(self, vocab: int, d_model: int):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d_model)
        self.out = torch.nn.Linear(d_model, vocab)

    def forward(self, x):
        return self.out(self.ln(x))


def next_token_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def tiny_gpt(vocab: int, stages: int = 4, d_model: int = 64, heads: int = 4, blocks: int = 6,
             max_seq: int = 64) -> PipelineModule:
    layers = [LayerSpec(Embedding, vocab, d_model, max_seq)]
    layers += [LayerSpec(Block, d_model, heads) for _ in range(blocks)]
    layers += [LayerSpec(Head, vocab, d_model)]
    return PipelineModule(layers=layers, num_stages=stages, loss_fn=next_token_loss, partition_method="uniform")
