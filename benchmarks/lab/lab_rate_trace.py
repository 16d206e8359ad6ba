"""A real link whose rate changes while PipeMorph trains: link 1 (node 1 <-> node 2, both directions)
follows a rate trace calm -> slow -> calm (``Lab.play``: ``tc class change`` under the running job).

One job (``_lab_job``), one row: ``schedule: adaptive``, ``delegation.mode: auto``; emulated stages
(``--op-ms`` per F, B and W) send real activations and gradients sized so that one message takes
``--message-ms`` at the slow rate (8 S / R). The trace starts once ``--start-after`` iterations are in. Written:
the JSON (every iteration's time, start, link paths and the control loop's link-delay reading; the
re-plans; the trace as applied) and a PNG next to it: iteration time over time with the trace's phases
shaded and the re-plans marked. The table lists the medians per phase and every re-plan.

    sudo -E DS_ACCELERATOR=cpu python benchmarks/lab/lab_rate_trace.py [--calm 1gbit] [--slow 100mbit]
        [--message-ms 40] [--calm-s 15] [--slow-s 30] [--op-ms 20] [--microbatches 8] [--iterations 120]
        [--out out/lab_rate_trace.json]

Needs root (network namespaces); every namespace is removed when it ends.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _lab_job import NODES, JobSpec, Row, rows_for, run_job  # noqa: E402
from _util import check_out, exit_on_bad_input, keep, print_table, work_folder, write_json  # noqa: E402

from ds_pipemorph.lab import Lab, RateTrace  # noqa: E402
from ds_pipemorph.lab.shape import format_rate, parse_rate  # noqa: E402

SLOW_LINK = 1


def phase_of(t: float, bounds: list[tuple[str, float, float]]) -> str:
    for name, a, b in bounds:
        if a <= t < b:
            return name
    return "before"


def plot(path: Path, its: list[dict], bounds, replans: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 4.5))
    colors = {"calm": "#e8f4e8", "slow": "#f8e0e0", "calm again": "#e8f4e8"}
    for name, a, b in bounds:
        ax.axvspan(a, b, color=colors.get(name, "#eeeeee"), zorder=0)
        ax.text((a + b) / 2, 0.97, name, transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=9)
    for mode, marker, color in (("direct", "o", "tab:blue"), ("delegated", "s", "tab:red")):
        pts = [(i["t"], i["ms"]) for i in its if i["modes"][SLOW_LINK] == mode]
        if pts:
            ax.plot(*zip(*pts), marker, color=color, label=f"link 1 {mode} (after the iteration)", zorder=3)
    ax.plot([i["t"] for i in its], [i["ms"] for i in its], "-", color="grey", lw=0.8, zorder=2)
    start = {i["iteration"]: i["t"] for i in its}
    for k, r in enumerate(replans):
        t = start.get(r["iteration"] + 1)
        if t is not None:
            ax.axvline(t, color="black", ls="--", lw=1, zorder=1, label="re-plan in force" if k == 0 else None)
    ax.set_xlabel("seconds since the trace started (iteration start)")
    ax.set_yscale("log")  # a link switch that starts delegates can take seconds: keep the rest readable
    ax.set_ylabel("iteration time (ms, log scale)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)  # atomic: a reader never sees half a PNG


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calm", default="1gbit")
    ap.add_argument("--slow", default="100mbit")
    ap.add_argument("--message-ms", type=float, default=40.0, help="8 S / R of one activation at the slow rate")
    ap.add_argument("--calm-s", type=float, default=15.0, help="seconds of the first calm phase")
    ap.add_argument("--slow-s", type=float, default=30.0, help="seconds of the slow phase")
    ap.add_argument("--start-after", type=int, default=2, help="iterations before the trace starts (start-up)")
    ap.add_argument("--op-ms", type=float, default=20.0)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=120)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="the engine's timeout_s")
    ap.add_argument("--out", default="out/lab_rate_trace.json")
    args = ap.parse_args(argv)
    check_out(args.out)
    calm, slow = parse_rate(args.calm), parse_rate(args.slow)
    trace = RateTrace(points=[{"t": 0, "rate": calm}, {"t": args.calm_s, "rate": slow},
                              {"t": args.calm_s + args.slow_s, "rate": calm}])
    act_rows = rows_for(args.message_ms / 1e3, slow)
    work = work_folder("lab-rate-trace-")
    spec = JobSpec(rows=[Row(name="pipemorph", pipemorph={"schedule": "adaptive", "delegation": {"mode": "auto"}},
                             iterations=args.iterations)],
                   microbatches=args.microbatches, op_ms=args.op_ms, act_rows=act_rows, timeout_s=args.timeout_s,
                   out=str(work / "job.json"), progress=str(work / "progress"))
    started = []
    with Lab(nodes=NODES) as lab:
        lab.shape(SLOW_LINK, SLOW_LINK + 1, calm, both=True)

        def start_trace(lines):
            if not started and len(lines) >= args.start_after:
                player = lab.play(SLOW_LINK, SLOW_LINK + 1, trace, both=True)
                started.append((time.monotonic(), player))

        job = run_job(lab, spec, work, on_progress=start_trace)
        applied = [(round(t, 3), format_rate(r)) for t, r in started[0][1].applied] if started else []
    if job.results is None or any(c != 0 for c in job.codes):
        print(job.log_text()[-6000:], file=sys.stderr)
        print(f"a rank failed (exit codes {job.codes}); logs under {keep(work)}", file=sys.stderr)
        if job.results is None:
            return 1
    t0 = started[0][0]
    row = job.results["rows"][0]
    end = max(i["start_s"] - t0 + i["ms"] / 1e3 for i in row["iterations"])
    bounds = [("calm", 0.0, args.calm_s), ("slow", args.calm_s, args.calm_s + args.slow_s),
              ("calm again", args.calm_s + args.slow_s, max(end, args.calm_s + args.slow_s))]
    its = [{"iteration": i["iteration"], "t": round(i["start_s"] - t0, 3), "ms": round(i["ms"], 1),
            "modes": i["modes"], "estimated_links_ms": i["estimated_links_ms"],
            "adapter_links_ms": i.get("adapter_links_ms")} for i in row["iterations"]]
    for i in its:
        i["phase"] = phase_of(i["t"], bounds)
    out = Path(args.out)
    png = out.with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    wire_ms = 8 * spec.message_bytes / slow * 1e3
    plot(png, its, bounds, row["replans"],
         f"PipeMorph (adaptive, delegation auto), link 1 {format_rate(calm)} -> {format_rate(slow)} -> "
         f"{format_rate(calm)}; {spec.message_bytes} B per message ({wire_ms:.0f} ms at the slow rate)")
    phases = []
    for name, _, _ in bounds:
        ms = [i["ms"] for i in its if i["phase"] == name]
        links = [i["adapter_links_ms"][SLOW_LINK] for i in its if i["phase"] == name and i["adapter_links_ms"]
                 and i["adapter_links_ms"][SLOW_LINK] is not None]
        phases.append({"phase": name, "iterations": len(ms), "median_ms": round(statistics.median(ms), 1) if ms else None,
                       "median_link1_ms": round(statistics.median(links), 1) if links else None})
    print_table("per phase (iteration medians; the control loop's link 1 reading)",
                ["phase", "iterations", "iteration ms", "link 1 reading ms"],
                [[p["phase"], p["iterations"], p["median_ms"], p["median_link1_ms"]] for p in phases])
    start = {i["iteration"]: i["t"] for i in its}
    switch = {}  # iteration -> the slowest rank's ms moving links between transports
    for per_rank in row["switch_ms"]:
        for it, ms in per_rank:
            switch[it] = max(switch.get(it, 0.0), ms)
    print_table("re-plans (decided after iteration k, in force from k+1)",
                ["after iteration", "in force at s", "kind", "measured link ms", "planned for ms", "warm-up",
                 "predicted ms", "link switch ms"],
                [[r["iteration"], start.get(r["iteration"] + 1), r["kind"],
                  [None if v is None else round(v, 1) for v in r["measured_ms"]], r["target_ms"], r["warmup"],
                  round(r["predicted_ms"], 1), switch.get(r["iteration"], "-")] for r in row["replans"]])
    write_json(str(out), {"benchmark": "lab_rate_trace", "calm_bits": calm, "slow_bits": slow,
                          "message_bytes": spec.message_bytes, "wire_ms_slow": wire_ms, "op_ms": args.op_ms,
                          "microbatches": args.microbatches, "trace_applied": applied, "phases": phases,
                          "replans": row["replans"], "switch_ms": row["switch_ms"], "events": row["events"],
                          "iterations": its,
                          "exit_codes": job.codes, "job_seconds": round(job.seconds, 1), "plot": str(png)})
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_bad_input(main))
