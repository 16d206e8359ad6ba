"""Stable CLI output for tests (Typer reads these at import) and a version-keyed extension cache."""
import os

from ds_pipemorph.procs import versioned_extensions_dir

os.environ.setdefault("TYPER_USE_RICH", "0")
os.environ.setdefault("TERMINAL_WIDTH", "200")
os.environ.setdefault("COLUMNS", "200")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


# A cache built by another DeepSpeed version breaks the next job with an AttributeError.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", versioned_extensions_dir())
