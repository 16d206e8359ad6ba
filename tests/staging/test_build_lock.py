"""A build of the staging op interrupted by a kill leaves torch's build lock behind; the next job must
load the op instead of waiting for that lock forever, but must not take the lock from a build that is
still running: one of ours (it holds the guard) or the ninja/compilers a killed job left working in the
build directory (``staging.builder.build_guard``)."""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

LOAD = "from ds_pipemorph.staging.builder import StagingRingBuilder; StagingRingBuilder().load(); print('loaded')"
# What a killed build leaves: torch's own baton, taken by the process that was building, never released.
KILLED_BUILD = "import sys; from torch.utils.file_baton import FileBaton; assert FileBaton(sys.argv[1]).try_acquire()"
# A build of ours in progress: holds the guard and torch's baton until a line arrives on stdin.
BUILDING = """
import sys
from torch.utils.file_baton import FileBaton
from ds_pipemorph.staging.builder import StagingRingBuilder, build_guard, extension_dir
name = StagingRingBuilder().name
with build_guard(name):
    baton = FileBaton(str(extension_dir(name) / "lock"))
    assert baton.try_acquire()
    print("holding", flush=True)
    sys.stdin.readline()
    baton.release()
"""


def _copied(name: str, tmp_path):
    """The session's build of op ``name`` copied into a cache of the test's own, without a lock;
    (that cache's root, the environment of a process that uses it)."""
    from ds_pipemorph.staging.builder import extension_dir

    root = tmp_path / "extensions"
    shutil.copytree(extension_dir(name), root / name, ignore=shutil.ignore_patterns("lock"))
    return root, {**os.environ, "TORCH_EXTENSIONS_DIR": str(root), "DS_ACCELERATOR": "cpu"}


def _own_cache(tmp_path):
    """The session's build of the staging op copied into a cache of the test's own; (name, root, env)."""
    from ds_pipemorph.staging.builder import StagingRingBuilder

    name = StagingRingBuilder().name
    return (name, *_copied(name, tmp_path))


