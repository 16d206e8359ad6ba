"""The orchestrator on a real slow data-parallel link: 8 lab nodes x 1 rank, 2 replicas x 4 stages.

DeepSpeed's default placement puts stage s on ranks 2s and 2s + 1, each on its own lab node, so each
stage's all-reduce crosses one link between two nodes. One pair inside a data-parallel ring (nodes 2
and 3, stage 1's replicas by default) is rate-limited by the kernel (htb, both directions). Nothing in
this path sleeps to imitate the network: the slow link is the kernel's, the all-reduce moves each
stage's real gradients (a ballast parameter of ``--ballast-mb`` MB per stage next to the emulated
stage's F/B/W, see ``_lab_dp_job``).

1. **Measure the links**: ``pipemorph profile-links --all-pairs -o links.json`` runs on the 8 nodes
   (one rank each); the link matrix it writes is the one the engine and ``pipemorph place`` use.
   The shaped pair must be the matrix's slowest in bandwidth, near its configured rate.
2. **Predict**: ``plan.place.predict`` on that matrix (the model of ``pipemorph place``; op times F = B = W =
   ``--op-ms``, each stage's gradient bytes): DeepSpeed's default placement and the orchestrator's.
3. **Train** (one launch, two rows, each a fresh engine from the same seed and batches):
   (a) the default placement, no orchestrator; (b) the default placement with ``"orchestrate":
   {"matrix": links.json}``: the engine times its own ``ReduceGrads``, rank 0's orchestrator
   (``control.orchestrate``) sees the slow all-reduce and the engine re-maps its ranks while training
   (``runtime.remap``). Both rows run the static ``zb`` order (no control loop, no delegation), so the
   only change in (b) is the placement.

Prints per iteration each stage's all-reduce (``ReduceGrads``, slowest replica) and the iteration time
(barrier to the last rank's return from ``train_batch``; the re-mapping that follows a ``train_batch``
is timed apart), the decision line the engine logs, and before / after means against the predictions;
checks that (b) trains exactly as (a) (same losses, same parameters). Needs root (it builds a lab).

    python benchmarks/lab/lab_orchestrator.py [--rate 100mbit] [--pair 2-3] [--ballast-mb 2] [--out out/lab_orchestrator.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))  # the shared helpers

from _util import check_out, exit_on_bad_input, print_table, work_folder, write_json

from _lab_dp_job import NODES, REPLICAS, STAGES, WIDTH, JobSpec, Row, ballast_elements, node_command, run_job, run_nodes
from ds_pipemorph.lab import Lab, parse_rate

REPO = Path(__file__).resolve().parents[2]
DEFAULT = "default"
IN_RUN = "orchestrate"
DECISION = "pipemorph: orchestrate:"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="100mbit", help="the shaped pair's rate, both directions")
    ap.add_argument("--pair", default="2-3", help="the shaped pair of nodes A-B (default: stage 1's two replicas)")
    ap.add_argument("--ballast-mb", type=float, default=2.0, help="gradient MB per stage (a ballast parameter)")
    ap.add_argument("--op-ms", type=float, default=10.0, help="F = B = W of every stage")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10, help="iterations of each row")
    ap.add_argument("--sizes", default="1M,4M,8M", help="profile-links message sizes")
    ap.add_argument("--reps", type=int, default=5, help="profile-links timed exchanges per direction and size")
    ap.add_argument("--out", default="out/lab_orchestrator.json")
    ap.add_argument("--work", help="keep the matrix, the report and every node's log here (default: a temporary directory, removed when the run succeeds)")
    return ap.parse_args(argv)


def cli_env(work: Path) -> dict:
    """PYTHONPATH for ``python -m ds_pipemorph_cli.app`` in the nodes (the installed package)."""
    if importlib.util.find_spec("ds_pipemorph_cli") is None:
        raise SystemExit("the pipemorph command is not installed here: run `bash scripts/setup.sh` first")
    return {"PYTHONPATH": os.pathsep.join([p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p])}


def profile_links(lab, work: Path, sizes: str, reps: int, port: int = 29711) -> tuple[dict, dict, str]:
    """``pipemorph profile-links --all-pairs`` on every node: (the link matrix, the report, rank 0's output)."""
    matrix, report = work / "links.json", work / "links-report.json"
    args = ["-m", "ds_pipemorph_cli.app", "profile-links", "--all-pairs", "--sizes", sizes, "--reps", str(reps),
            "-o", str(matrix), "--report", str(report)]
    logs = [work / f"profile-node{k}.log" for k in range(NODES)]
    commands = [node_command(lab, k, args[0], args[1:], port, work) for k in range(NODES)]
    codes, texts, _ = run_nodes(lab, commands, logs, 900.0, extra_env=cli_env(work))
    if any(codes) or not matrix.exists():
        raise RuntimeError(f"profile-links failed (exit codes {codes}):\n{texts[0][-3000:]}")
    return json.loads(matrix.read_text()), json.loads(report.read_text()), texts[0]


def shaped_pair_check(matrix: dict, pair: tuple[int, int], rate_bits: int) -> dict:
    """Where the shaped pair stands in the measured matrix: its bandwidth against the rate, and the
    slowest pair (which must be it)."""
    bw = matrix["bandwidth_gbs"]
    pairs = sorted(((bw[a][b], (a, b)) for a in range(NODES) for b in range(a + 1, NODES)))
    a, b = pair
    want = rate_bits / 8 / 1e9
    others = [x for x, p in pairs if p != (min(a, b), max(a, b))]
    return {"slowest_pair": list(pairs[0][1]), "slowest_gbs": pairs[0][0], "shaped_gbs": bw[a][b], "rate_gbs": want,
            "shaped_error": (bw[a][b] - want) / want, "next_slowest_gbs": min(others),
            "found": pairs[0][1] == (min(a, b), max(a, b)) and min(others) > 3 * bw[a][b]}


def predict_all(matrix: dict, args, grad_mb: float, chosen=None) -> dict:
    """``plan.place.predict`` on the measured matrix: DeepSpeed's default placement and the orchestrator's, and
    (both rows run the static zb order) each placement under the static order."""
    from ds_pipemorph.plan.files.linkmatrix import LinkMatrix
    from ds_pipemorph.plan.ir.profile import Costs
    from ds_pipemorph.plan.place.placement import Placement
    from ds_pipemorph.plan.place.predict import Job, Planner, place, predict

    m = LinkMatrix.model_validate(matrix)
    job = Job(Costs.uniform(STAGES, args.op_ms), args.microbatches, [grad_mb] * STAGES)
    t = time.perf_counter()
    res = place(m, STAGES, REPLICAS, job)
    seconds = time.perf_counter() - t
    static = Planner(job, "static")

    def show(p):
        return {"ranks": p.placement.as_lists(), "iteration_ms": p.iteration_ms, "pipeline_ms": p.pipeline_ms,
                "allreduce_ms": p.allreduce_ms}

    out = {"place_s": seconds, "grad_mb": grad_mb, "baseline": show(res.baseline), "orchestrator": show(res.orchestrator),
           "orchestrator_static": show(predict(res.orchestrator.placement, m, static))}
    if chosen is not None:
        out["chosen_static"] = show(predict(Placement.from_ranks(chosen), m, static))
    return out


def row_section(mode: str, matrix_path: str) -> dict:
    base = {"schedule": "zb", "delegation": {"mode": "off"}, "adapt": {"enabled": False}}
    return dict(base, orchestrate={"matrix": matrix_path}) if mode == IN_RUN else base


def summarize(res: dict) -> dict:
    """Per row: the iterations before and after its re-mapping, means of the iteration time and of each
    stage's all-reduce. Left out: the first iteration of each engine (start-up work) and, from the
    iteration times, the one whose boundary decided (rank 0's placement search, timed apart, ran in it;
    its all-reduce came before the decision and counts)."""
    out = {}
    for row in res["rows"]:
        its = row["iterations"]
        k = row["remaps"][0]["after_iteration"] if row["remaps"] else None
        before = [it for it in its[1:] if k is None or it["iteration"] <= k]
        before_t = [it for it in before if it["iteration"] != k]
        after = [it for it in its if k is not None and it["iteration"] >= k + 2]

        def mean(xs):
            return None if not xs else statistics.mean(x["ms"] for x in xs)

        def ar(xs):
            return None if not xs else [statistics.mean(x["allreduce_ms"][s] for x in xs) for s in range(STAGES)]

        out[row["name"]] = {"remap_after": k, "before_iterations": [it["iteration"] for it in before],
                            "before_time_iterations": [it["iteration"] for it in before_t],
                            "after_iterations": [it["iteration"] for it in after],
                            "before_ms": mean(before_t), "after_ms": mean(after),
                            "before_allreduce_ms": ar(before), "after_allreduce_ms": ar(after),
                            "ranks_before": its[0]["ranks"], "ranks_after": its[-1]["ranks"]}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    check_out(args.out)
    a, b = (int(x) for x in args.pair.split("-"))
    rate = parse_rate(args.rate)
    grad_mb = (ballast_elements(args.ballast_mb) + WIDTH * WIDTH + WIDTH) * 4 / 1e6  # every parameter of a stage
    work = Path(args.work) if args.work else work_folder("pipemorph-lab-orchestrator-")
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    t_all = time.perf_counter()
    with Lab(nodes=NODES) as lab:
        lab_id = lab.lab_id
        lab.shape(a, b, rate, both=True)
        t = time.perf_counter()
        matrix, report, profile_out = profile_links(lab, work, args.sizes, args.reps)
        profile_s = time.perf_counter() - t
        found = shaped_pair_check(matrix, (a, b), rate)
        spec = JobSpec(rows=[Row(name=DEFAULT, pipemorph=row_section(DEFAULT, ""), iterations=args.iters),
                             Row(name=IN_RUN, pipemorph=row_section(IN_RUN, str(work / "links.json")),
                                 iterations=args.iters)],
                       microbatches=args.microbatches, op_ms=args.op_ms, ballast_mb=args.ballast_mb, timeout_s=300.0,
                       out=str(work / "job" / "result.json"), progress=str(work / "job" / "progress.jsonl"))
        job = run_job(lab, spec, work / "job")
    if job.results is None or any(job.codes):
        print(job.log_text()[-8000:], file=sys.stderr)
        print(f"the 8-node job failed (exit codes {job.codes}); logs in {work / 'job'}", file=sys.stderr)
        return 1
    res = job.results
    rows = {r["name"]: r for r in res["rows"]}
    decision_lines = [ln.strip() for ln in job.logs[0].splitlines() if DECISION in ln]
    decisions = rows[IN_RUN]["decisions"]
    chosen = decisions[0]["ranks"] if decisions else None
    pred = predict_all(matrix, args, grad_mb, chosen)
    summary = summarize(res)
    load_after = os.getloadavg()

    print_table(f"profile-links --all-pairs on {NODES} lab nodes, nodes {a}-{b} limited to {args.rate} "
                f"({found['rate_gbs']:.4f} GB/s) both ways: the 3 slowest pairs of the measured matrix",
                ["pair", "GB/s", "latency ms"],
                [[f"{p[0]}-{p[1]}", f"{bw:.4f}", f"{matrix['latency_ms'][p[0]][p[1]]:.3f}"]
                 for bw, p in sorted((matrix["bandwidth_gbs"][x][y], (x, y)) for x in range(NODES)
                                     for y in range(x + 1, NODES))[:3]])
    print(f"shaped pair {a}-{b} is the slowest, at {found['shaped_gbs']:.4f} GB/s ({found['shaped_error']:+.1%} vs the "
          f"rate), next slowest {found['next_slowest_gbs']:.4f} GB/s: found = {found['found']}")

    table = []
    for name in (DEFAULT, IN_RUN):
        for it in rows[name]["iterations"]:
            note = "" if not it["remap"] else (
                (f"decided at its end ({decisions[0]['seconds']:.1f} s on rank 0, included); " if decisions else "")
                + (f"re-mapped after it in {max(r['ms'] for r in it['remap']):.0f} ms (not included)"
                   if all(r["ok"] for r in it["remap"]) else "re-mapping FAILED"))
            table.append([name, it["iteration"], " ".join(",".join(map(str, r)) for r in it["ranks"]),
                          *[f"{x:.1f}" for x in it["allreduce_ms"]], f"{it['ms']:.1f}", f"{it['loss']:.6f}", note])
    print_table(f"{REPLICAS} replicas x {STAGES} stages on {NODES} lab nodes, {args.microbatches} micro-batches, "
                f"F = B = W = {args.op_ms:g} ms, {grad_mb:.3f} MB of gradients per stage, nodes {a}-{b} at {args.rate}",
                ["row", "iter", "ranks per stage", *[f"AR s{s} ms" for s in range(STAGES)], "iteration ms", "loss",
                 "note"], table)
    print("the engine's decision (rank 0's log):")
    for ln in decision_lines or ["(none: the engine did not re-map)"]:
        print(f"  {ln}")

    s_def, s_run = summary[DEFAULT], summary[IN_RUN]
    p_base, p_chosen = pred["baseline"], pred.get("chosen_static") or pred["orchestrator_static"]

    def fmt(xs):
        return "-" if xs is None else " / ".join(f"{x:.1f}" for x in xs)

    def one(x):
        return "-" if x is None else f"{x:.1f}"

    print_table("before and after the re-mapping against `pipemorph place`'s prediction (plan.place.predict on the measured "
                "matrix, static zb order as both rows run)",
                ["what", "ranks per stage", "iterations", "AR ms s0 / s1 / s2 / s3", "iteration ms"],
                [[f"{DEFAULT} (a)", " ".join(",".join(map(str, r)) for r in s_def["ranks_before"]),
                  ",".join(map(str, s_def["before_iterations"])), fmt(s_def["before_allreduce_ms"]), one(s_def["before_ms"])],
                 [f"{IN_RUN} (b) before", " ".join(",".join(map(str, r)) for r in s_run["ranks_before"]),
                  f"{','.join(map(str, s_run['before_iterations']))} (time: {','.join(map(str, s_run['before_time_iterations']))})",
                  fmt(s_run["before_allreduce_ms"]), one(s_run["before_ms"])],
                 ["predicted, default placement", " ".join(",".join(map(str, r)) for r in p_base["ranks"]), "-",
                  fmt(p_base["allreduce_ms"]), one(p_base["iteration_ms"])],
                 [f"{IN_RUN} (b) after", " ".join(",".join(map(str, r)) for r in s_run["ranks_after"]),
                  ",".join(map(str, s_run["after_iterations"])), fmt(s_run["after_allreduce_ms"]), one(s_run["after_ms"])],
                 ["predicted, engine's placement", " ".join(",".join(map(str, r)) for r in p_chosen["ranks"]), "-",
                  fmt(p_chosen["allreduce_ms"]), one(p_chosen["iteration_ms"])],
                 ["pipemorph place's orchestrator", " ".join(",".join(map(str, r)) for r in pred["orchestrator"]["ranks"]),
                  "-", fmt(pred["orchestrator"]["allreduce_ms"]), one(pred["orchestrator"]["iteration_ms"])]])
    same = rows[IN_RUN]["params_vs_first_row"]
    losses = [(x["loss"], y["loss"]) for x, y in zip(rows[DEFAULT]["iterations"], rows[IN_RUN]["iterations"])]
    loss_diff = max(abs(x - y) for x, y in losses)
    print(f"training (b) vs (a): largest parameter difference per stage {same['per_stage']}, largest loss difference "
          f"{loss_diff:g}; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after on {os.cpu_count()} cores; "
          f"{time.perf_counter() - t_all:.0f} s in all (profile-links {profile_s:.0f} s)")
    write_json(args.out, {"benchmark": "lab_orchestrator", "nodes": NODES, "stages": STAGES, "replicas": REPLICAS,
                          "rate": args.rate, "rate_bit_s": rate, "pair": [a, b], "ballast_mb": args.ballast_mb,
                          "grad_mb": grad_mb, "op_ms": args.op_ms, "microbatches": args.microbatches,
                          "iters": args.iters, "profile": {"sizes": args.sizes, "reps": args.reps, "seconds": profile_s},
                          "matrix": matrix, "shaped_pair": found, "predicted": pred, "decision_lines": decision_lines,
                          "decisions": decisions, "summary": summary, "rows": res["rows"], "loss_diff": loss_diff,
                          "load_average_before": list(load_before), "load_average_after": list(load_after),
                          "cores": os.cpu_count(), "work": args.work, "lab_id": lab_id})
    ok = found["found"] and bool(rows[IN_RUN]["remaps"]) and all(r["ok"] for m in rows[IN_RUN]["remaps"] for r in m["reports"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(exit_on_bad_input(main))
