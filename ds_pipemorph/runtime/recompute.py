"""Activation checkpointing that recomputes once, in B, and leaves W what B recomputed.

DeepSpeed's ``PipelineModule`` checkpoints every ``activation_checkpoint_interval`` layers (those
``checkpointable_layers`` names) with ``activation_checkpoint_func(fn, *inputs)``. Its default,
``deepspeed.checkpointing.checkpoint``, is reentrant: the chunk's backward is one opaque node that
recomputes the forward and runs a whole backward inside, parameters included, so a split backward
cannot leave the weight gradients for W. Torch's non-reentrant checkpoint exposes the graph but
recomputes whenever a saved tensor is unpacked: once in B and again in W, which re-enters the same
nodes.

``split_checkpoint`` is the engine's ``activation_checkpoint_func``. Its forward runs the chunk
without a graph and keeps only the chunk's inputs (and the random-number state, so dropout draws
the same numbers again). Its backward, run by B, recomputes the chunk with a graph, then splits
that graph as the stage's own (``bw_split.backward_input``): the input gradient goes back into B,
and the chunk's ``WeightGradWork`` is handed to the ``Recompute`` collector the engine opened for
this micro-batch. W runs it with the stage's own work. The recomputed graph lives from B to W, as
an uncheckpointed stage's graph lives from F to W: what checkpointing saves is the activations
between F and B.

A stage whose inputs need no gradient (token ids on the first stage) runs its whole backward in W;
there the chunks recompute in W, once, and their work runs right after (``Recompute.drain``). A
chunk's node that W enters again (one of its inputs comes from parameters, so it is a frontier node
of the stage's graph) returns the gradients B computed for all its inputs: it never recomputes twice.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .bw_split import WeightGradWork, backward_input
from .compat import EMBEDDING_REFUSED
from .config import PipeMorphConfigError


class Recompute:
    """Collects the ``WeightGradWork`` of checkpointed chunks while a B (or a W) of one micro-batch
    runs. One engine at a time per process opens it; autograd may call the chunks' backward from
    its device threads, so this is process-wide, not thread-local."""

    active: Optional["Recompute"] = None

    def __init__(self, params: Sequence[torch.Tensor]):
        self.params = list(params)
        self.works: list[WeightGradWork] = []

    def __enter__(self) -> "Recompute":
        if Recompute.active is not None:
            raise RuntimeError("a checkpointed backward is already being collected in this process")
        Recompute.active = self
        return self

    def __exit__(self, *exc) -> None:
        Recompute.active = None

    def drain(self) -> None:
        """Run the works collected so far (chunks recomputed inside a W) and forget them."""
        while self.works:
            self.works.pop(0).run()


class _Chunk(torch.autograd.Function):
    W_REENTERS = True  # B's gradients are kept (``ctx.done``) for W entering it again (bw_split)

    @staticmethod
    def forward(ctx, fn, rng, *args):
        ctx.fn, ctx.rng, ctx.done = fn, rng, None
        ctx.tensor_at = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_at))
        with torch.no_grad():
            out = fn(*args)
        return out

    @staticmethod
    def backward(ctx, *grads):
        if ctx.done is not None:  # W re-entering this node (a parameter-side input): B's gradients
            return ctx.done
        collector = Recompute.active
        if collector is None:
            raise RuntimeError("a chunk checkpointed by ds_pipemorph was differentiated outside the engine's B or W")
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_at, ctx.saved_tensors):
            d = t.detach()
            args[i] = d.requires_grad_(t.requires_grad)
        with torch.enable_grad(), _rng_restored(ctx.rng):
            out = ctx.fn(*args)
        outs = [out] if torch.is_tensor(out) else list(out)
        dins, work = backward_input(outs, list(grads), [args[i] for i in ctx.tensor_at], collector.params)
        collector.works.append(work)
        result = [None] * len(args)
        for i, g in zip(ctx.tensor_at, dins):
            result[i] = g
        ctx.done = (None, None, *result)  # every input's gradient, parameter-side ones included
        return ctx.done


def split_checkpoint(fn, *args):
    """``PipelineModule.activation_checkpoint_func`` for split backwards (signature of DeepSpeed's
    ``checkpointing.checkpoint``): ``fn(*args)``, recomputed once in B, its weights' gradients in W."""
    if torch.is_grad_enabled() and not any(torch.is_tensor(a) and a.requires_grad for a in args):
        raise PipeMorphConfigError(EMBEDDING_REFUSED)
    return _Chunk.apply(fn, _rng_state(args), *args)


def embedding_refusal(module, first_stage: bool):
    """The sentence refusing a ``PipelineModule`` whose first stage checkpoints a chunk holding an
    ``nn.Embedding`` (its input, token ids, needs no gradient), else None. DeepSpeed decides the chunks
    (``_precompute_checkpointable_values``); only the first stage's first chunk sees the job's input."""
    if not first_stage or module.activation_checkpoint_interval <= 0 or not module.is_checkpointable_results:
        return None
    chunk = module.forward_funcs[:module.activation_checkpoint_interval]
    embeds = any(isinstance(m, torch.nn.Embedding) for f in chunk if isinstance(f, torch.nn.Module) for m in f.modules())
    return EMBEDDING_REFUSED if module.is_checkpointable_results[0] and embeds else None


def _rng_state(args) -> tuple:
    """The random-number state the chunk's forward sees: the host generator's, the accelerator's for
    the device the chunk runs on, and the model-parallel tracker's (Megatron-style dropout), as
    DeepSpeed's own checkpoint keeps them."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

    device = next((a.device for a in args if torch.is_tensor(a) and a.device.type != "cpu"), None)
    on_device = get_accelerator().get_rng_state(device.index) if device is not None else None
    return torch.get_rng_state(), device, on_device, get_cuda_rng_tracker().get_states()


class _rng_restored:
    """Run the recomputation on the random-number state the forward saw; the caller's state after."""

    def __init__(self, rng: tuple):
        self.cpu, self.device, self.on_device, self.tracker = rng

    def __enter__(self):
        from deepspeed.accelerator import get_accelerator
        from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

        acc, tracker = get_accelerator(), get_cuda_rng_tracker()
        index = self.device.index if self.device is not None else None
        self.saved = (torch.get_rng_state(), acc.get_rng_state(index) if self.device is not None else None,
                      tracker.get_states())
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            acc.set_rng_state(self.on_device, index)
        tracker.set_states(self.tracker)

    def __exit__(self, *exc):
        from deepspeed.accelerator import get_accelerator
        from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

        torch.set_rng_state(self.saved[0])
        if self.device is not None:
            get_accelerator().set_rng_state(self.saved[1], self.device.index)
        get_cuda_rng_tracker().set_states(self.saved[2])
