"""Writes ``gpu_check_report.json`` and ``gpu_check_report.txt`` from the steps ``scripts/gpu_check.sh`` ran.

    python scripts/gpu_check/report.py --steps OUT/steps.tsv --out OUT [--budget-s 480]

``steps.tsv`` has one tab-separated row per step: name, exit code (or ``skipped``: a tool it needs is
missing; or ``budget``: the time budget ran out before it), seconds, key file (the JSON a step wrote, or
pytest's JUnit XML; may be empty), note, command. A step fails on a non-zero exit code, on a key file
with ``"ok": false`` or ``failures``, on a missing key file after exit 0, and (the JUnit step) on a
GPU-only test that did not pass. The verdict: FAILED when a step failed, else INCOMPLETE when a step
did not run for want of time, else PASSED. Prints the text report; exit code 0 only when PASSED, else 1.
Imports no torch.
"""
from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ds_pipemorph.fileio import write_atomic  # noqa: E402

# Why a step did not run (steps.tsv's exit column) -> its status: a missing tool skips it, a spent budget
# leaves the check incomplete.
NOT_RUN = {"skipped": "skipped", "budget": "incomplete"}
# Tests that skip themselves without a GPU: on the GPU they must pass, a skip there is a failure.
GPU_ONLY_TESTS = {"tests/staging/test_staging_nvcc.py": ("test_cuda_path_round_trip_on_a_gpu",)}


def read_steps(path: Path) -> list[dict]:
    steps = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        name, rc, secs, keys, note, command = (line.split("\t") + [""] * 6)[:6]
        steps.append({"name": name, "command": command, "exit_code": None if rc in NOT_RUN else int(rc),
                      "seconds": float(secs or 0), "key_file": keys, "note": note,
                      "not_run": NOT_RUN.get(rc, "")})
    return steps


def _junit(path: Path) -> tuple[dict, list[str]]:
    root = ET.parse(path).getroot()
    outcomes: dict[str, str] = {}
    for case in root.iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        outcomes[case.get("name", "")] = kind
    counts = {k: sum(v == k for v in outcomes.values()) for k in ("passed", "failure", "error", "skipped")}
    problems = [f"{n}: {k}" for n, k in outcomes.items() if k in ("failure", "error")]
    for names in GPU_ONLY_TESTS.values():
        for n in names:
            if outcomes.get(n) != "passed":
                problems.append(f"{n} (needs a GPU) did not pass: {outcomes.get(n, 'not run')}")
    return {"tests": len(outcomes), **counts}, problems


def _staging(data: dict) -> dict:
    out = {}
    for r in data.get("rows", []):
        med = r["median_gbps"]
        out[f"{r['size_mb']}MB"] = {"memcpy_gbps": round(med["memcpy"], 2), "ring_gbps": round(med["ring"], 2),
                                    "ring_vs_memcpy": round(r["ratio_vs_memcpy"]["ring"], 2)}
    return out


def key_numbers(key_file: str) -> tuple[dict, list[str]]:
    """(key numbers, problems) from a step's key file."""
    path = Path(key_file)
    if path.suffix == ".xml":
        return _junit(path)
    data = json.loads(path.read_text())
    if data.get("benchmark") == "staging_throughput":  # a benchmark: numbers, no verdict
        return _staging(data), []
    problems = [str(p) for p in data.get("failures", [])]
    if data.get("ok") is False and not problems:
        problems.append('the step wrote "ok": false')
    return data.get("key_numbers", {}), problems


def judge(step: dict) -> dict:
    s = {**step, "key_numbers": {}, "problems": []}
    if s["exit_code"] is None:
        s["status"] = s.get("not_run") or "skipped"
        return s
    if s["key_file"]:
        if Path(s["key_file"]).is_file():
            try:
                s["key_numbers"], s["problems"] = key_numbers(s["key_file"])
            except (ValueError, KeyError, ET.ParseError) as e:
                s["problems"].append(f"cannot read {s['key_file']}: {e}")
        elif s["exit_code"] == 0:
            s["problems"].append(f"{s['key_file']} was not written")
    s["status"] = "passed" if s["exit_code"] == 0 and not s["problems"] else "failed"
    return s


def _flat(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += _flat(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={v}")
    return out


def text_report(report: dict) -> str:
    unrun = f"{report['incomplete']} not run for want of time, " if report["incomplete"] else ""
    lines = [f"gpu_check: {report['verdict']} ({report['failed']} of {len(report['steps'])} steps failed, "
             f"{unrun}{report['skipped']} skipped), {report['seconds']:.1f} s of a {report['budget_s']} s budget"]
    for s in report["steps"]:
        rc = "-" if s["exit_code"] is None else s["exit_code"]
        lines.append(f"{s['status'].upper():<11}{s['name']:<15}{s['seconds']:>7.1f} s  exit {rc}"
                     + (f"  ({s['note']})" if s["note"] else ""))
        lines.append(f"           $ {s['command']}")
        lines += [f"           {x}" for x in _flat(s["key_numbers"])]
        lines += [f"           problem: {p}" for p in s["problems"]]
    return "\n".join(lines) + "\n"


def write_report(steps: list[dict], out: Path, budget_s: float = 480) -> int:
    """Judge the steps, write both report files into ``out``; 0 when the verdict is PASSED, else 1."""
    judged = [judge(s) for s in steps]
    failed = sum(s["status"] == "failed" for s in judged)
    incomplete = sum(s["status"] == "incomplete" for s in judged)
    verdict = "FAILED" if failed else "INCOMPLETE" if incomplete else "PASSED"
    report = {"verdict": verdict, "failed": failed, "incomplete": incomplete,
              "skipped": sum(s["status"] == "skipped" for s in judged),
              "seconds": round(sum(s["seconds"] for s in judged), 1), "budget_s": budget_s, "steps": judged}
    text = text_report(report)
    write_atomic(Path(out) / "gpu_check_report.json", json.dumps(report, indent=2) + "\n")
    write_atomic(Path(out) / "gpu_check_report.txt", text)
    sys.stdout.write(text)
    return 0 if verdict == "PASSED" else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--budget-s", type=float, default=480)
    a = p.parse_args(argv)
    return write_report(read_steps(a.steps), a.out, a.budget_s)


if __name__ == "__main__":
    sys.exit(main())
