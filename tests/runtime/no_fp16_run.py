"""Run a training script on a device without fp16: ``python no_fp16_run.py SCRIPT ARGS...``.

DeepSpeed's CPU accelerator reports fp16 where oneDNN has it (CPUs with AVX512-FP16 do); this tells
it that it has none before the script starts, as most CPUs' accelerator says, so the refusal of an
``fp16`` section on such a device is tested on any host."""
from __future__ import annotations

import runpy
import sys

from deepspeed.accelerator import get_accelerator

get_accelerator().is_fp16_supported = lambda: False
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
