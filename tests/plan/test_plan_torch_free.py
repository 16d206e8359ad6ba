"""``ds_pipemorph.plan`` and the transport protocol import no torch: a fresh interpreter imports every
module of the package, in every subpackage, and every name of its public surface (and
``runtime.transport.protocol``), and neither torch nor deepspeed is loaded.
(``ds_pipemorph.control`` has the same check in tests/control/test_torch_free.py.)"""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PLAN = REPO / "ds_pipemorph" / "plan"

SCRIPT = """
import importlib, json, pkgutil, sys
import ds_pipemorph.plan as pkg
names = [pkg.__name__] + [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
names.append("ds_pipemorph.runtime.transport.protocol")
for name in names:
    importlib.import_module(name)
public = [getattr(pkg, name) for name in pkg.__all__]
heavy = sorted(m for m in ("torch", "deepspeed") if m in sys.modules)
print(json.dumps({"modules": names, "heavy": heavy}))
"""


def test_every_plan_module_and_the_transport_protocol_import_without_torch():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    on_disk = {".".join(("ds_pipemorph", *p.relative_to(PLAN.parent).with_suffix("").parts)).removesuffix(".__init__")
               for p in PLAN.rglob("*.py")}
    assert on_disk - set(got["modules"]) == set()  # every module, in every subpackage
    assert "ds_pipemorph.plan.sim.simulate" in on_disk and "ds_pipemorph.plan.sched.milp" in on_disk
    assert got["heavy"] == [], f"importing {got['modules']} loaded {got['heavy']}"
