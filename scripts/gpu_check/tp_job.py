"""Tensor parallelism inside a stage on NCCL, one rank per GPU: 2 stages x 2 tensor-parallel ranks,
PipeMorphEngine against stock DeepSpeed on the same topology.

    python scripts/gpu_check/tp_job.py WORK_DIR KEYS.json            # NCCL, 4 ranks on cuda:0..3
    python scripts/gpu_check/tp_job.py WORK_DIR KEYS.json --double   # the same on CPU: gloo under NCCL's rules

One torchrun launch of the equivalence tests' worker (``tests/runtime/worker.py``) on the NCCL
backend, rank r on cuda:r: the column/row-parallel MLP of ``tests/runtime/tp_models.py`` on
DeepSpeed's ``PipeModelDataParallelTopology(2, 2, 1)`` trained 3 steps by stock DeepSpeed and by
PipeMorphEngine with ``zb`` and ``1f1b`` (direct links, the control loop off), DeepSpeed's
activations whole between stages (``pipe_partitioned``/``grad_partitioned`` false, which the engine
asks for). Checked: losses and every parameter within 1e-5 of stock, every F/B/W run, each rank's
stage ranks those of its tensor-parallel coordinate, and every step ran ``NcclLowering``'s stream of
the plan. ``gpu_check.sh`` runs it with four GPUs or more. ``--double`` runs the same jobs on CPU,
gloo, with ``inject.nccl_rules`` (the test double): ``tests/scripts/test_gpu_check.py`` runs it so,
which is how this driver and its checks ran on a machine without GPUs. Writes KEYS.json; exit 1 on
a failure.
"""
from __future__ import annotations

import sys
from pathlib import Path

from step import launch_worker, start_step, write_keys  # noqa: E402  (this directory is the script's: first on sys.path)

left_s = start_step()  # SIGTERM exits through run_group's cleanup; the budget left, less 10 s for the key file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from ds_pipemorph.plan.ir.nccl_lowering import NcclLowering  # noqa: E402
from ds_pipemorph.runtime.config import parse_config  # noqa: E402
from ds_pipemorph.runtime.plans import build_plan  # noqa: E402
from tests.runtime.launch import Launch, max_param_diff  # noqa: E402
from tests.runtime.test_equivalence import TOL  # noqa: E402

STAGES, TP, N = 2, 2, 4
WHOLE = {"pipeline": {"pipe_partitioned": False, "grad_partitioned": False}}
SECTIONS = {  # job -> the pipemorph section (the control loop off: links stay direct)
    "zb": {"schedule": "zb", "delegation": {"mode": "off"}, "adapt": {"enabled": False}},
    "1f1b": {"schedule": "1f1b", "delegation": {"mode": "off"}, "adapt": {"enabled": False}},
}


def jobs(double: bool) -> list[dict]:
    base = {"stages": STAGES, "tp": TP, "micro_batches": N, "ds": WHOLE}
    out = [{"name": "stock", **base, "pipemorph": None}]
    for name, section in SECTIONS.items():
        if double:
            section = {**section, "inject": {"nccl_rules": True}}
        out.append({"name": name, **base, "pipemorph": section})
    return out


def check(run: Launch, double: bool) -> tuple[dict, list[str]]:
    ranks = STAGES * TP
    keys: dict = {"ranks": ranks, "layout": "2 stages x 2 tensor-parallel ranks",
                  "backend": "gloo under NCCL's rules (double)" if double else "nccl"}
    failures: list[str] = []
    for name, section in SECTIONS.items():
        plan = build_plan(parse_config(section), STAGES, N)
        streams = NcclLowering().lines(plan)
        try:
            ours = [run.result(name, r) for r in range(ranks)]
            ref = [run.result("stock", r) for r in range(ranks)]
        except AssertionError as e:
            failures.append(f"{name}: {str(e).splitlines()[0]}")
            continue
        for r, (x, y) in enumerate(zip(ours, ref)):
            ran = sorted(op for op in x["ops"][-1] if op[:1] in "FBW" and op[1:].isdigit())
            if ran != sorted(f"{k}{m}" for k in "FBW" for m in range(N)):
                failures.append(f"{name} rank {r}: ran {ran}")
            if x["stage_ranks"] != [s * TP + r % TP for s in range(STAGES)]:  # ranks ordered (pipe, model)
                failures.append(f"{name} rank {r}: stage ranks {x['stage_ranks']}")
            if x["executed"] != [streams[x["stage"]].split()] * len(x["executed"]):
                failures.append(f"{name} rank {r}: did not run NcclLowering's stream (NCCL's rules not in force)")
        loss_diff = max(abs(a - b) for x, y in zip(ours, ref) for a, b in zip(x["losses"], y["losses"]))
        param_diff = max(max_param_diff(x, y) for x, y in zip(ours, ref))
        if loss_diff > TOL or param_diff > TOL or any(len(x["losses"]) != len(y["losses"]) for x, y in zip(ours, ref)):
            failures.append(f"{name}: losses differ by {loss_diff:.2e}, parameters by {param_diff:.2e} "
                            f"(tolerance {TOL})")
        keys[name] = {"max_loss_diff": loss_diff, "max_param_diff": param_diff, "tolerance": TOL,
                      "p2p": sorted({x["p2p"] for x in ours})}
    return keys, failures


def main() -> int:
    work, keys_path = Path(sys.argv[1]), Path(sys.argv[2])
    double = "--double" in sys.argv[3:]
    if double:
        backend, accelerator = "gloo", "cpu"
    else:
        import torch

        backend, accelerator = "nccl", "cuda"
        if torch.cuda.device_count() < STAGES * TP:
            print(f"tp_job: needs {STAGES * TP} CUDA devices or more (one rank per GPU)")
            return 1
    code, output = launch_worker(REPO, work, jobs(double), STAGES * TP, backend, accelerator, left_s)
    keys, failures = check(Launch(code if code is not None else -1, output, work), double)
    keys["launch_exit_code"] = code  # judged by the files, as the tests do (DeepSpeed may abort at exit)
    return write_keys(keys_path, failures, keys)


if __name__ == "__main__":
    sys.exit(main())
