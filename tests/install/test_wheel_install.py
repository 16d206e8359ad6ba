"""``pip install .`` as a user does it: build the wheel, install it into a fresh virtual environment that
reuses this interpreter's torch and DeepSpeed, and run a 2-stage job with every message delegated from
outside the source tree. The staging op then JIT-builds from the sources the wheel carries."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ds_pipemorph.procs import run_group, versioned_extensions_dir

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
# What a source distribution holds (MANIFEST.in); the wheel is built from a copy so the checkout stays clean.
BUILD_INPUTS = ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "CHANGELOG.md", "cli", "ds_pipemorph", "cuda_ext")
N, STEPS = 4, 3  # wheel_job.py: micro-batches per step, steps per run


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in BUILD_INPUTS:
        p = REPO / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
        else:
            shutil.copy2(p, src / name)
    dist = tmp_path_factory.mktemp("dist")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(dist), str(src)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    (whl,) = dist.glob("ds_pipemorph-*.whl")
    return whl


def _reuse_deepspeed_ops(cache: Path) -> None:
    """DeepSpeed's own CPU ops (its collectives and FusedAdam) as the session built them, into the
    installed wheel's cache where it has none: built from the same DeepSpeed sources with the same
    flags, ninja finds them up to date. The staging op is what this test builds from the wheel."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        return
    session = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    for op in ("deepspeed_shm_comm", "fused_adam"):
        built = session / op
        if (built / f"{op}.so").is_file() and not (built / "lock").exists() and not (cache / op).exists():
            part = cache / f".{op}.copying"  # copied aside, then moved in whole
            shutil.rmtree(part, ignore_errors=True)
            shutil.copytree(built, part, symlinks=True, ignore=shutil.ignore_patterns("lock"))
            os.replace(part, cache / op)


@pytest.mark.timeout(300)
def test_wheel_carries_the_staging_sources_the_planner_core_and_the_cli_but_no_recipes(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (REPO / "cuda_ext").iterdir() if p.suffix in (".cpp", ".cu", ".h"))
    assert sources, "cuda_ext/ holds no sources"
    for s in sources:
        assert f"ds_pipemorph/staging/cuda_ext/{s}" in names
    assert "ds_pipemorph_cli/app.py" in names and "ds_pipemorph/staging/builder.py" in names
    assert "ds_pipemorph/plan/sim/plancore.c" in names  # the planner core's source, compiled at first use
    assert not [n for n in names if n.startswith(("recipes/", "tests/", "benchmarks/", "cuda_ext/"))]
    entry = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "pipemorph = ds_pipemorph_cli.app:console_main" in zipfile.ZipFile(wheel).read(entry[0]).decode()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_installed_wheel_runs_a_delegated_2_stage_job_with_the_losses_of_direct_p2p(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=120)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIPEMORPH_CUDA_EXT_DIR", "PYTHONHOME")}
    # The installed sources have new paths and times: their build gets its own cache directory (DeepSpeed's
    # ops are cached there after the first run), so the suite's build from the checkout stays valid.
    env.update(PYTHONNOUSERSITE="1", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TORCH_EXTENSIONS_DIR=os.path.join(versioned_extensions_dir(), "installed-wheel"))
    _reuse_deepspeed_ops(Path(env["TORCH_EXTENSIONS_DIR"]))
    # The system site's editable install must not shadow the wheel: pip installs into the venv only.
    p = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "--force-reinstall", "-q",
                        str(wheel)], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    run = tmp_path / "run"  # outside the source tree: nothing is found through the working directory
    run.mkdir()
    script = run / "wheel_job.py"
    shutil.copy2(HERE / "wheel_job.py", script)
    out = run / "out"
    out.mkdir()
    p = run_group([str(py), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), str(out)],
                  540, cwd=run, env=env)
    logs = (p.stdout + p.stderr)[-4000:]
    assert p.returncode == 0, logs
    site = venv.resolve() / "lib"
    for rank in (0, 1):
        r = json.loads((out / f"rank{rank}.json").read_text())
        assert Path(r["package"]).resolve().is_relative_to(site), r["package"]
        assert Path(r["sources"]) == Path(r["package"]).resolve().parent / "staging" / "cuda_ext"
        assert all(Path(s).is_file() and Path(s).is_relative_to(site) for s in r["builder_sources"])
        assert r["library"], f"rank {rank} did not map the staging op"
        assert all(Path(lib).is_relative_to(env["TORCH_EXTENSIONS_DIR"]) for lib in r["library"])
        # Each rank sends N messages per step over link 0 (activations forward from rank 0, input
        # gradients back from rank 1): all through delegates when delegation is always on, none when off.
        assert r["sent_always"] == {"0": N * STEPS}, r["sent_always"]
        assert not r["sent_off"]
        assert len(r["losses_always"]) == STEPS
        assert all(math.isfinite(x) for x in r["losses_always"])
        # The delegated transport only moves bytes: the same losses, bit for bit.
        assert r["losses_always"] == r["losses_off"]
