"""Byte-level text from the Python standard library's own source: real text that needs no download.

The corpus is the running interpreter's standard library, the ``*.py`` files directly in
``sysconfig.get_paths()["stdlib"]`` (no subdirectories, so neither site-packages nor the test
suite), in sorted order. Every ``HELD_OUT_EVERY``-th file of that order is held out for validation,
the others are for training; each split takes whole files in that order up to its byte budget
(about 4 MB for training). The vocabulary is the 256 byte values. The files are read at start-up
and kept in memory, nothing is cached on disk. The same Python version gives the same bytes, so
the same windows; another version's standard library is another (similar) corpus.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

VOCAB = 256
HELD_OUT_EVERY = 8
BUDGET = {"train": 4_000_000, "val": 600_000}
SEEDS = {"train": 0, "val": 1_000_003}  # the val windows' seeds never equal the train windows'


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_files(split: str, root: Path | None = None) -> list[Path]:
    """The files of ``split`` ("train" or "val"): sorted top-level ``*.py`` of the standard library,
    every ``HELD_OUT_EVERY``-th one held out, whole files up to the split's byte budget."""
    if split not in BUDGET:
        raise ValueError(f"split must be 'train' or 'val', not {split!r}")
    root = stdlib_dir() if root is None else root
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    chosen = [p for i, p in enumerate(files) if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == (split == "val")]
    out, size = [], 0
    for p in chosen:
        n = p.stat().st_size
        if out and size + n > BUDGET[split]:
            break
        out.append(p)
        size += n
    if not out:
        raise FileNotFoundError(f"no *.py files in the standard library directory {root}")
    return out


def corpus(split: str, root: Path | None = None) -> torch.Tensor:
    """The split's files concatenated, as a uint8 tensor (one element per byte)."""
    data = b"".join(p.read_bytes() for p in split_files(split, root))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ByteWindows(torch.utils.data.Dataset):
    """``size`` windows of ``seq`` + 1 bytes of a split as (input ids, next ids), both int64 of
    length ``seq``; the start of window i is drawn from a generator seeded with i (and the split),
    so every rank and every run sees the same window at the same index."""

    def __init__(self, split: str, seq: int, size: int, root: Path | None = None):
        self.split, self.seq, self.size = split, seq, size
        self.bytes = corpus(split, root)
        if len(self.bytes) <= seq + 1:
            raise ValueError(f"the {split} corpus has {len(self.bytes)} bytes, too few for windows of {seq}")

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        if not 0 <= i < self.size:
            raise IndexError(i)
        g = torch.Generator().manual_seed(SEEDS[self.split] + i)
        start = int(torch.randint(0, len(self.bytes) - self.seq - 1, (1,), generator=g))
        w = self.bytes[start: start + self.seq + 1].long()
        return w[:-1], w[1:]


def micro_batches(split: str, seq: int, batch: int, count: int, root: Path | None = None) -> list:
    """Windows 0, 1, ... of ``split`` as ``count`` micro-batches of ``batch`` windows, each a pair
    (input ids, next ids) of shape (batch, seq): what one ``train_batch`` of ``count`` micro-batches
    reads, held in memory (benchmarks feed the same iteration again and again)."""
    windows = ByteWindows(split, seq, size=batch * count, root=root)
    pairs = [windows[i] for i in range(len(windows))]
    return [tuple(torch.stack([p[j] for p in pairs[m * batch:(m + 1) * batch]]) for j in (0, 1))
            for m in range(count)]
