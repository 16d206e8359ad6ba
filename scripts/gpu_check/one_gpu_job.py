"""Four ranks on one GPU: PipeMorphEngine with every link delegated against stock DeepSpeed.

    python scripts/gpu_check/one_gpu_job.py WORK_DIR KEYS.json

One torchrun launch of the equivalence tests' worker (``tests/runtime/worker.py``), 4 ranks all on
cuda:0, gloo, point-to-point messages staged through host memory (``on_gpu0.py`` says why): 4 stages
x 1 replica and 2 stages x 2 replicas, each trained 3 steps by stock DeepSpeed and by PipeMorphEngine
(``zb``, ``delegation.mode: always``: CUDA staging rings, gloo delegates). The launch gets what is left
of the step's budget (``GPU_CHECK_STEP_S``). Checked as ``tests/runtime/test_equivalence.py`` checks
it (losses and every parameter within 1e-5, every F/B/W run, measured peak in-flight as planned), plus:
the parameters live on the GPU and every F/B/W op of every batch has a CUDA-event device time. Writes
KEYS.json; exit 1 on a failure.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from step import launch, start_step, write_keys  # noqa: E402  (this directory is the script's: first on sys.path)

left_s = start_step()  # SIGTERM exits through run_group's cleanup; the budget left, less 10 s for the key file


REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from ds_pipemorph.procs import torchrun  # noqa: E402

from tests.runtime.launch import Launch, max_param_diff  # noqa: E402
from tests.runtime.test_equivalence import TOL, _assert_equal_to_stock, _expected_peak  # noqa: E402
from tests.runtime.test_precision import _assert_identical  # noqa: E402

RANKS, N = 4, 4
DELEGATED = {"schedule": "zb", "delegation": {"mode": "always"}, "adapt": {"enabled": False}}
LAYOUTS = {"s4": (4, 1), "s2x2": (2, 2)}  # name -> (stages, data-parallel replicas)
# Half precision on 2 stages x 2 replicas, delegated as above: fp16 with ZeRO-1 and a first loss scale
# that overflows (steps skipped, the scale lowered), bf16 with ZeRO-1; bit-identical to stock.
PRECISIONS = {"fp16": {"fp16": {"enabled": True, "initial_scale_power": 30}, "zero_optimization": {"stage": 1}},
              "bf16": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}}


def jobs() -> list[dict]:
    out = []
    for name, (stages, dp) in LAYOUTS.items():
        for kind, section in (("stock", None), ("always", DELEGATED)):
            out.append({"name": f"{kind}_{name}", "stages": stages, "dp": dp, "micro_batches": N,
                        "torch_adam": True, "pipemorph": section})
    for prec, ds in PRECISIONS.items():
        for kind, section in (("stock", None), ("always", DELEGATED)):
            out.append({"name": f"{kind}_{prec}", "stages": 2, "dp": 2, "micro_batches": N, "steps": 4, "ds": ds,
                        "pipemorph": section})
    return out


def check(run: Launch, op_dir: Path) -> tuple[dict, list[str]]:
    keys: dict = {}
    failures: list[str] = []
    for name, (stages, _) in LAYOUTS.items():
        ours, stock = f"always_{name}", f"stock_{name}"
        try:
            _assert_equal_to_stock(run, ours, stock, RANKS, _expected_peak(DELEGATED, stages, N))
        except AssertionError as e:
            failures.append(f"{ours}: {str(e).splitlines()[0]}")
        try:
            a = [run.result(ours, r) for r in range(RANKS)]
            b = [run.result(stock, r) for r in range(RANKS)]
        except AssertionError as e:
            failures.append(str(e).splitlines()[0])
            continue
        devices = sorted({str(t.device) for x in a + b for t in x["params"].values()})
        if devices != ["cuda:0"]:
            failures.append(f"{name}: parameters on {devices}, not cuda:0 only")
        keys[name] = {
            "max_loss_diff": max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p["losses"], q["losses"])),
            "max_param_diff": max(max_param_diff(p, q) for p, q in zip(a, b)),
            "param_devices": devices, "tolerance": TOL,
            "delegated_iteration_s": round(sum(s for x in a for s in x["seconds"]) / sum(len(x["seconds"]) for x in a), 3),
            "stock_iteration_s": round(sum(s for x in b for s in x["seconds"]) / sum(len(x["seconds"]) for x in b), 3)}
    for prec in PRECISIONS:
        try:
            _assert_identical(run, f"always_{prec}", f"stock_{prec}", RANKS)
            keys[prec] = {"bit_identical": True, "skipped_steps": run.result(f"always_{prec}", 0)["skipped_steps"]}
        except AssertionError as e:
            failures.append(f"always_{prec}: {str(e).splitlines()[0]}")
    rows = []
    for r in range(RANKS):
        path = op_dir / f"rank{r}.json"
        if not path.is_file():
            failures.append(f"rank {r} wrote no op times ({path})")
            continue
        rows += json.loads(path.read_text())
    timed = [op for row in rows for op in row["ops"].values()]
    missing = [(row["stage"], sorted(set(row["fbw_ops"]) - set(row["ops"]))) for row in rows
               if set(row["fbw_ops"]) != set(row["ops"])]
    if missing:
        failures.append(f"F/B/W ops without a CUDA-event time (stage, ops): {missing[:4]}")
    if not timed or any(not op["device_ms"] > 0 for op in timed):
        failures.append("no CUDA-event op times, or some not > 0")
    if timed:
        keys["op_times"] = {"ops": len(timed), "device_ms_sum": round(sum(o["device_ms"] for o in timed), 2),
                            "host_ms_sum": round(sum(o["host_ms"] or 0 for o in timed), 2)}
    return keys, failures


def main() -> int:
    work, keys_path = Path(sys.argv[1]), Path(sys.argv[2])
    work.mkdir(parents=True, exist_ok=True)
    (work / "jobs.json").write_text(json.dumps(jobs()))
    env = {**os.environ, "DS_ACCELERATOR": "cuda", "GPU_CHECK_OP_TIMES": str(work / "op_times"),
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [*torchrun(work / "torchrun", "--standalone", f"--nproc_per_node={RANKS}"),
           str(REPO / "scripts" / "gpu_check" / "on_gpu0.py"), str(REPO / "tests" / "runtime" / "worker.py"),
           str(work / "jobs.json"), str(work)]
    code, out, err = launch(cmd, left_s, REPO, env)
    output = out + err
    (work / "launch.log").write_text(output)
    print(output[-4000:])
    keys, failures = check(Launch(code if code is not None else -1, output, work), work / "op_times")
    keys["launch_exit_code"] = code  # judged by the files, as the tests do (DeepSpeed may abort at exit)
    return write_keys(keys_path, failures, keys)


if __name__ == "__main__":
    sys.exit(main())
