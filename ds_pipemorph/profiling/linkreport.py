"""The link report (``--report``, JSON) and the ``links_ms`` values, from gathered ping-pong samples.

Per link: one-way latency samples and their median; per direction ("down" r -> r+1, "up"
r+1 -> r) and message size, the one-way time samples and their median, and the fit
``time = latency + size / bandwidth`` (see ``linkfit``). ``links_ms`` is the median small-message
one-way latency of each link minus the fastest link's (the *extra* delay c_i of docs/design.md), or the
absolute latency with ``absolute``.
"""
from __future__ import annotations

import statistics
from typing import Optional, Sequence

from .linkfit import fit_latency_bandwidth, link_delays, slow_links
from .links import __doc__ as METHOD

DIRECTIONS = {"down": "stage r -> r+1 (activations)", "up": "stage r+1 -> r (input gradients)"}


def build_report(samples: list[dict], sizes: Sequence[int], *, absolute: bool, slow_factor: float,
                 backend: str, hosts: Sequence[str], warmup: int, reps: int,
                 inject_ms: Optional[Sequence[float]]) -> dict:
    links = []
    for i, rec in enumerate(samples):
        entry = {
            "link": i,
            "stages": [i, i + 1],
            "hosts": [hosts[i], hosts[i + 1]] if len(hosts) > i + 1 else [],
            "latency_ms": {"samples": _r(rec["latency_ms"]), "median": round(_med(rec["latency_ms"]), 4)},
            "directions": {},
        }
        for d in DIRECTIONS:
            by_size = {s: rec[d].get(s, []) for s in sizes}
            medians = {s: _med(v) for s, v in by_size.items() if v}
            fit = fit_latency_bandwidth(list(medians), list(medians.values()))
            entry["directions"][d] = {
                "from_stage": i if d == "down" else i + 1,
                "to_stage": i + 1 if d == "down" else i,
                "samples_ms": {str(s): _r(v) for s, v in by_size.items()},
                "median_ms": {str(s): round(m, 4) for s, m in medians.items()},
                "fit": fit.as_dict(),
            }
        links.append(entry)
    lat = [e["latency_ms"]["median"] for e in links]
    bws = [_min_bw(e) for e in links]
    delays = link_delays(lat, absolute)
    marks = slow_links(lat, bws, slow_factor)
    for e, c, why in zip(links, delays, marks):
        e["links_ms"] = c
        e["slow"] = why
    return {
        "method": " ".join(METHOD.split()),
        "backend": backend,
        "stages": len(samples) + 1,
        "sizes_bytes": list(sizes),
        "warmup": warmup,
        "reps": reps,
        "slow_factor": slow_factor,
        "links_ms_mode": "absolute" if absolute else "extra",
        "inject_links_ms": list(inject_ms) if inject_ms is not None else None,
        "links_ms": delays,
        "links": links,
    }


def _min_bw(entry: dict) -> Optional[float]:
    bws = [entry["directions"][d]["fit"]["bandwidth_gbps"] for d in DIRECTIONS]
    known = [b for b in bws if b is not None]
    return min(known) if known else None


def _med(xs) -> float:
    return statistics.median(xs) if xs else 0.0


def _r(xs) -> list[float]:
    return [round(x, 4) for x in xs]
