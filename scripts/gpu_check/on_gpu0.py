"""Runs a torchrun worker script with every rank on cuda:0: several ranks share the one GPU.

    torchrun --standalone --nproc_per_node 4 scripts/gpu_check/on_gpu0.py SCRIPT [ARGS...]

DeepSpeed puts each rank on ``cuda:<LOCAL_RANK>``; here ``DeepSpeedEngine`` gets device rank 0 instead
(the ``device_rank`` its argument namespace may carry). The tests' ``models.ds_config`` asks for
torch's Adam (``torch_adam``), so that no FusedAdam is JIT-built, for stock DeepSpeed and the engine
alike. With ``GPU_CHECK_OP_TIMES=DIR``, after every ``PipeMorphEngine.train_batch`` each rank appends
the host (wall) ms and the CUDA-event device ms of its F/B/W ops to ``DIR/rank<r>.json``.
Then SCRIPT runs as ``__main__``.
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import sys

os.environ.setdefault("DS_ACCELERATOR", "cuda")
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "runtime"))

import torch  # noqa: E402
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402

import models  # noqa: E402  (tests/runtime/models.py, as the workers import it)

_set_distributed_vars = DeepSpeedEngine._set_distributed_vars


def _on_gpu0(self, args):
    ns = argparse.Namespace(**vars(args)) if args is not None else argparse.Namespace()
    ns.device_rank = 0
    _set_distributed_vars(self, ns)


_ds_config = models.ds_config


def _torch_adam(*a, **kw):
    cfg = _ds_config(*a, **kw)
    cfg["optimizer"]["params"]["torch_adam"] = True
    return cfg


def _record_op_times(out_dir: str) -> None:
    import torch.distributed as dist

    from ds_pipemorph.runtime.engine import PipeMorphEngine

    train_batch = PipeMorphEngine.train_batch
    rows: list[dict] = []

    def timed(self, *args, **kwargs):
        loss = train_batch(self, *args, **kwargs)
        device = self.recorder.device_ms() or {}
        wall = {r.op: (r.end_ns - r.start_ns) / 1e6 for r in self.recorder.records}
        rows.append({"stage": self.stage_id, "device": str(self.device),
                     "ops": {op: {"host_ms": wall.get(op), "device_ms": ms} for op, ms in device.items()},
                     "fbw_ops": sorted(op for op in wall if op[:1] in "FBW" and op[1:].isdigit())})
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump(rows, f)
        return loss

    PipeMorphEngine.train_batch = timed


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("on_gpu0.py: no CUDA device")
    torch.cuda.set_device(0)
    DeepSpeedEngine._set_distributed_vars = _on_gpu0
    models.ds_config = _torch_adam
    if os.environ.get("GPU_CHECK_OP_TIMES"):
        _record_op_times(os.environ["GPU_CHECK_OP_TIMES"])
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
