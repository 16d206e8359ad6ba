"""Moving layers under DeepSpeed's bf16 and ZeRO optimizers: per-parameter state out of their flat
fp32 partitions, and the optimizer built again around the parameters a stage holds after the move.

``BF16_Optimizer`` and ``DeepSpeedZeroOptimizer`` (ZeRO stage 1, in bf16 or fp16) keep each
optimizer group's fp32 master weights and Adam moments as one flat tensor, partitioned over the
data-parallel replicas, and each parameter's ``_hp_mapping`` says where its slice lies. A layer
that leaves or joins a stage changes that layout, so:

- ``snapshot`` reads, for every parameter of the stage, its full fp32 master and optimizer state
  (DeepSpeed's ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``: an all-reduce over
  the stage's data-parallel group, which every replica of the stage runs in the same order) and
  its group's step count;
- ``rebuild`` (after every rank voted yes) drops the old optimizer's hooks, asks DeepSpeed to
  configure the optimizer again for the stage's parameters now (``_configure_optimizer``: the same
  basic optimizer from the config, its groups with the hyperparameters they had, lr included; the
  same wrapper), gives the new flat partitions their optimizer state (zeros, the old step count)
  and writes every parameter's master and state back through ``safe_set_full_*``. The lr
  scheduler (it holds the basic optimizer), the engine's post-backward hook and the fp16 loss
  scaler follow to the new optimizer.

Exactness: the fp32 masters and moments move as fp32; the bf16/fp16 weights as they were. Adam's
update is element-wise, so the trained numbers are those of the job that never moved (the tests
compare with it). Refused (``moving_refusal``): fp16 without ZeRO (``FP16_Optimizer`` keeps no
per-parameter mapping) and an optimizer given as an object (DeepSpeed cannot build it again).
"""
from __future__ import annotations

import torch

FLAT_GROUPS = ("bf16_groups", "bit16_groups")  # BF16_Optimizer, DeepSpeedZeroOptimizer
FLAT_PARTITIONS = ("fp32_groups_flat_partition", "single_partition_of_fp32_groups")


def is_flat(optimizer) -> bool:
    """Whether ``optimizer`` keeps flat fp32 partitions with per-parameter mappings."""
    return any(hasattr(optimizer, a) for a in FLAT_GROUPS)


def _groups(optimizer) -> list[list[torch.nn.Parameter]]:
    return next(getattr(optimizer, a) for a in FLAT_GROUPS if hasattr(optimizer, a))


def _partitions(optimizer) -> list[torch.Tensor]:
    return next(getattr(optimizer, a) for a in FLAT_PARTITIONS if hasattr(optimizer, a))


def group_of(optimizer) -> dict[torch.nn.Parameter, int]:
    return {p: g for g, params in enumerate(_groups(optimizer)) for p in params}


def state_keys(optimizer) -> list[str]:
    """The optimizer's per-element state (Adam: ``exp_avg``, ``exp_avg_sq``); [] before its first step."""
    basic, flat = optimizer.optimizer, _partitions(optimizer)
    state = basic.state.get(flat[0], {}) if flat else {}
    return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == flat[0].shape)


def snapshot(engine) -> dict[torch.nn.Parameter, dict]:
    """Every trainable parameter's fp32 master and optimizer state, full size on the host, and its
    group. Collective over the stage's data-parallel group."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = engine.optimizer
    keys = state_keys(opt)
    if keys:  # DeepSpeed links the moments' fragments at a step; a checkpoint loaded since unlinks them
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    out = {}
    for p, g in group_of(opt).items():
        entry = {"group": g, "fp32": safe_get_full_fp32_param(p).detach().cpu()}
        for k in keys:
            entry[k] = safe_get_full_optimizer_state(p, k).detach().cpu()
        out[p] = entry
    return out


def steps(optimizer) -> list:
    """Each group's step count as the basic optimizer keeps it (per flat partition), or None."""
    basic = optimizer.optimizer
    return [basic.state.get(flat, {}).get("step") for flat in _partitions(optimizer)]


def rebuild(engine, groups: dict[torch.nn.Parameter, int], states: dict[torch.nn.Parameter, dict],
            step_counts: list) -> None:
    """Configure the engine's optimizer again for the parameters in ``groups`` (parameter -> group)
    and load ``states`` into it (see the module's docstring)."""
    old, basic = engine.optimizer, engine.basic_optimizer
    keys = state_keys(old)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in basic.param_groups]
    order = [p for p in engine.module.parameters() if p in groups]
    param_groups = [{**h, "params": [p for p in order if groups[p] == g]} for g, h in enumerate(hyper)]
    scaler = getattr(old, "loss_scaler", None)
    old.destroy()
    engine._configure_optimizer(None, param_groups)
    new = engine.optimizer
    if scaler is not None and hasattr(new, "loss_scaler"):
        new.loss_scaler = scaler
    if getattr(engine, "_support_torch_style_backward", False):
        new.register_grad_acc_post_hook(engine._backward_post_hook)
    scheduler = getattr(engine, "lr_scheduler", None)  # DeepSpeed's and torch's hold the basic optimizer
    if scheduler is not None and getattr(scheduler, "optimizer", None) is basic:
        scheduler.optimizer = engine.basic_optimizer
    elif scheduler is not None and getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = new
    load(engine, {p: st for p, st in states.items() if p in groups}, keys, step_counts)


def load(engine, states: dict[torch.nn.Parameter, dict], keys: list[str], step_counts: list) -> None:
    """Write each parameter's fp32 master and optimizer state (``keys``) into the engine's freshly
    configured flat optimizer, whose groups get the step counts ``step_counts``."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    opt = engine.optimizer
    if keys:  # the optimizer has stepped: its state exists, with the count it had
        for flat, count in zip(_partitions(opt), step_counts):
            state = opt.optimizer.state[flat]
            for k in keys:
                state[k] = torch.zeros_like(flat)
            if count is not None:
                state["step"] = count
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    for p, st in states.items():
        safe_set_full_fp32_param(p, st["fp32"].to(p.device))
        for k in keys:
            safe_set_full_optimizer_state(p, st[k].to(p.device), k)
