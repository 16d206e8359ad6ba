"""Pure arithmetic on link measurements: size parsing, the latency + size/bandwidth fit,
``links_ms`` (extra or absolute one-way latency per link) and the slow-link marks.

Fit: per link and direction, the median one-way time ``t(s)`` of each message size ``s`` is fitted
with ``t = latency + s / bandwidth`` by least squares on *relative* errors (weights ``1/t²``), so the
small sizes (which fix the latency) count as much as the large ones (which fix the bandwidth). A
negative intercept (noise) is refitted with the latency pinned at zero; a non-positive slope (no
size dependence visible) gives an unknown (``None``) bandwidth.
"""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from ..fileio import BadInput

_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": 1024**2, "MB": 1024**2, "MIB": 1024**2,
          "G": 1024**3, "GB": 1024**3, "GIB": 1024**3}
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M"


def parse_sizes(text: str) -> list[int]:
    """``4K,64K,1M`` -> bytes (K = 1024); sorted, distinct, each at least 1 byte."""
    sizes = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", part)
        unit = m and m.group(2).upper()
        if not m or unit not in _UNITS:
            raise BadInput(f"--sizes: '{part.strip()}' is not a message size (write e.g. 4K, 256K, 16M)")
        n = int(float(m.group(1)) * _UNITS[unit])
        if n < 1:
            raise BadInput(f"--sizes: '{part.strip()}' is below one byte")
        sizes.append(n)
    return sorted(set(sizes))


def human_bytes(n: int) -> str:
    for unit, f in (("M", 1024**2), ("K", 1024)):
        if n >= f and n % f == 0:
            return f"{n // f}{unit}"
    return f"{n}B"


@dataclass(frozen=True)
class Fit:
    latency_ms: float
    bandwidth_gbps: Optional[float]  # GB/s (1e9 bytes per second); None when no slope was measurable

    def time_ms(self, size: int) -> float:
        if self.bandwidth_gbps is None:
            return self.latency_ms
        return self.latency_ms + size / (self.bandwidth_gbps * 1e6)

    def as_dict(self) -> dict:
        return {"latency_ms": round(self.latency_ms, 4),
                "bandwidth_gbps": None if self.bandwidth_gbps is None else round(self.bandwidth_gbps, 4)}


def fit_latency_bandwidth(sizes: Sequence[int], times_ms: Sequence[float]) -> Fit:
    """``t = a + b*s`` minimising sum(((a + b*s - t) / t)^2); a >= 0; bandwidth = 1/b."""
    pts = [(float(s), float(t)) for s, t in zip(sizes, times_ms) if t > 0]
    if not pts:
        return Fit(0.0, None)
    if len(pts) == 1:
        return Fit(pts[0][1], None)
    w = [1.0 / t**2 for _, t in pts]
    sw = sum(w)
    sws = sum(wi * s for wi, (s, _) in zip(w, pts))
    swss = sum(wi * s * s for wi, (s, _) in zip(w, pts))
    swt = sum(wi * t for wi, (_, t) in zip(w, pts))
    swst = sum(wi * s * t for wi, (s, t) in zip(w, pts))
    det = sw * swss - sws * sws
    a, b = ((swss * swt - sws * swst) / det, (sw * swst - sws * swt) / det) if det > 0 else (-1.0, 0.0)
    if a < 0:
        a, b = 0.0, swst / swss
    if b <= 0:
        return Fit(statistics.median(t for _, t in pts), None)
    return Fit(a, 1.0 / b / 1e6)


def link_delays(latency_ms: Sequence[float], absolute: bool) -> list[float]:
    """``links_ms``: each link's one-way small-message latency, minus the fastest link's unless absolute."""
    if not latency_ms:
        return []
    base = 0.0 if absolute else min(latency_ms)
    return [round(max(0.0, x - base), 3) for x in latency_ms]


def slow_links(latency_ms: Sequence[float], bandwidth_gbps: Sequence[Optional[float]], factor: float) -> list[str]:
    """Per link, why it is slow ('' if it is not): latency above ``factor`` x the median link's, or
    bandwidth (the lower of its two directions) below the median link's / ``factor``."""
    med_lat = statistics.median(latency_ms) if latency_ms else 0.0
    known = [b for b in bandwidth_gbps if b is not None]
    med_bw = statistics.median(known) if known else None
    out = []
    for lat, bw in zip(latency_ms, bandwidth_gbps):
        why = []
        if lat > factor * med_lat:
            why.append(f"latency {lat / med_lat:.1f}x median" if med_lat > 0 else "latency")
        if med_bw is not None and bw is not None and bw * factor < med_bw:
            why.append(f"bandwidth {med_bw / bw:.1f}x below median")
        out.append(", ".join(why))
    return out
