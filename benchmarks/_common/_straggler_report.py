"""What ``real_straggler.py`` prints and writes: the rows' table, and the slowdown predictor refitted
on the rows' per-iteration stage measurements against persistence (rank 0, after the runs)."""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import numpy as np
from _util import print_table, write_json

RESAMPLES, LEVEL = 10_000, 0.95


def measured_slowdowns(row: dict, lp, args) -> list[float]:
    """Per stage, as the rebalance loop measures it: F + B + W per micro-batch over what the layers it
    held cost in the layer profile, the median after the burners (settled) over the median before;
    with burners from the start there is no before, and the layer profile itself is the reference."""
    out = []
    for stage in row["stages"]:
        per = [sum(i["fbw"]) / solo_ms(lp, i["layers"]) for i in stage]
        before = statistics.median(per[1:args.burn_from]) if args.burn_from else 1.0
        out.append(statistics.median(per[args.burn_from + args.settle:]) / before)
    return out


def solo_ms(lp, layers) -> float:
    """F + B + W of layers ``layers[0]..layers[1]-1`` in the layer profile."""
    a, b = layers
    return sum(lp.layers.forward_ms[a:b]) + sum(lp.layers.backward_input_ms[a:b]) + sum(lp.layers.backward_weight_ms[a:b])


def ratio_interval(row: list[float], base: list[float], seed: int = 0) -> tuple[float, float, float]:
    """median(row) / median(base) and its percentile bootstrap interval (two independent samples)."""
    from scipy.stats import bootstrap

    a, b = np.asarray(row, dtype=float), np.asarray(base, dtype=float)
    stat = lambda x, y, axis: np.median(x, axis=axis) / np.median(y, axis=axis)  # noqa: E731
    ci = bootstrap((a, b), stat, paired=False, vectorized=True, method="percentile", n_resamples=RESAMPLES,
                   confidence_level=LEVEL, rng=np.random.default_rng(seed)).confidence_interval
    return float(np.median(a) / np.median(b)), float(ci.low), float(ci.high)


def first_move_after(events: list[dict], burn_from: int):
    """The iteration from which the first successful move decided after the burners started ran."""
    after = [e for e in events if e["ok"] and e["iteration"] + 1 > burn_from]
    return after[0]["iteration"] + 1 if after else None


def loop_prediction(events: list[dict], ms: list[float], burn_from: int) -> dict | None:
    """The rebalance loop's predicted iteration for its first move after the burners started, beside
    the measured median under that partition: from the iteration after the one the move took effect
    in (which may still carry the move's own cost) to the next move, or the end."""
    moves = [e for e in events if e["ok"] and e["iteration"] + 1 > burn_from]
    if not moves:
        return None
    start = moves[0]["iteration"] + 2
    stop = moves[1]["iteration"] + 1 if len(moves) > 1 else len(ms)
    under = ms[start:stop]
    out = {"from_iteration": start, "to_iteration": stop - 1, "current_ms": moves[0]["current_ms"],
           "predicted_ms": moves[0]["predicted_ms"], "measured_ms": None, "error": None}
    if under:
        out["measured_ms"] = statistics.median(under)
        out["error"] = out["measured_ms"] / out["predicted_ms"] - 1
    return out


def row_summary(kind: str, res: dict, uniform_after: list[float] | None, lp, args) -> dict:

    ms = [1e3 * s for s in res["seconds"]]
    before, after = ms[1:args.burn_from], ms[args.burn_from + args.settle:]
    events = res["events"]
    out = {"row": kind, "before_ms": statistics.median(before) if before else None,
           "after_ms": statistics.median(after), "loop_prediction": loop_prediction(events, ms, args.burn_from),
           "stage_slowdown": [round(x, 3) for x in measured_slowdowns(res, lp, args)],
           "moves": sum(1 for e in events if e["ok"]), "first_move_from": first_move_after(events, args.burn_from),
           "parts": res["parts"], "events": events, "seconds": res["seconds"], "losses": res["losses"],
           "stage_ms": [[round(sum(i["fbw"]), 3) for i in stage] for stage in res["stages"]],
           "stage_layers": [[i["layers"] for i in stage] for stage in res["stages"]]}
    if uniform_after is not None:
        out["after_over_uniform"] = ratio_interval(after, uniform_after)
    return out


# ---------------------------------------------------------------------------------------------
# the slowdown predictor on these runs


def samples(res: dict, lp, row: str) -> list[dict]:
    """One per stage and iteration k >= 1: the features of iteration k, the stage's slowdown in k + 1
    (measured op time over the layer profile's, for the layers the stage held then)."""
    from ds_pipemorph.control.interference import HostCounters, extract_features, window_slowdown

    def solo(layers):
        a, b = layers
        lay = lp.layers
        return {"F": sum(lay.forward_ms[a:b]), "B": sum(lay.backward_input_ms[a:b]), "W": sum(lay.backward_weight_ms[a:b])}

    out = []
    for s, stage in enumerate(res["stages"]):
        for k in range(1, len(stage) - 1):
            now, nxt = stage[k], stage[k + 1]
            solo_now, solo_next = solo(now["layers"]), solo(nxt["layers"])
            if min(solo_now.values()) <= 0 or min(solo_next.values()) <= 0:
                continue  # a stage whose layers have no B or W in the profile (not in this model's cuts)
            feats = extract_features(HostCounters(*now["host"][0]), HostCounters(*now["host"][1]), now["ops"], solo_now,
                                     sum(solo_next.values()), now["probe_ms"], res["probe_solo_ms"])
            out.append({"run": row, "stage": s, "iteration": k + 1, "features": feats.vector(),
                        "slowdown": window_slowdown(nxt["ops"], solo_next)})
    return out


