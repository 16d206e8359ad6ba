"""One benchmark row's iteration times summarised: the true median (``statistics.median``: the mean
of the middle two over an even count) and the mean."""
from __future__ import annotations

import statistics


def summarize(times_ms: list[float]) -> dict:
    return {"iterations_ms": list(times_ms), "median_ms": statistics.median(times_ms),
            "mean_ms": statistics.fmean(times_ms)}
