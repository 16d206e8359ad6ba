"""Runtime tests: real DeepSpeed ranks on CPU/gloo, launched as subprocesses.

DeepSpeed JIT-builds small ops on first start; a cache built by another DeepSpeed or torch version
breaks jobs with an AttributeError, so the cache directory is keyed by both versions.
"""
import os
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    str(Path.home() / ".cache" / "torch_extensions" / f"ds_pipemorph-ds{version('deepspeed')}-torch{version('torch')}"),
)