def predictor(results: dict, lp) -> dict | None:
    try:
        import sklearn  # noqa: F401
    except ImportError:
        print("the predictor part needs scikit-learn: pip install 'ds_pipemorph[interference]'", file=sys.stderr)
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "control"))  # interference_predictor.py
    from interference_predictor import evaluate, print_evaluation

    held = next((k for k in ("rebalance", "rebalance-profiled") if k in results), list(results)[-1])
    train = [s for kind, res in results.items() if kind != held for s in samples(res, lp, kind)]
    test = samples(results[held], lp, held)
    if not train or not test:
        return None
    res = evaluate(train, test)
    print_evaluation(res, f"Slowdown of a stage in the next iteration, held-out row '{held}' ({len(test)} samples; "
                          f"trained on {len(train)} of the rows {', '.join(k for k in results if k != held)})")
    base = res["predictors"]["persistence"]["all"]["mae"]
    forest = res["predictors"]["forest (slowdown)"]["all"]["mae"]
    verdict = (f"forest (slowdown) beats persistence on the held-out row: MAE {forest:.3f} vs {base:.3f}" if forest < base
               else f"the forest does NOT beat persistence on the held-out row: MAE {forest:.3f} vs {base:.3f}")
    print(verdict)
    return {"held_out": held, "samples": {"train": len(train), "test": len(test)}, **res, "verdict": verdict,
            "data": train + test}


# ---------------------------------------------------------------------------------------------


def prediction_line(kind: str, p: dict) -> list:
    measured = "-" if p["measured_ms"] is None else f"{p['measured_ms']:.0f}"
    error = "-" if p["error"] is None else f"{100 * p['error']:+.1f} %"
    return [kind, f"{p['current_ms']:.0f}", f"{p['predicted_ms']:.0f}", measured,
            f"{p['from_iteration']}-{p['to_iteration']}", error]


def report(results: dict, best: dict | None, lp, args) -> None:
    uniform_after = None
    if "uniform" in results:
        u = results["uniform"]["seconds"]
        uniform_after = [1e3 * s for s in u[args.burn_from + args.settle:]]
    rows, table, predictions = [], [], []
    for kind, res in results.items():
        r = row_summary(kind, res, uniform_after if kind != "uniform" else None, lp, args)
        rows.append(r)
        ratio = r.get("after_over_uniform")
        first = r["first_move_from"]
        table.append([kind, "-" if r["before_ms"] is None else f"{r['before_ms']:.0f}", f"{r['after_ms']:.0f}",
                      "-" if ratio is None else f"{ratio[0]:.2f} [{ratio[1]:.2f}, {ratio[2]:.2f}]",
                      " / ".join(f"{x:.2f}" for x in r["stage_slowdown"]), r["moves"],
                      "-" if first is None else f"{first} (+{first - args.burn_from})", str(r["parts"])])
        if r["loop_prediction"] is not None:
            predictions.append(prediction_line(kind, r["loop_prediction"]))
    load = os.getloadavg()
    when = "from the start" if args.burn_from == 0 else f"from iteration {args.burn_from}"
    before = "" if args.burn_from == 0 else f"1-{args.burn_from - 1} (before) and "
    print_table(f"{args.burners} burner(s) on stage 1's core {when}: {args.model}, 2 stages x {args.microbatches} "
                f"micro-batches; medians of iterations {before}{args.burn_from + args.settle}-{args.iters - 1} "
                f"(after), ms", ["row", "before", "after", "after / uniform [95 %]", "stage slowdown (0 / 1)", "moves",
                                 "first move after burners", "parts at end"], table)
    if predictions:
        print_table("the rebalance loop's first move after the burners: its replay's iteration before and after the "
                    "move (under the slowdowns it measured) against the measured median after it, ms",
                    ["row", "loop: current partition", "loop: predicted", "measured after move", "iterations",
                     "prediction error"], predictions)
    print(f"load average at the end: {load[0]:.1f} ({os.cpu_count()} cores)")
    if best is not None:
        print(f"best static: parts {best['parts']} for the slowdowns measured in the uniform row "
              f"{[round(x, 2) for x in best['slowdown']]}")
    pred = None if args.no_predictor or len(results) < 2 else predictor(results, lp)
    write_json(args.out, {
        "benchmark": "real_straggler", "command": "python benchmarks/control/real_straggler.py " + " ".join(sys.argv[1:]),
        "model": args.model, "stages": 2, "slow_stage": 1, "microbatches": args.microbatches, "iters": args.iters,
        "burn_from": args.burn_from, "burners": args.burners, "settle": args.settle,
        "load_average_end": load, "best_static": best,
        "layer_profile": {"forward_ms": [round(v, 3) for v in lp.layers.forward_ms]},
        "rows": rows, "predictor": pred})

