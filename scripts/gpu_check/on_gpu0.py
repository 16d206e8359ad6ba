"""Runs a torchrun worker script with every rank on cuda:0: several ranks share the one GPU.

    torchrun --standalone --nproc_per_node 4 scripts/gpu_check/on_gpu0.py SCRIPT [ARGS...]

Two shims make 4 ranks on one GPU work, the same for stock DeepSpeed and PipeMorphEngine:

- ``LOCAL_RANK=0`` in the rank's environment, set before DeepSpeed is imported. DeepSpeed puts a rank
  on ``cuda:<LOCAL_RANK>``: ``init_process_group`` gets ``device_id=cuda:<LOCAL_RANK>``, and the engine
  reads ``LOCAL_RANK`` into ``local_rank``, sets that device and places the model there. With one GPU only
  cuda:0 exists, so every rank must read 0.
- ``host_p2p.install()``: gloo has no CUDA point-to-point, and every pipeline engine sends CUDA tensors
  point to point (the first one in its constructor), so under gloo those messages are staged through host
  memory (see ``host_p2p.py``). NCCL is no way out: it wants one GPU per rank.

The tests' ``models.ds_config`` asks for torch's Adam (``torch_adam``), so that no FusedAdam is JIT-built,
for stock DeepSpeed and the engine alike; with ``GPU_CHECK_DELEGATION=MODE`` it also sets the
``pipemorph`` section's ``delegation.mode`` (the Nsight job's script asks for "off"; the check runs it
"always", as the other GPU job). With ``GPU_CHECK_OP_TIMES=DIR``, after every ``PipeMorphEngine.train_batch``
each rank appends the host (wall) ms and the CUDA-event device ms of its F/B/W ops to ``DIR/rank<r>.json``.
Then SCRIPT runs as ``__main__``.
"""
from __future__ import annotations

import json
import os
import runpy
import sys

os.environ.setdefault("DS_ACCELERATOR", "cuda")
os.environ["LOCAL_RANK"] = "0"  # before DeepSpeed is imported: every rank on cuda:0 (see above)
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "runtime"))

import torch  # noqa: E402

import host_p2p  # noqa: E402  (scripts/gpu_check/host_p2p.py, next to this file)
import models  # noqa: E402  (tests/runtime/models.py, as the workers import it)

_ds_config = models.ds_config


def _torch_adam(*a, **kw):
    cfg = _ds_config(*a, **kw)
    cfg["optimizer"]["params"]["torch_adam"] = True
    mode = os.environ.get("GPU_CHECK_DELEGATION")
    if mode and cfg.get("pipemorph") is not None:
        cfg["pipemorph"] = {**cfg["pipemorph"], "delegation": {**cfg["pipemorph"].get("delegation", {}), "mode": mode}}
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
    host_p2p.install()
    models.ds_config = _torch_adam
    if os.environ.get("GPU_CHECK_OP_TIMES"):
        _record_op_times(os.environ["GPU_CHECK_OP_TIMES"])
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
