"""A build of the staging op interrupted by a kill leaves torch's build lock behind; the next job must
load the op instead of waiting for that lock forever (``staging.builder.build_guard``)."""
import os
import shutil
import subprocess
import sys

import pytest

LOAD = "from ds_pipemorph.staging.builder import StagingRingBuilder; StagingRingBuilder().load(); print('loaded')"
# What a killed build leaves: torch's own baton, taken by the process that was building, never released.
KILLED_BUILD = "import sys; from torch.utils.file_baton import FileBaton; assert FileBaton(sys.argv[1]).try_acquire()"


@pytest.mark.timeout(300)
def test_a_lock_left_by_a_killed_build_is_removed(staging_op, tmp_path):
    from ds_pipemorph.staging.builder import StagingRingBuilder, extension_dir

    name = StagingRingBuilder().name
    built = extension_dir(name)  # the session's build, copied so that the test owns its cache
    root = tmp_path / "extensions"
    shutil.copytree(built, root / name, ignore=shutil.ignore_patterns("lock"))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root), "DS_ACCELERATOR": "cpu"}
    lock = root / name / "lock"
    subprocess.run([sys.executable, "-c", KILLED_BUILD, str(lock)], check=True, env=env, timeout=120)
    assert lock.exists()

    p = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, env=env, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "loaded" in p.stdout
    assert f"removing {lock}" in p.stderr and "interrupted" in p.stderr
    assert not lock.exists()
    assert (root / f"{name}.lock").exists()  # the advisory lock file stays; it holds no state
