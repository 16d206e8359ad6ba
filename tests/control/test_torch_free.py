"""Every module of ds_pipemorph.control, at any depth, imports without torch or deepspeed (a fresh interpreter)."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHECK = """
import importlib, pkgutil, sys
import ds_pipemorph.control as pkg
names = [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
for name in names:
    importlib.import_module(name)
heavy = sorted(m for m in ("torch", "deepspeed") if m in sys.modules)
print(len(names), ",".join(heavy) or "-")
"""


def test_importing_every_control_module_leaves_torch_and_deepspeed_out():
    p = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    count, heavy = p.stdout.split()
    assert int(count) >= 3  # detector, estimate, policy
    assert heavy == "-"
