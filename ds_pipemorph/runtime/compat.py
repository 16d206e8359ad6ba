"""Which DeepSpeed training settings the engine runs, which it refuses (and the sentence a user
sees), and what ran where: the one source of README's compatibility table.

    python -m ds_pipemorph.runtime.compat            # print the table (Markdown)

The refusal sentences are the ones the engine raises (``runtime.engine``, ``runtime.recompute``
format them from here); tests/runtime/test_recipe_errors.py checks that a recipe run prints them,
tests/docs/test_compat_table.py that README.md holds this table as rendered. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass


def fp16_refused(device: str) -> str:
    return (f"this device has no fp16 (DeepSpeed's {device} accelerator): use \"bf16\": {{\"enabled\": true}} "
            "instead of the \"fp16\" section, or remove it")


def zero_refused(stage: int) -> str:
    return ("pipeline parallelism runs with ZeRO stage 0 or 1 only (DeepSpeed's rule): set "
            f"zero_optimization.stage to 1 (it is {stage})")


TORCH_AUTOCAST_REFUSED = (
    "pipemorph runs each stage's forward itself, without DeepSpeed's torch_autocast: remove the \"torch_autocast\" "
    "section and train in \"bf16\" or \"fp16\" instead")

FUSED_CHECKPOINTING_REFUSED = (
    "backward \"fused\" runs a micro-batch's B and W as one pass, and activation checkpointing recomputes each "
    "checkpointed chunk in B and splits it there: set pipemorph.backward and pipemorph.compare.backward to "
    "\"split\", or turn activation checkpointing off")

TP_PARTITIONED_REFUSED = (
    "pipemorph sends each activation and gradient whole between stages, not partitioned over the tensor-parallel "
    "ranks: set \"pipeline\": {\"pipe_partitioned\": false, \"grad_partitioned\": false} in the ds_config")

TP_READY_REFUSED = (
    "ready dispatch lets each rank run its next op as its own messages arrive, and the ranks of a tensor-parallel "
    "group must issue their layers' collectives in the same order: set pipemorph.dispatch and "
    "pipemorph.compare.dispatch to \"ordered\"")

TP_MOVING_REFUSED = (
    "moving layers or ranks (pipemorph.rebalance, pipemorph.orchestrate, repartition, remap) moves one rank's state "
    "per stage and replica, not a tensor-parallel group's shards: turn pipemorph.rebalance and "
    "pipemorph.orchestrate off")

EMBEDDING_REFUSED = (
    "activation checkpointing needs every checkpointed chunk's input to need a gradient, and the first stage's "
    "token ids do not (the embedding cannot be checkpointed): name only the transformer blocks in the "
    "PipelineModule's checkpointable_layers")

BUDGET_MB_MOVING_REFUSED = (
    "pipemorph.memory.budget_mb is converted into micro-batches' activations with the bytes each stage measured in "
    "the first iteration, which moving layers or ranks (pipemorph.rebalance, pipemorph.orchestrate, repartition, "
    "remap) changes: grant memory as a factor with pipemorph.memory.budget instead, or turn pipemorph.rebalance "
    "and pipemorph.orchestrate off")

BUDGET_MB_PLAN_FILE_REFUSED = (
    "a plan file runs as written, with the memory its plan holds (`pipemorph plan` prints it): remove "
    "pipemorph.memory.budget_mb, or plan for the memory you grant with the profile's memory.capacity_mb")

MOVING_REFUSED = (
    "moving layers or ranks (pipemorph.rebalance, pipemorph.orchestrate, repartition, remap) under a bf16, fp16 or "
    "ZeRO optimizer needs DeepSpeed's per-parameter mapping into its flat fp32 partitions, which fp16 without ZeRO "
    "and an optimizer given to initialize do not have: set zero_optimization.stage to 1, or name the optimizer in "
    "the ds_config, or turn pipemorph.rebalance and pipemorph.orchestrate off")


@dataclass(frozen=True)
class Feature:
    setting: str  # the ds_config keys, as a user writes them
    status: str  # "trains" or "refused"
    detail: str  # how it trains, or the sentence a user sees
    ran: str  # where it ran: this project's CPU tests, or only compiled for GPUs


FEATURES = (
    Feature('`"bf16": {"enabled": true}`', "trains",
            "DeepSpeed's `BF16_Optimizer`; bit-identical to stock 1F1B under `1f1b`, `zb`, `adaptive` (re-planning "
            "included), plan files, both dispatches, tied layers, two replicas, delegated links, failover; its "
            "checkpoints do not load (DeepSpeed 0.19.8 cannot load its own either): resume with ZeRO-1",
            "CPU, 2–4 ranks"),
    Feature('bf16 + `"zero_optimization": {"stage": 1}`', "trains",
            "`DeepSpeedZeroOptimizer`, fp32 masters partitioned over replicas; bit-identical to stock, delegated links "
            "and a link that fails over included; checkpoints resume across stock and ours", "CPU, 2–4 ranks"),
    Feature('`"fp16": {"enabled": true}` (ZeRO 0 or 1)', "trains",
            "as stock, bit-identical: with ZeRO-1 the dynamically scaled loss drives B and W, an overflow skips the "
            "step everywhere and lowers the scale; without ZeRO, DeepSpeed 0.19.8's engine does not scale the loss "
            "for `FP16_Optimizer`, and neither do we",
            "CPU, with DeepSpeed told fp16 is supported (test only); `gpu_check.sh` on a GPU: written, not run here"),
    Feature("fp16 on a device without fp16", "refused", fp16_refused("cpu"),
            "CPU, DeepSpeed's accelerator told it has no fp16 (test only: on a CPU with AVX512-FP16 it has, and the "
            "config trains)"),
    Feature('`"pipeline": {"activation_checkpoint_interval": k}` with `checkpointable_layers`', "trains",
            "recomputed once, in B; W reuses it; equal to the job without checkpointing; with `adaptive` and ready "
            "dispatch in bf16 bit-identical to stock's checkpointing", "CPU, 2 ranks"),
    Feature("checkpointing a chunk that holds the token embedding", "refused", EMBEDDING_REFUSED, "CPU"),
    Feature('activation checkpointing with `"pipemorph": {"backward": "fused"}` (or `compare.backward`)', "refused",
            FUSED_CHECKPOINTING_REFUSED, "CPU"),
    Feature("`TiedLayerSpec` (embedding and head)", "trains", "tied gradients reduced after the last W", "CPU"),
    Feature('`"zero_optimization": {"stage": 2}` or 3', "refused", zero_refused(2), "CPU"),
    Feature("layer migration (`pipemorph.rebalance`, `repartition`) and re-mapping (`orchestrate`, `remap`) in bf16 "
            "and bf16 + ZeRO-1", "trains",
            "fp32 masters and Adam moments move per parameter; the optimizer is configured again around the stage's "
            "new layers; equal to the job that never moved within a few ulps (the clip norm adds in another order); "
            "checkpoints resume after a migration", "CPU, 4 ranks"),
    Feature("moving layers or ranks with fp16 without ZeRO, or with an optimizer object given to `initialize` "
            "under bf16/ZeRO", "refused", MOVING_REFUSED, "CPU"),
    Feature('`"torch_autocast": {"enabled": true}`', "refused", TORCH_AUTOCAST_REFUSED, "CPU"),
    Feature("`memory.budget_mb` with moving layers or ranks", "refused", BUDGET_MB_MOVING_REFUSED, "CPU"),
    Feature("tensor parallelism inside a stage (`PipeModelDataParallelTopology`, `num_mp > 1`) with "
            '`"pipeline": {"pipe_partitioned": false, "grad_partitioned": false}`', "trains",
            "every rank of a stage runs the stage's plan under ordered dispatch and sends to the same tensor-parallel "
            "rank of the next stage, as stock does; the column-parallel input-gradient all-reduce runs in B, W runs "
            "no collective (layers on `nn.Linear` shards, or one autograd Function as in Megatron-core); re-plans and link routes switch for the whole group at one boundary, planned for the "
            "slowest pair of a boundary; equal to stock (1e-5) under `1f1b`, `zb`, a tied layer, `adaptive` "
            "re-planning for a slowed link and for one slowed pair, `auto` and `always` delegation, NCCL's "
            "point-to-point rules (a gloo double), a checkpoint resumed",
            "CPU, 2 stages x 2 tensor-parallel ranks (4 ranks) and x 2 replicas (8 ranks, `zb`, tied, `adaptive`)"),
    Feature("tensor parallelism with DeepSpeed's partitioned activations (its default)", "refused",
            TP_PARTITIONED_REFUSED, "CPU"),
    Feature('tensor parallelism with `"dispatch": "ready"`', "refused", TP_READY_REFUSED, "CPU"),
    Feature("tensor parallelism with moving layers or ranks", "refused", TP_MOVING_REFUSED, "CPU"),
)


def render() -> str:
    """README's compatibility table, in Markdown."""
    rows = ["| setting | status | how it trains, or the sentence you see | ran where |",
            "| --- | --- | --- | --- |"]
    for f in FEATURES:
        detail = f.detail if f.status == "trains" else f"“{f.detail}”"
        rows.append(f"| {f.setting} | {f.status} | {detail} | {f.ran} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(render(), end="")
