"""A GPT as a DeepSpeed PipelineModule: tied token embedding and output head, learned positions,
pre-LN blocks with causal attention, a final LayerNorm and a next-token cross-entropy loss.

The token embedding is a ``TiedLayerSpec`` used twice, as Megatron-LM and GPT-NeoX tie theirs: as
the first layer (ids -> vectors) and as the head (vectors -> logits through ``forward_fn``, which
multiplies by the same weight). DeepSpeed builds one copy on the first stage and one on the last
and all-reduces the weight's gradient between them every step, so both copies stay equal.

The layers are cut into stages by counting ``Block`` layers (``partition_method="type:Block"``),
so every stage gets its share of blocks; the embeddings go with the first stage, the final norm and
the head with the last. Only ``Block`` layers are checkpointable (``checkpointable_layers``): the
embedding's input is integer ids, and a checkpointed chunk needs an input that carries a gradient
(DeepSpeed's reentrant checkpoint would leave the embedding without one; ds_pipemorph refuses it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

TIED_KEY = "embed"
CHECKPOINTABLE = ["Block"]


class TokenEmbedding(torch.nn.Embedding):
    """Token ids (batch, seq) -> vectors (batch, seq, d_model); its ``weight`` is the tied one."""

    def __init__(self, vocab: int, d_model: int):
        super().__init__(vocab, d_model)
        torch.nn.init.normal_(self.weight, std=0.02)


def tied_head(embedding: TokenEmbedding, x: torch.Tensor) -> torch.Tensor:
    """The output head: logits (batch, seq, vocab) from the embedding's own weight."""
    return F.linear(x, embedding.weight)


class PositionEmbedding(torch.nn.Module):
    """Adds a learned vector per position to the token vectors."""

    def __init__(self, max_seq: int, d_model: int):
        super().__init__()
        self.pos = torch.nn.Parameter(torch.empty(max_seq, d_model))
        torch.nn.init.normal_(self.pos, std=0.02)

    def forward(self, x):
        return x + self.pos[: x.shape[1]].to(x.dtype)


class Block(torch.nn.Module):
    """Pre-LN transformer block: causal multi-head self-attention and a GELU MLP, both residual."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        assert d_model % heads == 0, f"d_model {d_model} is not a multiple of heads {heads}"
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


class FinalNorm(torch.nn.LayerNorm):
    """The LayerNorm after the last block, before the tied head."""


def next_token_loss(logits, labels):
    """Mean cross-entropy of the next byte, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def layer_specs(vocab: int = 256, d_model: int = 128, heads: int = 4, blocks: int = 4, max_seq: int = 64) -> list:
    """The layers in order: tied embedding, positions, ``blocks`` blocks, final norm, tied head."""
    layers = [TiedLayerSpec(TIED_KEY, TokenEmbedding, vocab, d_model, tied_weight_attr="weight"),
              LayerSpec(PositionEmbedding, max_seq, d_model)]
    layers += [LayerSpec(Block, d_model, heads) for _ in range(blocks)]
    layers += [LayerSpec(FinalNorm, d_model),
               TiedLayerSpec(TIED_KEY, TokenEmbedding, vocab, d_model, forward_fn=tied_head,
                             tied_weight_attr="weight")]
    return layers


def gpt(vocab: int = 256, stages: int = 4, d_model: int = 128, heads: int = 4, blocks: int = 4,
        max_seq: int = 64, checkpoint_interval: int = 0, partition_method: str = "type:Block") -> PipelineModule:
    """The GPT as ``stages`` pipeline stages; ``checkpoint_interval`` > 0 recomputes each block's
    activations in the backward (``activation_checkpoint_interval``). Needs torch.distributed
    initialized (DeepSpeed's PipelineModule builds its process groups)."""
    return PipelineModule(layers=layer_specs(vocab, d_model, heads, blocks, max_seq), num_stages=stages,
                          loss_fn=next_token_loss, partition_method=partition_method,
                          activation_checkpoint_interval=checkpoint_interval, checkpointable_layers=CHECKPOINTABLE)
