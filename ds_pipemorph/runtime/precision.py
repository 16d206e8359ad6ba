"""What DeepSpeed's optimizer sees of a split backward: the calls stock makes around its fused one.

Stock DeepSpeed runs one backward per micro-batch (``PipelineEngine._exec_backward_pass``):

- on the last stage, ``DeepSpeedEngine.backward(loss)``: the loss divided by the accumulation steps
  and, under a ZeRO optimizer (``BF16_Optimizer`` and ``DeepSpeedZeroOptimizer`` are ZeRO
  optimizers), multiplied by its loss scale (``scale_if_loss``: fp16's dynamic scale, 1 in bf16);
  ``_backward_prologue`` (the optimizer's ``backward_prologue``, which clears the bf16 gradients,
  ``enter_backward``, the accumulation boundary); ``loss.backward()``; ``_backward_epilogue`` (the
  bf16 gradients added into the fp32 master gradients, ``exit_backward``);
- on the other stages, ``out.backward(grad)`` between ``BF16_Optimizer.clear_lp_grads()`` and
  ``update_hp_grads(clear_lp_grads=False)`` (the latter not with ``immediate_grad_update``).

During that backward, autograd's ``AccumulateGrad`` of every parameter runs once and fires the hooks
DeepSpeed registered with ``register_post_accumulate_grad_hook``: ``BF16_Optimizer``'s immediate
update (``immediate_grad_update``: the bf16 gradient added into the fp32 one, then dropped) and
ZeRO's gradient handling hooks (``process_gradients``, which count the parameters of the running
graph task with ``count_used_parameters_in_backward``).

Here B differentiates only to the stage inputs (``torch.autograd.grad``): no parameter gradient,
no hook. W accumulates through autograd's own ``AccumulateGrad`` inside ``torch.autograd.backward``
(``bw_split``), so the same hooks fire once per micro-batch, in W, inside a graph task. ``around_w``
makes stock's calls around each W, in the same micro-batch order as W runs; ``scale_loss`` is the
last stage's loss scaling. Everything at the end of the iteration (``ReduceGrads``,
``ReduceTiedGrads``, the optimizer step with its overflow check and loss-scale update) is stock's.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

try:  # DeepSpeed >= 0.16
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
except ImportError:  # pragma: no cover - older DeepSpeed is refused at start-up
    ZeROOptimizer = ()


class GradPath:
    """Stock's calls around one micro-batch's backward, for this engine's optimizer and stage."""

    def __init__(self, engine):
        self.engine = engine
        self.last_stage = engine.is_last_stage()
        self.zero = isinstance(engine.optimizer, ZeROOptimizer) if ZeROOptimizer else False
        self.bf16_optimizer = bool(getattr(engine, "using_bf16_optimizer", False))
        self.immediate = bool(engine._config.bfloat16_config.immediate_grad_update) if self.bf16_optimizer else False
        self.gradscaler = getattr(engine, "torch_autocast_z0_gradscaler", None)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The last stage's loss as stock's ``backward`` differentiates it (``loss`` is already
        divided by the accumulation steps): times the optimizer's loss scale."""
        if self.zero:
            return self.engine.optimizer.scale_if_loss(loss)
        if self.gradscaler is not None:
            return self.gradscaler.scale(loss)
        return loss

    @contextmanager
    def around_w(self):
        """Run one micro-batch's W inside this: stock's calls before and after its backward."""
        engine = self.engine
        object.__setattr__(engine, "_running_engine_backward", True)  # DeepSpeed's hooks check it
        try:
            if self.last_stage:
                engine._backward_prologue()
                yield
                engine._backward_epilogue()
            else:
                if self.bf16_optimizer:
                    engine.optimizer.clear_lp_grads()
                yield
                if self.bf16_optimizer and not self.immediate:
                    engine.optimizer.update_hp_grads(clear_lp_grads=False)
        finally:
            object.__setattr__(engine, "_running_engine_backward", False)
