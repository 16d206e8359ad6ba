"""Runs training jobs on N ranks and writes what they produced; the tests compare the files.

    python tests/runtime/forkrun.py N tests/runtime/worker.py SPEC.json OUT_DIR
    torchrun --standalone --nproc_per_node N tests/runtime/worker.py SPEC.json OUT_DIR

SPEC is a list of jobs: {"name", "stages", "dp", "micro_batches", "steps", "tied", "model" ("mlp",
"gpt": the tiny_gpt recipe's model, "emulated": "layers" emulated layers of "layer_ms", or "multimodal" / "varlen":
recipes/gpt/varlen.py's workloads, whose micro-batches differ in length), "tp"
(tensor-parallel ranks per stage: the column/row-parallel MLP of tp_models.py on DeepSpeed's pipe x
model x data topology), "dynamic" (gpt only: sequence length varies per micro-batch), "eval" (also run eval_batch after training),
"pipemorph": section or null for stock DeepSpeed, "expect_error": true to record a start-up error
instead of training (the launch then exits with code 2), "expect_train_error": true to record a refusal
(ValueError) that ``train_batch`` raises (the launch then exits with code 2), "stall": {"rank", "seconds"} to start one
rank late and record the timeouts this causes}, "migrate": {"k": parts} (after k steps every rank calls
``engine.repartition(parts)``; the reports are recorded), "save": {"k": dir} (after k steps every rank
calls ``engine.save_checkpoint(OUT_DIR/dir)``), "load": {"dir", "step"} (right after start-up every
rank calls ``engine.load_checkpoint(OUT_DIR/dir)`` and trains from that step on), "remap": {"k": ranks[stage][replica]} (after k
steps every rank calls ``engine.remap`` and trains on from there with its new replica's batches),
"param_groups": true (two optimizer groups), "grad_ops": true (record the op each parameter's gradient was
accumulated in, per step: "grad_ops"), "switch_dispatch": d (right after start-up every rank calls
``engine.switch_to(dispatch=d)``; a refusal is recorded as "switch_error"), "switch_plan": {"k": plan file}
(after k steps every rank calls ``engine.switch_to(plan=..., lowering=...)`` with the file's plan and lowering), "config_via_args": true (the config as
--deepspeed_config gives it), "follow_replica": true (each step feeds the batches of the replica the rank serves then: the orchestrator
may re-map it), "micro_batch_size" (rows per micro-batch of the default data, default 2).
Per job and rank it writes OUT_DIR/<name>.rank<r>.pt: losses, the stage's parameters, the
measured peak in-flight activations, the op texts run, the transport's recovery log lines
(failover, delegate restarts), the class of its direct path's point-to-point layer ("p2p"), the global
rank of each stage its direct path sends to ("stage_ranks"), each link's route at the end
("link_modes"), the control loop's model of each direct link ("direct_model"), the link delays each re-plan planned for ("replan_links") and, for "tp" jobs, the op
each backward all-reduce of the layers ran in, per step ("tp_backward_ops"); or <name>.rank<r>.err with the message. The transport (and its
delegate processes) is closed at the end of each job. ``WORKER_DIST_BACKEND`` names the backend (default
gloo; ``scripts/gpu_check/nccl_job.py`` runs it on nccl).
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
import weakref
from concurrent.futures import wait as futures_wait

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ds_pipemorph  # noqa: E402
from ds_pipemorph.runtime.transport.protocol import TransportError  # noqa: E402
from models import batches, build_model, ds_config  # noqa: E402

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "tiny_gpt")))
from model import tiny_gpt  # noqa: E402

GPT_VOCAB, GPT_SEQ = 23, 12
VARLEN_SEQ = 8


def _announce_late(engine, rank: int, kind: str, mb: int, ms: float) -> None:
    """On ``rank``, every iteration's receive of (kind, mb) starts in its inbox thread only once the
    next message of its kind is in (at most ``ms`` later), and the inbox does not wait for it (no
    settling): the next message is announced first, as on a host too busy to run the first one's
    thread, and ready dispatch may take the two out of order."""
    if dist.get_rank() != rank:
        return
    inbox = engine.inbox
    inbox.settle_s = 0.0
    receive = inbox._receive

    def late(fut, k, m, recorder):
        if (str(k), m) == (kind, mb):
            deadline = time.monotonic() + ms / 1000
            while (k, m + 1) not in inbox._futures and time.monotonic() < deadline:  # posted right after
                time.sleep(0.001)
            nxt = inbox._futures.get((k, m + 1))
            if nxt is not None:
                futures_wait([nxt], timeout=max(0.0, deadline - time.monotonic()))
        receive(fut, k, m, recorder)
    inbox._receive = late


def _settle(engine, ms: float) -> None:
    """The inbox waits up to ``ms`` for a message posted before one announced (``runtime.inbox``): on a
    loaded host a receive thread can wake later than the 2 ms the engine allows by default."""
    if engine.inbox is not None:
        engine.inbox.settle_s = ms / 1000


def _varlen():
    """recipes/gpt/varlen.py, loaded by its path (the tiny_gpt recipe's ``model`` is imported as ``model``)."""
    import importlib.util

    if "recipes_gpt_varlen" not in sys.modules:
        path = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "gpt", "varlen.py")
        spec = importlib.util.spec_from_file_location("recipes_gpt_varlen", path)
        sys.modules["recipes_gpt_varlen"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["recipes_gpt_varlen"]


def run_job(job: dict, out_dir: str, rank: int) -> None:
    S, dp, N = job["stages"], job.get("dp", 1), job["micro_batches"]
    steps = job.get("steps", 3)
    if job.get("model") == "gpt":  # the recipe's tiny GPT: int tokens, attention, views, LayerNorm
        torch.manual_seed(1234)
        model = tiny_gpt(vocab=GPT_VOCAB, stages=S, d_model=32, heads=2, blocks=2 * S - 2, max_seq=GPT_SEQ)
        model.dynamic_shape = bool(job.get("dynamic"))  # DeepSpeed's flag: shapes vary between micro-batches
        if job.get("ckpt_layers"):  # the layer classes activation checkpointing may take (GPT-NeoX's way)
            model.checkpointable_layers = job["ckpt_layers"]
    elif job.get("model") in ("multimodal", "varlen"):  # lengths vary per micro-batch and iteration
        torch.manual_seed(1234)
        model = _varlen().model(job["model"], S, seq=VARLEN_SEQ, d_model=16, heads=2, blocks=2 * S)
    elif job.get("model") == "emulated":  # "layers" emulated layers (inject.emulated) of "layer_ms" each
        from deepspeed.pipe import LayerSpec, PipelineModule
        from ds_pipemorph.inject.emulated import EmulatedStage

        torch.manual_seed(1234)
        ms = job["layer_ms"]
        model = PipelineModule([LayerSpec(EmulatedStage, 16, ms, ms, ms) for _ in range(job["layers"])],
                               num_stages=S, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    elif job.get("tp"):  # "tp" tensor-parallel ranks per stage: DeepSpeed's pipe x model x data topology
        from tp_models import build_tp_model

        model = build_tp_model(S, job["tp"], dp, seed=1234, tied=job.get("tied", False))
    else:
        model = build_model(S, seed=1234, tied=job.get("tied", False), dropout=job.get("dropout", 0.0),
                            idle=job.get("idle", False))
    mbs = job.get("micro_batch_size", 2)  # rows of WIDTH floats per micro-batch (the default data)
    cfg = ds_config(N, dp=dp, micro_batch_size=mbs, pipemorph=job.get("pipemorph"))
    if job.get("fake_fp16"):  # DeepSpeed's CPU accelerator has fp16 only on some CPUs; the test tells it that it has
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True
    if job.get("torch_adam"):  # torch.optim.Adam (per-parameter step counts) instead of DeepSpeed's FusedAdam
        cfg["optimizer"]["params"]["torch_adam"] = True
    if "gradient_clipping" in job:  # DeepSpeed's limit on the gradient norm (0: no clipping)
        cfg["gradient_clipping"] = job["gradient_clipping"]
    cfg.update(job.get("ds", {}))  # more DeepSpeed settings, as given
    path = os.path.join(out_dir, f"{job['name']}.rank{rank}")
    if job.get("pipemorph") is None:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    else:
        try:
            params = model.parameters()
            if job.get("param_groups"):  # weights with decay, the rest without: two optimizer groups
                named = list(model.named_parameters())
                params = [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.01},
                          {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0}]
            if job.get("config_via_args"):  # as the deepspeed launcher's --deepspeed_config gives it
                import argparse

                cfg_path = os.path.join(out_dir, f"{job['name']}.rank{rank}.config.json")
                with open(cfg_path, "w") as f:
                    json.dump(cfg, f)
                engine, _, _, _ = ds_pipemorph.initialize(args=argparse.Namespace(deepspeed_config=cfg_path),
                                                          model=model, model_parameters=params)
            else:
                engine, _, _, _ = ds_pipemorph.initialize(model=model, model_parameters=params, config=cfg)
        except ValueError as e:
            if not job.get("expect_error"):
                raise
            with open(path + ".err", "w") as f:
                f.write(str(e))
            return

    def data_of(replica: int) -> list:  # the batches of a data-parallel replica, all steps
        if job.get("model") in ("multimodal", "varlen"):
            varying = _varlen().Batches(job["model"], N, batch=2, seq=VARLEN_SEQ, seed=replica)
            return [mb for step in range(steps) for mb in varying.of(step)]
        if job.get("model") == "gpt":
            g = torch.Generator().manual_seed(99 + replica)
            seqs = [GPT_SEQ - (i % 4) * 2 if job.get("dynamic") else GPT_SEQ for i in range(N * steps)]
            ids = [torch.randint(0, GPT_VOCAB, (2, t + 1), generator=g) for t in seqs]
            return [(w[:, :-1], w[:, 1:]) for w in ids]
        data = batches(N * steps, mbs, seed=99 + replica)
        half = _half_dtype(cfg)  # a bf16/fp16 model takes inputs and labels of its dtype, as in stock
        return data if half is None else [(x.to(half), y.to(half)) for x, y in data]

    if job.get("late_notice") and job.get("settle_ms"):
        raise ValueError("a job announces a message late with no settling, or settles: not both")
    if job.get("late_notice"):  # {"rank", "kind", "mb", "ms"}: that rank's inbox announces one message late
        _announce_late(engine, **job["late_notice"])
    if job.get("settle_ms"):
        _settle(engine, job["settle_ms"])
    switch_error = None
    if job.get("switch_dispatch"):
        try:
            engine.switch_to(dispatch=job["switch_dispatch"])
        except ValueError as e:
            switch_error = str(e)
    start = 0
    if job.get("load"):  # resume from a checkpoint an earlier job of this launch saved
        engine.load_checkpoint(os.path.join(out_dir, job["load"]["dir"]))
        start = job["load"]["step"]
    data = data_of(engine.grid.data_parallel_id)
    it = iter(data[start * N:])
    losses, peaks, ops, reduce_ms, seconds = [], [], [], [], []
    saved_peaks = []  # per step from the second: the most bytes autograd held saved for backward at once
    executed = []  # per step: the lowered stream the engine ran (``executed_stream``)
    stall = job.get("stall", {})  # {"rank": r, "seconds": t}: that rank starts late
    if stall.get("rank") == rank:
        time.sleep(stall["seconds"])
    migrations, remaps = [], []
    tp_backward_ops = []  # per step (tensor-parallel model): the op each backward all-reduce ran in
    grad_ops, accumulated = [], []  # per step ("grad_ops"): the op each parameter's gradient was added in
    if job.get("grad_ops"):
        for p in engine.module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _p: accumulated.append(time.monotonic_ns()))
    for step in range(start, steps):
        if job.get("follow_replica"):  # the engine may re-map itself: feed the batches of its replica now
            it = iter(data_of(engine.grid.data_parallel_id)[step * N:(step + 1) * N])
        if str(step) in job.get("remap", {}):  # ranks[stage][replica]: every rank takes its new coordinate
            from ds_pipemorph.runtime.topology_file import PlacedTopology

            try:
                engine, rep = engine.remap(PlacedTopology(job["remap"][str(step)]))
            except ValueError as e:  # refused before anything moved (the same on every rank)
                remaps.append({"step": step, "error": str(e)})
            else:
                remaps.append({"step": step, "ok": rep.ok, "old": rep.old, "new": rep.new, "sent": rep.bytes_sent,
                               "received": rep.bytes_received, "reason": rep.reason})
                it = iter(data_of(engine.grid.data_parallel_id)[step * N:])
        if str(step) in job.get("migrate", {}):
            try:
                r = engine.repartition(job["migrate"][str(step)])
            except ValueError as e:  # refused before anything moved (the same on every rank)
                migrations.append({"step": step, "error": str(e)})
            else:
                migrations.append({"step": step, "ok": r.ok, "after": r.after, "moved": sorted(r.moved),
                                   "sent": r.bytes_sent, "received": r.bytes_received, "reason": r.reason})
        if str(step) in job.get("switch_plan", {}):  # a plan change at an iteration boundary, as a re-plan's
            from ds_pipemorph.fileio import load_model
            from ds_pipemorph.plan.files.planfile import PlanFile

            pf = load_model(job["switch_plan"][str(step)], PlanFile)
            engine.switch_to(plan=pf.ops(), lowering=pf.lowering)
        if str(step) in job.get("save", {}):
            engine.save_checkpoint(os.path.join(out_dir, job["save"][str(step)]))
        try:
            t0 = time.perf_counter()
            if job.get("meter") and step > 0:  # the engine measures its own first iteration with hooks of its own
                with SavedPeak(engine.module.parameters()) as meter:
                    losses.append(float(engine.train_batch(it)))
                saved_peaks.append(meter.peak)
            else:
                losses.append(float(engine.train_batch(it)))
            seconds.append(time.perf_counter() - t0)
        except TransportError as e:
            if not stall:
                raise
            with open(path + ".err", "w") as f:
                f.write(str(e))
            time.sleep(stall["seconds"] + 2 * job["pipemorph"]["timeout_s"])  # let the late rank time out too
            return
        except ValueError as e:
            if not job.get("expect_train_error"):
                raise
            with open(path + ".err", "w") as f:
                f.write(str(e))
            engine.destroy()
            return
        if job.get("tp"):  # the op each backward all-reduce of the tensor-parallel layers ran in
            tp_backward_ops.append(_ops_at(getattr(engine, "op_records", [])))
        if job.get("grad_ops"):
            records = [r for r in getattr(engine, "op_records", []) if r.op[:1] in "FBW" and r.op[1:].isdigit()]
            grad_ops.append([next((r.op for r in records if r.start_ns <= t <= r.end_ns), None) for t in accumulated])
            accumulated.clear()
        peaks.append(getattr(engine, "measured_peak_inflight", None))
        ops.append([r.op for r in getattr(engine, "op_records", [])])
        executed.append(list(getattr(engine, "executed_stream", [])))
        reduce_ms.extend((r.end_ns - r.start_ns) / 1e6 for r in getattr(engine, "op_records", []) if r.op == "ReduceGrads")
    comparison = None
    if getattr(engine, "compare", None) is not None:  # pipemorph.compare: its sides and its result
        result = engine.comparison()
        comparison = {"sides": list(engine.compare.sides), "result": None if result is None else result.as_dict()}
    eval_loss = float(engine.eval_batch(iter(data[:N]))) if job.get("eval") else None
    params = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    master = _master_weights(engine.optimizer)
    master_by_name = _master_by_name(engine)
    transport = getattr(engine, "transport", None)
    events = [] if transport is None else list(transport.events) + list(transport.delegated.events)
    if getattr(engine, "inbox", None) is not None:
        engine.inbox.close()
    if transport is not None:
        transport.close()  # this job's delegate processes exit before the next job starts
    torch.save({"losses": losses, "params": params, "master": master, "master_by_name": master_by_name,
                "loss_scale": getattr(engine.optimizer, "loss_scale", None), "skipped_steps": engine.skipped_steps, "peak": peaks, "ops": ops, "executed": executed,
                "stage": engine.stage_id, "switch_error": switch_error, "comparison": comparison,
                "p2p": type(getattr(_innermost(getattr(transport, "direct", None)), "p2p", None)).__name__,
                "p2p_groups": getattr(getattr(_innermost(getattr(transport, "direct", None)), "p2p", None), "groups", None),
                "eval_loss": eval_loss, "events": events, "tp_backward_ops": tp_backward_ops, "grad_ops": grad_ops,
                "link_modes": None if transport is None else [str(transport.link_mode(link)) for link in range(S - 1)],
                "direct_model": None if getattr(engine, "adapter", None) is None else
                [str(m) for m in engine.adapter.policy.direct_models],
                "stage_ranks": [int(r) for r in getattr(_innermost(getattr(transport, "direct", None)), "stage_ranks", [])],
                "choosing_ns": list(getattr(engine, "choosing_ns", [])),
                "reduce_ms": reduce_ms, "early_loss": getattr(engine, "early_loss", None) is not None,
                "reduce_skippable": getattr(engine, "_reduce_can_be_identity", None),
                "reductions_skipped": getattr(engine, "reductions_skipped", None), "seconds": seconds, "migrations": migrations,
                "rebalance": list(getattr(getattr(engine, "rebalance", None), "events", [])),
                "remaps": remaps + [{"ok": r.ok, "old": r.old, "new": r.new} for r in getattr(engine, "remaps", [])],
                "parts": [int(p) for p in getattr(engine.module, "parts", [])], "saved_peaks": saved_peaks,
                "activation_bytes": [a.as_dict() for a in getattr(engine, "activation_bytes", None) or []],
                "budget": None if getattr(engine, "budget", None) is None else vars(engine.budget).copy(),
                "replans": [r.iteration for r in getattr(getattr(engine, "adapter", None), "replans", [])],
                "replan_links": [(r.costs or {}).get("links") for r in getattr(getattr(engine, "adapter", None), "replans", [])],
                "moved_to": [list(r.after) for r in getattr(getattr(engine, "migrator", None), "reports", []) if r.ok]},
               path + ".pt")


