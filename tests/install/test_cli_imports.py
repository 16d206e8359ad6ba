"""The planning commands are pure Python: ``pipemorph --help``, ``plan`` and ``simulate`` run in a fresh
interpreter without importing torch, deepspeed or matplotlib (matplotlib only once ``--gantt`` asks for a
picture). Each case runs the real console entry point in a subprocess and lists the modules it loaded."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "recipes" / "profiles" / "paper_fig4.yaml"
HEAVY = ("torch", "deepspeed", "matplotlib")

# Runs ``pipemorph ARGS`` through the console script's function, then prints the loaded top-level modules.
PROBE = """
import json, sys
from ds_pipemorph_cli.app import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code or 0
else:
    code = 0
print("\\nMODULES " + json.dumps({"code": code, "modules": sorted({m.split('.')[0] for m in sys.modules})}))
"""


def loaded(args: list[str], cwd: Path) -> tuple[int, set[str], str]:
    env = {**os.environ, "COLUMNS": "120"}
    p = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=120)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("MODULES ")]
    assert line, p.stdout + p.stderr
    rec = json.loads(line[-1][len("MODULES "):])
    return rec["code"], set(rec["modules"]), p.stdout + p.stderr


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plan") / "plan.yaml"
    code, _, text = loaded(["plan", str(PROFILE), "-o", str(out)], out.parent)
    assert code == 0 and out.is_file(), text
    return out


@pytest.mark.timeout(120)
def test_help_imports_no_torch_and_lists_every_command(tmp_path):
    code, mods, text = loaded(["--help"], tmp_path)
    assert code == 0, text
    assert not mods & set(HEAVY), sorted(mods & set(HEAVY))
    for name in ("plan", "simulate", "export", "demo", "bench", "profile-links", "profile-stages", "trace"):
        assert name in text


@pytest.mark.timeout(120)
def test_plan_imports_no_torch(plan_file):
    code, mods, text = loaded(["plan", str(PROFILE), "--budget", "0.2", "-o", str(plan_file.parent / "again.yaml")],
                              plan_file.parent)
    assert code == 0, text
    assert not mods & set(HEAVY), sorted(mods & set(HEAVY))
    assert "predicted iteration 390.0 ms" in text  # the last stage starts after 3 F and then runs 12 x (F + B + W)


@pytest.mark.timeout(120)
def test_simulate_imports_no_torch(plan_file):
    code, mods, text = loaded(["simulate", str(plan_file), "--links-ms", "0,0,20"], plan_file.parent)
    assert code == 0, text
    assert not mods & set(HEAVY), sorted(mods & set(HEAVY))


@pytest.mark.timeout(120)
def test_simulate_loads_matplotlib_only_for_gantt(plan_file):
    pytest.importorskip("matplotlib")
    png = plan_file.parent / "gantt.png"
    code, mods, text = loaded(["simulate", str(plan_file), "--gantt", str(png)], plan_file.parent)
    assert code == 0, text
    assert "matplotlib" in mods and png.stat().st_size > 0
    assert not mods & {"torch", "deepspeed"}, sorted(mods & {"torch", "deepspeed"})


@pytest.mark.timeout(120)
def test_bench_help_and_an_unknown_command_import_no_torch(tmp_path):
    code, mods, text = loaded(["bench", "--help"], tmp_path)
    assert code == 0, text
    assert not mods & set(HEAVY), sorted(mods & set(HEAVY))
    code, _, text = loaded(["plam"], tmp_path)
    assert code == 2 and "No such command 'plam'. Did you mean 'plan'" in text  # the closest names first
