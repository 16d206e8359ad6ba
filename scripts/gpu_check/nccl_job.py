"""Direct links on NCCL, one rank per GPU: PipeMorphEngine with the GPU recipe's ``delegation.mode``
(``auto``) and with ``off``, against stock DeepSpeed.

    python scripts/gpu_check/nccl_job.py WORK_DIR KEYS.json            # NCCL, min(4, GPUs) ranks (2 or more)
    python scripts/gpu_check/nccl_job.py WORK_DIR KEYS.json --double   # the same on CPU: gloo under NCCL's rules

One torchrun launch of the equivalence tests' worker (``tests/runtime/worker.py``) with the NCCL
backend, rank r on cuda:r: a pipeline of one stage per rank trained 3 steps by stock DeepSpeed, by
PipeMorphEngine with ``zb`` and ``delegation.mode: auto`` (the control loop off, so every link stays
direct) and with ``1f1b`` and ``delegation.mode: off``. Checked as ``tests/runtime/test_nccl_double.py``
checks the double: losses and every parameter within 1e-5 of stock, every F/B/W run in the plan's
order, and every step ran ``NcclLowering``'s stream of the plan (the engine found NCCL's rules in
force). NCCL refuses two ranks of one communicator on one GPU, so ``gpu_check.sh`` runs this step only
with two GPUs or more. ``--double`` runs the same jobs on CPU, gloo, with ``inject.nccl_rules`` (the
test double): ``tests/scripts/test_gpu_check.py`` runs it so, which is how this driver and its checks
ran on a machine without GPUs. The launch gets what is left of the step's budget (``GPU_CHECK_STEP_S``).
Writes KEYS.json; exit 1 on a failure.
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
from tests.runtime.test_equivalence import TOL, _assert_equal_to_stock  # noqa: E402

N = 4
SECTIONS = {  # job -> the pipemorph section (the control loop off: links stay direct)
    "auto": {"schedule": "zb", "delegation": {"mode": "auto"}, "adapt": {"enabled": False}},
    "off": {"schedule": "1f1b", "delegation": {"mode": "off"}, "adapt": {"enabled": False}},
}


def jobs(stages: int, double: bool) -> list[dict]:
    out = [{"name": "stock", "stages": stages, "micro_batches": N, "torch_adam": True, "pipemorph": None}]
    for name, section in SECTIONS.items():
        if double:
            section = {**section, "inject": {"nccl_rules": True}}
        out.append({"name": name, "stages": stages, "micro_batches": N, "torch_adam": True, "pipemorph": section})
    return out


def check(run: Launch, stages: int, double: bool) -> tuple[dict, list[str]]:
    keys: dict = {"ranks": stages, "backend": "gloo under NCCL's rules (double)" if double else "nccl"}
    failures: list[str] = []
    for name, section in SECTIONS.items():
        plan = build_plan(parse_config(section), stages, N)
        try:
            _assert_equal_to_stock(run, name, "stock", stages, plan=plan)
            ours = [run.result(name, r) for r in range(stages)]
            ref = [run.result("stock", r) for r in range(stages)]
        except AssertionError as e:
            failures.append(f"{name}: {str(e).splitlines()[0]}")
            continue
        streams = NcclLowering().lines(plan)
        wrong = [r for r, x in enumerate(ours) if x["executed"] != [streams[x["stage"]].split()] * len(x["executed"])]
        if wrong:
            failures.append(f"{name}: ranks {wrong} did not run NcclLowering's streams (NCCL's rules not in force)")
        keys[name] = {
            "max_loss_diff": max(abs(x - y) for p, q in zip(ours, ref) for x, y in zip(p["losses"], q["losses"])),
            "max_param_diff": max(max_param_diff(p, q) for p, q in zip(ours, ref)), "tolerance": TOL,
            "p2p": sorted({x["p2p"] for x in ours}),
            "iteration_s": round(sum(s for x in ours for s in x["seconds"]) / sum(len(x["seconds"]) for x in ours), 3),
            "stock_iteration_s": round(sum(s for x in ref for s in x["seconds"]) / sum(len(x["seconds"]) for x in ref), 3)}
    return keys, failures


def main() -> int:
    work, keys_path = Path(sys.argv[1]), Path(sys.argv[2])
    double = "--double" in sys.argv[3:]
    if double:
        stages, backend, accelerator = 2, "gloo", "cpu"
    else:
        import torch

        stages, backend, accelerator = min(4, torch.cuda.device_count()), "nccl", "cuda"
        if stages < 2:
            print("nccl_job: needs 2 CUDA devices or more (NCCL refuses two ranks of one communicator on one GPU)")
            return 1
    code, output = launch_worker(REPO, work, jobs(stages, double), stages, backend, accelerator, left_s)
    keys, failures = check(Launch(code if code is not None else -1, output, work), stages, double)
    keys["launch_exit_code"] = code  # judged by the files, as the tests do (DeepSpeed may abort at exit)
    return write_keys(keys_path, failures, keys)


if __name__ == "__main__":
    sys.exit(main())