def _until(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _still_waiting_after(warning: str, err_path, loading, lock) -> None:
    """``loading`` logs ``warning`` (naming what it waits for), and a few re-checks later it still
    waits, the lock untouched."""
    _until(lambda: warning in err_path.read_text(), 120, f"the warning {warning!r}")
    time.sleep(2.5)  # more than one re-check
    assert loading.poll() is None and lock.exists()


def _loaded_after_one(warning: str, err_path, loading) -> str:
    """``loading`` ends and loads the op, having logged ``warning`` once however long it waited; its stderr."""
    out, _ = loading.communicate(timeout=120)
    err = err_path.read_text()
    assert loading.returncode == 0, err[-2000:]
    assert "loaded" in out
    assert err.count(warning) == 1
    return err


def _waits_on_flock(pid: int, path) -> bool:
    """True when ``pid`` is blocked in flock on ``path`` (a '->' line of /proc/locks on its inode)."""
    ino = os.stat(path).st_ino
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            if "->" in fields and fields[fields.index("->") + 1] == "FLOCK":
                rest = fields[fields.index("->") + 1:]
                if rest[3] == str(pid) and rest[4].rsplit(":", 1)[-1] == str(ino):
                    return True
    return False


def _stop(*procs):
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(timeout=10)


@pytest.mark.timeout(300)
def test_a_lock_left_by_a_killed_build_is_removed(staging_op, tmp_path):
    name, root, env = _own_cache(tmp_path)
    lock = root / name / "lock"
    subprocess.run([sys.executable, "-c", KILLED_BUILD, str(lock)], check=True, env=env, timeout=120)
    assert lock.exists()

    p = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, env=env, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "loaded" in p.stdout
    assert f"removing {lock}" in p.stderr and "interrupted" in p.stderr
    assert not lock.exists()
    assert (root / f"{name}.lock").exists()  # the advisory lock file stays; it holds no state


@pytest.mark.timeout(300)
def test_a_build_holding_the_guard_keeps_its_lock_and_the_next_job_waits(staging_op, tmp_path):
    name, root, env = _own_cache(tmp_path)
    lock, guard = root / name / "lock", root / f"{name}.lock"
    building = loading = None
    try:
        building = subprocess.Popen([sys.executable, "-c", BUILDING], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, env=env)
        assert building.stdout.readline().strip() == "holding"  # bounded by the test's timeout
        assert lock.exists()

        loading = subprocess.Popen([sys.executable, "-c", LOAD], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=env)
        _until(lambda: _waits_on_flock(loading.pid, guard), 120, "the second job to wait on the guard")
        time.sleep(0.5)
        assert loading.poll() is None and lock.exists()  # waiting, the running build's lock untouched

        building.stdin.write("go\n")
        building.stdin.flush()
        assert building.wait(timeout=30) == 0
        out, err = loading.communicate(timeout=120)
        assert loading.returncode == 0, err[-2000:]
        assert "loaded" in out
        assert "removing" not in err  # torch's lock was released by its owner, not taken from it
        assert not lock.exists()
    finally:
        _stop(building, loading)


@pytest.mark.timeout(300)
def test_a_process_left_working_in_the_build_directory_keeps_the_lock_until_it_is_gone(staging_op, tmp_path):
    name, root, env = _own_cache(tmp_path)
    lock = root / name / "lock"
    subprocess.run([sys.executable, "-c", KILLED_BUILD, str(lock)], check=True, env=env, timeout=120)
    stderr_path = tmp_path / "load.err"
    survivor = loading = bystander = None
    try:
        # What a SIGKILLed job leaves running: ninja (and its compilers) in the build directory. A
        # process named ninja stands for it (the guard tells build tools by their name); a plain one
        # there, a shell say, holds nothing back.
        ninja = tmp_path / "bin" / "ninja"
        ninja.parent.mkdir()
        shutil.copy(shutil.which("sleep"), ninja)
        survivor = subprocess.Popen([str(ninja), "120"], cwd=root / name)
        bystander = subprocess.Popen(["sleep", "120"], cwd=root / name)
        with open(stderr_path, "w") as err_file:
            loading = subprocess.Popen([sys.executable, "-c", LOAD], stdout=subprocess.PIPE, stderr=err_file,
                                       text=True, env=env)
        _still_waiting_after(f"process(es) {survivor.pid} still work in", stderr_path, loading, lock)

        survivor.send_signal(signal.SIGKILL)
        survivor.wait(timeout=10)
        err = _loaded_after_one("still work in", stderr_path, loading)
        assert f"removing {lock}" in err
        assert not lock.exists()
        assert bystander.poll() is None and str(bystander.pid) not in err  # still there, never waited for
    finally:
        _stop(survivor, loading, bystander)


def test_an_op_already_loaded_needs_no_guard(staging_op, tmp_path, monkeypatch):
    from ds_pipemorph.staging.builder import StagingRingBuilder, build_guard

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    with build_guard(StagingRingBuilder().name):
        pass
    assert not (tmp_path / "extensions").exists()  # no cache directory, no guard file made for nothing


# DeepSpeed's own ops as its code loads them (its engine's FusedAdam, init_distributed's CPU collectives
# op), after what ``initialize`` runs first.
DEEPSPEED_LOADS = {
    "FusedAdamBuilder": """
from types import SimpleNamespace
import torch
from ds_pipemorph.staging.builder import prepare_adam_op
prepare_adam_op(SimpleNamespace(optimizer_name="adam", optimizer_params={}), None)
from deepspeed.ops.adam import FusedAdam
FusedAdam([torch.nn.Parameter(torch.zeros(4))])
print("loaded")
""",
    "ShareMemCommBuilder": """
from ds_pipemorph.staging.builder import prepare_comm_op
prepare_comm_op()
from deepspeed.comm.torch import build_shm_op
assert build_shm_op() is not None
print("loaded")
""",
}
# A load that does not take our guard, as stock DeepSpeed's: torch's baton held until a line arrives on stdin.
UNGUARDED = """
import sys
from torch.utils.file_baton import FileBaton
baton = FileBaton(sys.argv[1])
assert baton.try_acquire()
print("holding", flush=True)
sys.stdin.readline()
baton.release()
"""


def _deepspeed_op(kind: str, tmp_path):
    """DeepSpeed's op ``kind`` built in the session's cache (loaded under the guard, as every job of
    the session loads it), copied into a cache of the test's own; (name, its build directory, env)."""
    from deepspeed.accelerator import get_accelerator

    from ds_pipemorph.staging.builder import load_guarded

    builder = get_accelerator().create_op_builder(kind)
    load_guarded(builder, kind)
    root, env = _copied(builder.name, tmp_path)
    return builder.name, root / builder.name, env


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", list(DEEPSPEED_LOADS))
def test_a_lock_left_in_deepspeeds_own_op_build_is_removed_before_deepspeed_loads_it(kind, tmp_path):
    """DeepSpeed builds these ops inside its own code, where no guard of ours runs: a job killed during
    that build left torch's lock, and every later job waited for it without a word. ``initialize`` (and
    the recipes and bench workers, before ``init_distributed``) load them first, under the guard."""
    name, ext, env = _deepspeed_op(kind, tmp_path)
    lock = ext / "lock"
    subprocess.run([sys.executable, "-c", KILLED_BUILD, str(lock)], check=True, env=env, timeout=120)

    p = subprocess.run([sys.executable, "-c", DEEPSPEED_LOADS[kind]], capture_output=True, text=True, env=env,
                       timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "loaded" in p.stdout
    assert f"removing {lock}" in p.stderr and "interrupted" in p.stderr
    assert not lock.exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("holder_ends", ["released", "killed"])
def test_a_lock_held_by_a_load_that_takes_no_guard_is_waited_for_until_released_or_its_holder_dies(
        holder_ends, tmp_path):
    """Stock DeepSpeed loads its ops without our guard, and torch takes the lock even to load a build
    that is there: while such a process holds it, before any build tool runs, the lock is live and the
    guarded load waits. Released, torch takes it from there; its holder killed, the lock is stale."""
    name, ext, env = _deepspeed_op("FusedAdamBuilder", tmp_path)
    lock = ext / "lock"
    err_path = tmp_path / "load.err"
    holder = loading = None
    try:
        holder = subprocess.Popen([sys.executable, "-c", UNGUARDED, str(lock)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)
        assert holder.stdout.readline().strip() == "holding"  # bounded by the test's timeout
        with open(err_path, "w") as err_file:
            loading = subprocess.Popen([sys.executable, "-c", DEEPSPEED_LOADS["FusedAdamBuilder"]],
                                       stdout=subprocess.PIPE, stderr=err_file, text=True, env=env)
        _still_waiting_after(f"is held by process(es) {holder.pid}", err_path, loading, lock)

        if holder_ends == "released":
            holder.stdin.write("go\n")
            holder.stdin.flush()
            assert holder.wait(timeout=30) == 0  # its release found its lock: no one took it
        else:
            holder.send_signal(signal.SIGKILL)
            holder.wait(timeout=10)
        err = _loaded_after_one("is held by", err_path, loading)
        assert ("removing" in err) == (holder_ends == "killed")
    finally:
        _stop(holder, loading)


@pytest.mark.timeout(420)
def test_a_training_job_started_after_a_killed_adam_build_runs(tmp_path):
    """The same through ``initialize``: the tiny GPT recipe (an "Adam" section) on 2 ranks, its cache
    holding the lock a killed FusedAdam build left: the job trains instead of waiting forever."""
    from ds_pipemorph.procs import torchrun

    name, ext, env = _deepspeed_op("FusedAdamBuilder", tmp_path)
    root = ext.parent
    session = Path(os.environ["TORCH_EXTENSIONS_DIR"])  # the other ops the job loads, built already
    for other in session.iterdir():
        if other.is_dir() and other.name != name:
            shutil.copytree(other, root / other.name, ignore=shutil.ignore_patterns("lock"))
    lock = ext / "lock"
    subprocess.run([sys.executable, "-c", KILLED_BUILD, str(lock)], check=True, env=env, timeout=120)

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny_gpt" / "train.py"
    cmd = torchrun(tmp_path / "torchrun", "--standalone", "--nproc_per_node=2", str(recipe), "--stages", "2",
                   "--steps", "2")
    p = subprocess.run(cmd, capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=360)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert f"removing {lock}" in out
    assert not lock.exists()


@pytest.mark.parametrize("offload, expected", [(None, "FusedAdamBuilder"), ("cpu", "CPUAdamBuilder"),
                                                 ("nvme", "CPUAdamBuilder"), ("none", "FusedAdamBuilder")])
def test_the_adam_op_guarded_is_the_one_deepspeeds_engine_loads(offload, expected, monkeypatch):
    """FusedAdam, or CPU Adam where ZeRO offloads the optimizer to the CPU or NVMe (the op DeepSpeed's
    DeepSpeedCPUAdam loads); nothing for a torch Adam or an optimizer object of the user's."""
    from types import SimpleNamespace

    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    from ds_pipemorph.staging import builder as b

    loaded = []
    monkeypatch.setattr(b, "load_guarded", lambda builder, what: loaded.append(builder.name) or False)
    zero = SimpleNamespace(offload_optimizer=None if offload is None else
                           SimpleNamespace(device=OffloadDeviceEnum(offload)))
    adam = SimpleNamespace(optimizer_name="adamw", optimizer_params={}, zero_config=zero)
    b.prepare_adam_op(adam, None)
    assert loaded == [get_accelerator().create_op_builder(expected).name]
    loaded.clear()
    b.prepare_adam_op(SimpleNamespace(optimizer_name="adam", optimizer_params={"torch_adam": True},
                                      zero_config=zero), None)
    b.prepare_adam_op(adam, client_optimizer=object())
    assert loaded == []
