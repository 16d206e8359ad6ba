"""Open a measured timeline by content: an Nsight Systems SQLite export or a Chrome trace JSON."""
from __future__ import annotations

from pathlib import Path

from ..fileio import BadInput
from .measured import MeasuredTrace
from .measured_chrome import read_chrome
from .nsys import SQLITE_MAGIC, read_nsys


def load_measured(path: str | Path) -> MeasuredTrace:
    """SQLite files (by their 16-byte header) go to the nsys reader, JSON text to the Chrome reader."""
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"{p}: no such file")
    with open(p, "rb") as f:
        head = f.read(64)
    if head.startswith(SQLITE_MAGIC):
        return read_nsys(p)
    if head.lstrip()[:1] in (b"{", b"["):
        return read_chrome(p)
    raise BadInput(f"{p}: neither an Nsight Systems SQLite export nor a Chrome trace JSON")
