"""Run a training script on a device without fp16: ``python no_fp16_run.py SCRIPT ARGS...``.

DeepSpeed's CPU accelerator reports fp16 where oneDNN has it (CPUs with AVX512-FP16 do); this tells
it that it has none before the script starts, as most CPUs' accelerator says, so the refusal of an
``fp16`` section on such a device is tested on any host."""
from __future__ import annotations

import os
import runpy
import sys

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python no_fp16_run.py SCRIPT [ARGS...]")
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: False
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as running the script itself sets it
    runpy.run_path(sys.argv[0], run_name="__main__")
