"""Generate a dynamic link-delay trace like PipeMorph §7.2 ("dynamic stragglers").

Each slow link's extra one-way delay is drawn from N(mean=30, sd=10) ms, clipped at 0, and redrawn
after an interval drawn from U(a, b) ms, independently per link, from t = 0 to the duration. The
paper's three change rates are presets: A = U(50, 100), B = U(100, 200), C = U(200, 400) ms. Links
not in the slow set stay at 0 ms. The output is the trace format of
``ds_pipemorph/runtime/inject.py`` (``points: [{t: seconds, links_ms: [...]}]``, one point per
change, each with every link's delay), so ``pipemorph.inject.trace`` in a ds_config can replay it.

    python recipes/stragglers/make_trace.py --stages 4 --slow all --rate B --duration-s 60 -o trace.yaml
    python recipes/stragglers/make_trace.py --stages 4 --slow 2 --interval-ms 500,1000 --seed 3 -o t.yaml

Same arguments and seed, same file.
"""
from __future__ import annotations

import argparse
import random
import sys
from typing import Optional, Sequence

import yaml

RATES = {"A": (50.0, 100.0), "B": (100.0, 200.0), "C": (200.0, 400.0)}


def make_trace(links: int, slow: Sequence[int], duration_s: float, interval_ms: tuple[float, float],
               mean_ms: float = 30.0, sd_ms: float = 10.0, seed: int = 0) -> dict:
    """The trace as a mapping: sorted change points, each with every link's delay in ms."""
    if links < 1:
        raise ValueError(f"a pipeline of {links + 1} stages has no link")
    bad = [i for i in slow if not 0 <= i < links]
    if bad:
        raise ValueError(f"slow link {bad[0]} does not exist: links are 0..{links - 1}")
    a, b = interval_ms
    if not 0 < a <= b:
        raise ValueError(f"interval U({a:g}, {b:g}) ms needs 0 < a <= b")
    if duration_s <= 0 or mean_ms < 0 or sd_ms < 0:
        raise ValueError("duration, mean and sd must be positive (mean and sd may be 0)")
    rng = random.Random(seed)
    changes: dict[float, dict[int, float]] = {0.0: {}}
    for link in sorted(set(slow)):  # each link has its own stream of draws, in link order
        t = 0.0
        while t < duration_s:
            changes.setdefault(round(t, 6), {})[link] = round(max(0.0, rng.gauss(mean_ms, sd_ms)), 3)
            t += rng.uniform(a, b) / 1000.0
    current = [0.0] * links
    points = []
    for t in sorted(changes):
        for link, c in changes[t].items():
            current[link] = c
        points.append({"t": round(t, 4), "links_ms": list(current)})
    return {"points": points}


def _slow(text: str, links: int) -> list[int]:
    if text == "all":
        return list(range(links))
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--slow: '{text}' is not 'all' or a comma-separated list of link indices") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, required=True, help="pipeline stages (links = stages - 1)")
    ap.add_argument("--slow", default="all", help="slow links: 'all' (the paper) or e.g. 2 or 0,2")
    ap.add_argument("--rate", choices=sorted(RATES), default="B", help="the paper's change-interval preset")
    ap.add_argument("--interval-ms", help="a,b: change interval U(a, b) ms (overrides --rate)")
    ap.add_argument("--duration-s", type=float, default=60.0, help="trace length in seconds")
    ap.add_argument("--mean-ms", type=float, default=30.0)
    ap.add_argument("--sd-ms", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--output", help="write the trace here (default: stdout)")
    args = ap.parse_args(argv)
    try:
        links = args.stages - 1
        interval = RATES[args.rate]
        if args.interval_ms:
            parts = [float(x) for x in args.interval_ms.split(",")]
            if len(parts) != 2:
                raise ValueError(f"--interval-ms: '{args.interval_ms}' is not a,b")
            interval = (parts[0], parts[1])
        trace = make_trace(links, _slow(args.slow, links), args.duration_s, interval,
                           args.mean_ms, args.sd_ms, args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    head = (f"# make_trace.py --stages {args.stages} --slow {args.slow} --interval-ms {interval[0]:g},{interval[1]:g} "
            f"--duration-s {args.duration_s:g} --mean-ms {args.mean_ms:g} --sd-ms {args.sd_ms:g} --seed {args.seed}\n")
    text = head + yaml.safe_dump(trace, sort_keys=False, default_flow_style=None, width=200)
    if args.output:
        from ds_pipemorph.fileio import write_atomic

        write_atomic(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
