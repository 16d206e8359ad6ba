"""The link matrix file (docs/placement.md): latency and bandwidth between every pair of ranks.

The placement search (``plan.place.predict``) reads it to decide which ranks share a data-parallel ring
and which pairs carry pipeline traffic. Links are symmetric: a pair ``(a, b)`` is the same link
as ``(b, a)``, since an all-reduce ring and a pipeline link both carry traffic both ways and a
one-way latency cannot be split by direction without synchronised clocks (``profiling.linkmeasure``).

Values come from ``default`` (every pair), then the optional dense ``latency_ms`` /
``bandwidth_gbs`` matrices (W x W, symmetric, diagonal ignored), then the ``pairs`` list, each
later form overriding the earlier one for the pairs it names.

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

import math
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator


class LinkValues(BaseModel):
    """What every pair has unless the matrices or ``pairs`` say otherwise."""

    model_config = ConfigDict(extra="forbid")
    latency_ms: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    bandwidth_gbs: float = Field(100.0, gt=0.0, allow_inf_nan=False)


class PairLink(BaseModel):
    """One unordered pair of ranks and what differs on it (unset values keep the earlier ones)."""

    model_config = ConfigDict(extra="forbid")
    ranks: tuple[int, int]
    latency_ms: Optional[float] = Field(None, ge=0.0, allow_inf_nan=False)
    bandwidth_gbs: Optional[float] = Field(None, gt=0.0, allow_inf_nan=False)


class LinkMatrix(BaseModel):
    """One-way latency (ms, the time a tiny message takes, including any extra delay per message)
    and bandwidth (GB/s) of every pair of ranks of a job of ``world_size`` ranks."""

    model_config = ConfigDict(extra="forbid")
    version: Literal[1] = 1
    world_size: int = Field(ge=1)
    default: LinkValues = LinkValues()
    latency_ms: Optional[list[list[float]]] = None
    bandwidth_gbs: Optional[list[list[float]]] = None
    pairs: list[PairLink] = []
    _lat: list[list[float]] = PrivateAttr(default_factory=list)
    _bw: list[list[float]] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _resolve(self) -> "LinkMatrix":
        W = self.world_size
        lat = [[self.default.latency_ms] * W for _ in range(W)]
        bw = [[self.default.bandwidth_gbs] * W for _ in range(W)]
        for key, dest, positive in (("latency_ms", lat, False), ("bandwidth_gbs", bw, True)):
            dense = getattr(self, key)
            if dense is not None:
                _fill_dense(key, dense, dest, W, positive)
        seen: set[tuple[int, int]] = set()
        for i, p in enumerate(self.pairs):
            a, b = p.ranks
            for x in (a, b):
                if not 0 <= x < W:
                    raise ValueError(f"pairs[{i}]: rank {x} is outside 0..{W - 1} (world_size {W})")
            if a == b:
                raise ValueError(f"pairs[{i}]: ranks {a} and {b} are the same rank, not a link")
            key = (min(a, b), max(a, b))
            if key in seen:
                raise ValueError(f"pairs[{i}]: the pair {key} is listed twice (links are symmetric: ({a}, {b}) and ({b}, {a}) are one link)")
            seen.add(key)
            if p.latency_ms is not None:
                lat[a][b] = lat[b][a] = p.latency_ms
            if p.bandwidth_gbs is not None:
                bw[a][b] = bw[b][a] = p.bandwidth_gbs
        self._lat, self._bw = lat, bw
        return self

    def latency(self, a: int, b: int) -> float:
        """One-way latency of the link between ranks ``a`` and ``b`` in ms (0 for a rank and itself)."""
        return 0.0 if a == b else self.__pydantic_private__["_lat"][a][b]  # no pydantic __getattr__: hot path

    def bandwidth(self, a: int, b: int) -> float:
        """Bandwidth of the link between ranks ``a`` and ``b`` in GB/s (= MB per ms)."""
        return float("inf") if a == b else self.__pydantic_private__["_bw"][a][b]

    @staticmethod
    def uniform(world_size: int, latency_ms: float = 0.0, bandwidth_gbs: float = 100.0,
                pairs: Optional[list[dict]] = None) -> "LinkMatrix":
        """Every pair alike, except the ``pairs`` given as ``{"ranks": [a, b], "latency_ms": ...}``."""
        return LinkMatrix.model_validate({"world_size": world_size,
                                          "default": {"latency_ms": latency_ms, "bandwidth_gbs": bandwidth_gbs},
                                          "pairs": pairs or []})


def _fill_dense(key: str, dense: list[list[float]], dest: list[list[float]], W: int, positive: bool) -> None:
    if len(dense) != W or any(len(row) != W for row in dense):
        shape = f"{len(dense)} rows of " + "/".join(sorted({str(len(r)) for r in dense}) or ["0"])
        raise ValueError(f"{key}: expected a {W} x {W} matrix (world_size {W}), got {shape} values")
    for a in range(W):
        for b in range(W):
            if a == b:
                continue
            v = dense[a][b]
            if not math.isfinite(v) or v < 0 or (positive and v == 0):
                need = "a positive number" if positive else "a number >= 0"
                raise ValueError(f"{key}[{a}][{b}] is {v}; it must be {need}")
            if v != dense[b][a]:
                raise ValueError(f"{key} is not symmetric: [{a}][{b}] is {v} but [{b}][{a}] is {dense[b][a]} (links are symmetric)")
            dest[a][b] = float(v)
