"""Stable CLI output for tests (Typer reads these at import) and a version-keyed extension cache."""
import os
from importlib import metadata

os.environ.setdefault("TYPER_USE_RICH", "0")
os.environ.setdefault("TERMINAL_WIDTH", "200")
os.environ.setdefault("COLUMNS", "200")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _ver(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


# A cache built by another DeepSpeed version breaks the next job with an AttributeError.
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    os.path.expanduser(f"~/.cache/torch_extensions/ds_pipemorph-ds{_ver('deepspeed')}-torch{_ver('torch')}"),
)