def _ops_at(records) -> list:
    """The op (its record's text, or None outside every record) in which each backward all-reduce of
    tp_models' layers began during the last train_batch; the list is emptied."""
    from tp_models import BACKWARD_ALLREDUCES

    out = [next((r.op for r in records if r.start_ns <= t <= r.end_ns), None) for t in BACKWARD_ALLREDUCES]
    BACKWARD_ALLREDUCES.clear()
    return out


class _Box:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


class SavedPeak:
    """The test's own count of what autograd holds saved for backward: each storage once, from its
    first save until the last graph node holding it lets go; parameters left out."""

    def __init__(self, params):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.holders, self.live, self.peak = {}, 0, 0

    def __enter__(self):
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda box: box.t)
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.skip:
            return _Box(t.detach())
        if ptr not in self.holders:
            self.holders[ptr] = 0
            self.live += t.untyped_storage().nbytes()
            self.peak = max(self.peak, self.live)
        self.holders[ptr] += 1
        box = _Box(t.detach())  # with its grad_fn, a saved output would keep its own node alive
        weakref.finalize(box, self.unpin, ptr, t.untyped_storage().nbytes())
        return box

    def unpin(self, ptr, nbytes):
        self.holders[ptr] -= 1
        if not self.holders[ptr]:
            del self.holders[ptr]
            self.live -= nbytes


