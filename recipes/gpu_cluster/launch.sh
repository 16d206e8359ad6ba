#!/usr/bin/env bash
# Profile, plan and train a 4-stage pipeline with ds_pipemorph on a GPU cluster (DeepSpeed launcher).
#
#   cp recipes/gpu_cluster/hostfile.example hostfile && $EDITOR hostfile
#   bash recipes/gpu_cluster/launch.sh                  # all four steps
#   STEPS=plan bash recipes/gpu_cluster/launch.sh       # only some: any of "stages links plan train"
#   LOCAL_CPU=1 bash recipes/gpu_cluster/launch.sh      # dry run on this machine: STAGES x TP CPU ranks, gloo
#   SCHEDULE=plan bash recipes/gpu_cluster/launch.sh    # train the offline plan instead of re-planning
#   TP=2 bash recipes/gpu_cluster/launch.sh             # 3D: 4 stages x 2 tensor-parallel ranks x the rest data-parallel
#   bash recipes/gpu_cluster/launch.sh --seq 64         # arguments go to recipes/tiny_gpt/train.py
#
# Run from the repository root. Outputs go to $OUT (default out/gpu_cluster).
set -euo pipefail

HOSTFILE=${HOSTFILE:-hostfile}
STAGES=${STAGES:-4}
TP=${TP:-1}                      # tensor-parallel ranks per stage (1: the dense model)
if ! [[ $TP =~ ^[1-9][0-9]*$ ]]; then
  echo "error: TP must be a positive integer (tensor-parallel ranks per stage), not '$TP'" >&2; exit 2
fi
MASTER_PORT=${MASTER_PORT:-29500}  # the launcher's rendezvous port on the first node
OUT=${OUT:-out/gpu_cluster}
TRAIN_STEPS=${TRAIN_STEPS:-100}
STEPS=${STEPS:-"stages links plan train"}
SCHEDULE=${SCHEDULE:-adaptive}   # train with the control loop; "plan": the offline plan.yaml, unchanged
case $SCHEDULE in
  adaptive|plan) ;;
  *) echo "error: SCHEDULE must be 'adaptive' or 'plan', not '$SCHEDULE'" >&2; exit 2 ;;
esac
CONFIG=${CONFIG:-recipes/gpu_cluster/ds_config.json}  # the template the train step completes
HERE=recipes/gpu_cluster
mkdir -p "$OUT"

# Micro-batches per iteration = gradient_accumulation_steps of the ds_config (the plan must match it).
MICROBATCHES=$(python -c "import json; print(json.load(open('$CONFIG'))['gradient_accumulation_steps'])")

# --- NCCL / gloo settings commonly needed on multi-node clusters (see README.md for each) -------------
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}                       # INFO prints rings/transports when debugging
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}  # NIC for bootstrap + socket transport
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-eth0}        # NIC for gloo (delegated links, object collectives)
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}                # use InfiniBand/RoCE when present
# export NCCL_IB_HCA=mlx5_0,mlx5_1                          # which HCAs to use (default: all)
# export NCCL_IB_GID_INDEX=3                                # RoCE v2 GID on many Ethernet fabrics
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # fail instead of hanging
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}                # one CPU thread per rank for torch ops

if [[ -n "${LOCAL_CPU:-}" ]]; then
    export DS_ACCELERATOR=cpu
    LAUNCH=(deepspeed --num_gpus $((STAGES * TP)) --master_port "$MASTER_PORT")  # one node: this machine
    LAUNCH_ONE_PER_STAGE=(deepspeed --num_gpus "$STAGES" --master_port "$MASTER_PORT")
else
    # The launcher forwards NCCL_* (and PYTHON*, UCX*, ...) to the other nodes by itself; every other
    # variable must be listed in .deepspeed_env in the working directory.
    printf '%s\n' "GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME" \
        "TORCH_NCCL_ASYNC_ERROR_HANDLING=$TORCH_NCCL_ASYNC_ERROR_HANDLING" \
        "OMP_NUM_THREADS=$OMP_NUM_THREADS" > .deepspeed_env
    LAUNCH=(deepspeed --hostfile "$HOSTFILE" --master_port "$MASTER_PORT")
    # profile-links: rank r is stage r. DeepSpeed's pipe-major topology puts stage s of an S x T x D job
    # on ranks s*D*T .. (s+1)*D*T-1; with D*T = GPUs per node (hostfile slots) stage s is node s, so one
    # process per node (its first GPU: tensor-parallel rank 0 of replica 0) measures the pipeline's links.
    LAUNCH_ONE_PER_STAGE=(deepspeed --hostfile "$HOSTFILE" --num_nodes "$STAGES" --num_gpus 1 \
        --master_port "$MASTER_PORT")
fi

for step in $STEPS; do
  case $step in
  stages)  # 1. F/B/W per stage of the model, on one GPU of this node -> compute_ms
    # With TP > 1 this times the dense stage on one GPU: more compute than a tensor-parallel rank's share,
    # without its all-reduces. "adaptive" training re-measures every stage (its slowest rank) and re-plans.
    STAGES=$STAGES pipemorph profile-stages --model $HERE/stage_model.py:build --sample $HERE/stage_model.py:sample \
        --microbatches "$MICROBATCHES" --threads "$OMP_NUM_THREADS" -o "$OUT/profile.yaml" ;;
  links)   # 2. latency + bandwidth of every link, under the launcher -> links_ms merged into the profile
    # --no_local_rank: the launcher would pass --local_rank before the subcommand; LOCAL_RANK is in the env.
    "${LAUNCH_ONE_PER_STAGE[@]}" --no_local_rank --module ds_pipemorph_cli.app profile-links \
        --merge "$OUT/profile.yaml" --report "$OUT/links_report.json" ;;
  plan)    # 3. the schedule that absorbs the measured delays -> plan.yaml (+ a Gantt picture)
    pipemorph plan "$OUT/profile.yaml" -o "$OUT/plan.yaml" --gantt "$OUT/plan.png" ;;
  train)   # 4. train: "adaptive" re-plans online from its own measurements; SCHEDULE=plan runs plan.yaml as is
    python - "$CONFIG" "$OUT" "$SCHEDULE" <<'PY'
import json, os, sys
config, out, schedule = sys.argv[1:]
out = os.path.abspath(out)  # relative paths in the config would be read against its own directory
cfg = json.load(open(config))
pm = cfg["pipemorph"]
if schedule == "plan":  # the offline plan, never re-planned: no detector, so every link stays direct
    pm.update(schedule="plan", plan_file=f"{out}/plan.yaml", profile_out=None)
    pm.pop("adapt")
    pm["delegation"]["mode"] = "off"
else:  # adaptive
    pm["profile_out"] = f"{out}/measured_profile.yaml"  # feed it back to `pipemorph plan`
json.dump(cfg, open(f"{out}/ds_config.json", "w"), indent=2)
PY
    "${LAUNCH[@]}" recipes/tiny_gpt/train.py --stages "$STAGES" --tensor-parallel "$TP" --steps "$TRAIN_STEPS" \
        --config "$OUT/ds_config.json" "$@" ;;
  *) echo "error: unknown step '$step' (choose from: stages links plan train)" >&2; exit 2 ;;
  esac
done
