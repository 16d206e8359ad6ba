"""Generate a dynamic link-delay trace like PipeMorph §7.2 ("dynamic stragglers").

Each slow link's extra one-way delay is drawn from N(mean=30, sd=10) ms, clipped at 0, and redrawn
after an interval drawn from U(a, b) ms, independently per link, from t = 0 to the duration. The
paper's three change rates are presets: A = U(50, 100), B = U(100, 200), C = U(200, 400) ms. Links
not in the slow set stay at 0 ms. The output is the trace format of
``ds_pipemorph/inject/delays.py`` (``points: [{t: seconds, links_ms: [...]}]``, one point per
change, each with every link's delay), so ``pipemorph.inject.trace`` in a ds_config can replay it.

    python recipes/stragglers/make_trace.py --stages 4 --slow all --rate B --duration-s 60 -o trace.yaml
    python recipes/stragglers/make_trace.py --stages 4 --slow 2 --interval-ms 500,1000 --seed 3 -o t.yaml

Same arguments and seed, same file. The generator is ``ds_pipemorph.bench.traces`` (``pipemorph bench
--dynamic`` writes the three paper cases with it).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from ds_pipemorph.bench.traces import RATES, make_trace, trace_text  # noqa: F401 (make_trace: re-exported)


def _slow(text: str, links: int) -> list[int]:
    if text == "all":
        return list(range(links))
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--slow: '{text}' is not 'all' or a comma-separated list of link indices") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    text = trace_text(trace, f"make_trace.py --stages {args.stages} --slow {args.slow} --interval-ms "
                             f"{interval[0]:g},{interval[1]:g} --duration-s {args.duration_s:g} --mean-ms "
                             f"{args.mean_ms:g} --sd-ms {args.sd_ms:g} --seed {args.seed}")
    if args.output:
        from ds_pipemorph.fileio import write_atomic

        write_atomic(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