def _half_dtype(cfg: dict):
    if cfg.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if cfg.get("fp16", {}).get("enabled"):
        return torch.float16
    return None


def _master_weights(optimizer) -> list:
    """The fp32 master weights of DeepSpeed's bf16/fp16/ZeRO optimizers (flat, per group); [] otherwise."""
    for attr in ("single_partition_of_fp32_groups", "fp32_groups_flat_partition", "fp32_groups_flat"):
        flat = getattr(optimizer, attr, None)
        if flat:
            return [t.detach().clone().float() for t in flat]
    return []


def _master_by_name(engine) -> dict:
    """Each parameter's full fp32 master (and Adam's moments, ``name:exp_avg``) by name under
    DeepSpeed's bf16/ZeRO optimizers (a collective over the stage's replicas, in the same order on
    each), {} otherwise."""
    from deepspeed.utils import safe_get_full_fp32_param

    if not any(hasattr(engine.optimizer, a) for a in ("bf16_groups", "bit16_groups")):
        return {}
    from deepspeed.utils import safe_get_full_optimizer_state

    out = {}
    stepped = bool(engine.optimizer.optimizer.state)
    if stepped:  # a checkpoint loaded since the last step leaves the moments' fragments unlinked
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    for n, p in engine.module.named_parameters():
        if p.requires_grad:
            out[n] = safe_get_full_fp32_param(p).detach().clone()
            for key in ("exp_avg", "exp_avg_sq") if stepped else ():  # Adam's moments, by name too
                out[f"{n}:{key}"] = safe_get_full_optimizer_state(p, key).detach().clone()
    return out


def _innermost(transport):
    """The direct path under the plug-ins' wrappers (each keeps what it wraps in ``inner``)."""
    while hasattr(transport, "inner"):
        transport = transport.inner
    return transport


def main() -> int:
    spec_path, out_dir = sys.argv[1], sys.argv[2]
    jobs = json.load(open(spec_path))
    deepspeed.init_distributed(dist_backend=os.environ.get("WORKER_DIST_BACKEND", "gloo"))  # nccl: gpu_check
    rank = dist.get_rank()
    code = 0
    try:
        for job in jobs:
            run_job(job, out_dir, rank)
            if job.get("expect_error") or job.get("expect_train_error"):
                code = 2
    except Exception:
        traceback.print_exc()
        code = 1
    finally:
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
