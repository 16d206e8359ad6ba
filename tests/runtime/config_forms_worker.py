"""Trains the same 2-stage job once per config form, under the deepspeed launcher; writes what it saw.

    deepspeed --num_gpus 2 tests/runtime/config_forms_worker.py OUT_DIR

Forms: ``dict``, ``path`` (str), ``pathlike`` (pathlib.Path), ``base64`` (urlsafe base64 of the
JSON, as DeepSpeed decodes it), ``args`` (``args.deepspeed_config`` = the path) through
``ds_pipemorph.initialize``, and ``stock``: ``deepspeed.initialize`` given the same base64 string.
Per rank it writes OUT_DIR/rank<r>.json: per form the losses, gradient accumulation steps, the
pipemorph schedule (``null`` for stock), and torch's intra-op thread count after initialize.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import pathlib
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ds_pipemorph  # noqa: E402
from models import batches, build_model, ds_config  # noqa: E402

STAGES, MICRO_BATCHES, STEPS = 2, 4, 2
FORMS = ("dict", "path", "pathlike", "base64", "args", "stock")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--local_rank", type=int, default=0)  # passed by the deepspeed launcher
    opts = ap.parse_args()
    out = pathlib.Path(opts.out_dir)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    cfg = ds_config(MICRO_BATCHES, pipemorph={"schedule": "1f1b", "adapt": {"enabled": False},
                                              "delegation": {"mode": "off"}})
    path = out / "ds_config.json"
    if rank == 0:
        path.write_text(json.dumps(cfg))
    dist.barrier()
    encoded = base64.urlsafe_b64encode(json.dumps(cfg).encode()).decode()
    given = {"dict": cfg, "path": str(path), "pathlike": path, "base64": encoded, "stock": encoded}
    seen = {}
    for form in FORMS:
        model = build_model(STAGES, seed=1234)
        if form == "stock":
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=given[form])
        elif form == "args":
            args = argparse.Namespace(deepspeed_config=str(path), local_rank=opts.local_rank)
            engine, _, _, _ = ds_pipemorph.initialize(args=args, model=model, model_parameters=model.parameters())
        else:
            engine, _, _, _ = ds_pipemorph.initialize(model=model, model_parameters=model.parameters(),
                                                      config=given[form])
        threads = torch.get_num_threads()
        it = iter(batches(MICRO_BATCHES * STEPS, 2, seed=99))
        losses = [float(engine.train_batch(it)) for _ in range(STEPS)]
        pm = getattr(engine, "pipemorph", None)
        seen[form] = {"losses": losses, "gas": engine.gradient_accumulation_steps(), "threads": threads,
                      "schedule": None if pm is None else pm.schedule}
        if hasattr(engine, "transport"):
            engine.transport.close()
        dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
