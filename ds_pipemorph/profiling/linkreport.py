"""The link report (``--report``, JSON) and the ``links_ms`` values, from gathered ping-pong samples.

Per link: one-way latency samples and their median; per direction ("down" r -> r+1, "up"
r+1 -> r) and message size, the one-way time samples and their median, and the fit
``time = latency + size / bandwidth`` (see ``linkfit``). ``links_ms`` is the median small-message
one-way latency of each link minus the fastest link's (the *extra* delay c_i of docs/design.md), or the
absolute latency with ``absolute``.

With ``--all-pairs`` (``build_pair_report``) the same per pair of ranks, and ``link_matrix`` the
link matrix file of docs/placement.md from it.
"""
from __future__ import annotations

import statistics
from typing import Optional, Sequence

from .linkfit import fit_latency_bandwidth, link_delays, slow_links
from .linkmeasure import __doc__ as METHOD

DIRECTIONS = {"down": "stage r -> r+1 (activations)", "up": "stage r+1 -> r (input gradients)"}
PAIR_DIRECTIONS = {"down": "rank a -> rank b (a < b)", "up": "rank b -> rank a"}

MATRIX_RULE = ("latency_ms: the pair's median ping-pong one-way latency (half the round trip, one value for "
               "both directions); bandwidth_gbs: the slower direction's fitted bandwidth, or, where neither "
               "direction showed a size dependence, the median of the measured pairs' (100 if none)")


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
            entry["directions"][d] = {
                "from_stage": i if d == "down" else i + 1,
                "to_stage": i + 1 if d == "down" else i,
                **_direction(rec[d], sizes),
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


def _direction(by_size_samples: dict, sizes: Sequence[int]) -> dict:
    """Samples, medians and the latency + size/bandwidth fit of one direction."""
    by_size = {s: by_size_samples.get(s, []) for s in sizes}
    medians = {s: _med(v) for s, v in by_size.items() if v}
    fit = fit_latency_bandwidth(list(medians), list(medians.values()))
    return {
        "samples_ms": {str(s): _r(v) for s, v in by_size.items()},
        "median_ms": {str(s): round(m, 4) for s, m in medians.items()},
        "fit": fit.as_dict(),
    }


def build_pair_report(samples: dict, sizes: Sequence[int], *, world: int, rounds: list, slow_factor: float,
                      backend: str, hosts: Sequence[str], warmup: int, reps: int,
                      inject_ms: Optional[dict]) -> dict:
    """The ``--all-pairs`` report: per pair (a, b), a < b, its round, latency samples and median, and per
    direction ("down" a -> b, "up" b -> a) samples, medians and fit; ``link_matrix`` turns it into the
    link matrix file."""
    round_of = {tuple(p): i for i, ps in enumerate(rounds) for p in ps}
    pairs = []
    for (a, b), rec in sorted(samples.items()):
        entry = {
            "ranks": [a, b],
            "round": round_of.get((a, b)),
            "hosts": [hosts[a], hosts[b]] if len(hosts) > b else [],
            "latency_ms": {"samples": _r(rec["latency_ms"]), "median": round(_med(rec["latency_ms"]), 4)},
            "directions": {d: {"from_rank": a if d == "down" else b, "to_rank": b if d == "down" else a,
                               **_direction(rec[d], sizes)} for d in PAIR_DIRECTIONS},
        }
        entry["bandwidth_gbps"] = _min_bw(entry)
        pairs.append(entry)
    lat = [e["latency_ms"]["median"] for e in pairs]
    marks = slow_links(lat, [e["bandwidth_gbps"] for e in pairs], slow_factor)
    for e, why in zip(pairs, marks):
        e["slow"] = why
    return {
        "method": " ".join(METHOD.split()),
        "backend": backend,
        "world_size": world,
        "rounds": [[list(p) for p in ps] for ps in rounds],
        "sizes_bytes": list(sizes),
        "warmup": warmup,
        "reps": reps,
        "slow_factor": slow_factor,
        "symmetric": MATRIX_RULE,
        "inject_pairs_ms": None if inject_ms is None else [{"ranks": list(p), "delay_ms": c} for p, c in sorted(inject_ms.items())],
        "pairs": pairs,
    }


def link_matrix(rep: dict) -> dict:
    """The link matrix file (``plan.files.linkmatrix.LinkMatrix``, docs/placement.md) of an ``--all-pairs``
    report: dense symmetric ``latency_ms`` and ``bandwidth_gbs`` (see ``MATRIX_RULE``), validated
    by the model and written in its own form."""
    from ..plan.files.linkmatrix import LinkMatrix

    W = rep["world_size"]
    known = [e["bandwidth_gbps"] for e in rep["pairs"] if e["bandwidth_gbps"] is not None]
    fallback = _sig(statistics.median(known)) if known else LinkMatrix.model_fields["default"].default.bandwidth_gbs
    lat = [[0.0] * W for _ in range(W)]
    bw = [[fallback] * W for _ in range(W)]
    for e in rep["pairs"]:
        a, b = e["ranks"]
        lat[a][b] = lat[b][a] = round(e["latency_ms"]["median"], 4)
        if e["bandwidth_gbps"] is not None:
            bw[a][b] = bw[b][a] = _sig(e["bandwidth_gbps"])
    for a in range(W):
        bw[a][a] = 0.0  # the diagonal is ignored; 0 marks it
    m = LinkMatrix.model_validate({"version": 1, "world_size": W, "latency_ms": lat, "bandwidth_gbs": bw})
    return m.model_dump(mode="json", exclude={"default", "pairs"})


def _sig(x: float) -> float:
    """Six significant digits, never rounded down to 0."""
    return float(f"{x:.6g}")


def _min_bw(entry: dict) -> Optional[float]:
    bws = [x["fit"]["bandwidth_gbps"] for x in entry["directions"].values()]
    known = [b for b in bws if b is not None]
    return min(known) if known else None


def _med(xs) -> float:
    return statistics.median(xs) if xs else 0.0


def _r(xs) -> list[float]:
    return [round(x, 4) for x in xs]
