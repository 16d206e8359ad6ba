"""A job stops in seconds, says why in one line per rank at most, and leaves no process and no shared
memory behind, however it is stopped: SIGINT or SIGTERM to torchrun or to one rank, SIGKILL of one rank
(the others name it) or of torchrun (the ranks see their launcher gone). A plain training script
(tests/runtime/life_job.py, no helper calls) gets one sentence for a setting refused at start-up.

Each launch is a 3-stage job under torchrun whose links all go through delegates (staging rings in
/dev/shm, delegate processes); what each rank maps from /dev/shm while it trains is what must be gone.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds_pipemorph.procs import free_port, kill_group

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORLD = 3
STOP_S = 10.0  # every rank and delegate gone this long after the signal


class Job:
    def __init__(self, tmp: Path, mode: str = "delegated", steps: int = 100000, extra=(), monitor_s: float | None = None,
                 launcher: str = "torchrun"):
        self.dir, self.mode = tmp, mode
        self.log = open(tmp / "log.txt", "w+")
        # The interpreter's own teardown, as users' processes end (not the session's faster one).
        env = {**{k: v for k, v in os.environ.items() if k != "PIPEMORPH_TEST_GC_FREEZE"},
               "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        if launcher == "deepspeed":
            cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(WORLD), "--master_port",
                   str(free_port())]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}"]
        if monitor_s is not None:
            cmd.append(f"--monitor-interval={monitor_s}")
        cmd += [str(HERE / "life_job.py"), str(tmp), mode, str(steps), *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                     start_new_session=True)

    def training(self, timeout: float = 400.0) -> None:
        """Wait until every rank finished 2 steps; note its pids (rank + delegates) and its shared memory."""
        deadline = time.monotonic() + timeout
        while not all((self.dir / f"step1.rank{r}").exists() for r in range(WORLD)):
            assert self.proc.poll() is None, f"the job ended before training:\n{self.output()[-4000:]}"
            assert time.monotonic() < deadline, f"no training within {timeout} s:\n{self.output()[-4000:]}"
            time.sleep(0.5)
        self.pids = {r: [int(p) for p in (self.dir / f"rank{r}.pid").read_text().split()] for r in range(WORLD)}
        self.shm = set()
        for r in range(WORLD):
            for line in Path(f"/proc/{self.pids[r][0]}/maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    self.shm.add(line.rsplit(None, 1)[-1])
        if self.mode == "delegated":
            assert any("/pm_" in f for f in self.shm), self.shm  # staging rings exist
        self.torchrun_children = _children(self.proc.pid)

    def ended_within(self, seconds: float) -> float:
        t0 = time.monotonic()
        try:
            self.proc.wait(timeout=seconds + 30)
        except subprocess.TimeoutExpired:
            kill_group(self.proc)
            pytest.fail(f"torchrun still ran {seconds + 30:g} s after the signal:\n{self.output()[-4000:]}")
        return time.monotonic() - t0

    def wait_gone(self, seconds: float) -> list[int]:
        """The ranks' and delegates' pids still running ``seconds`` from now (polled)."""
        every = [p for ps in self.pids.values() for p in ps]
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            alive = [p for p in every if _running(p)]
            if not alive:
                return []
            time.sleep(0.1)
        return [p for p in every if _running(p)]

    def left_in_shm(self) -> list[str]:
        time.sleep(0.5)  # a reaper removes its process's names a moment after the process ended
        return sorted(f for f in self.shm if os.path.exists(f))

    def output(self) -> str:
        self.log.flush()
        return (self.dir / "log.txt").read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            kill_group(self.proc)
        for ps in getattr(self, "pids", {}).values():
            for p in ps:
                if _running(p):
                    os.kill(p, signal.SIGKILL)
        self.log.close()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _rank_tracebacks(text: str) -> list[str]:
    """The exception lines of the tracebacks in ``text`` but the launchers' own (torchrun raises one
    when a rank exits non-zero or it got a signal; DeepSpeed's runner shows its KeyboardInterrupt)."""
    lines, found = text.splitlines(), []
    for i, line in enumerate(lines):
        if line.endswith("Traceback (most recent call last):"):
            j = i + 1
            while j < len(lines) and (lines[j].startswith(" ") or lines[j].endswith("Traceback (most recent call last):")
                                      or not lines[j].strip()):
                j += 1
            block = "\n".join(lines[i:j + 1])
            launcher = ("torch.distributed.elastic" in block or "torch/distributed/run.py" in block
                        or "deepspeed/launcher/" in block)
            if not launcher:
                found.append(lines[j] if j < len(lines) else "")
    return found


def _our_lines(text: str) -> list[str]:
    """The lines the ranks printed about stopping (torchrun's own log lines excluded)."""
    return [line for line in text.splitlines() if re.match(r"^(\[default\d\]:)?(rank \d+: |error: )", line)]


@pytest.fixture
def job(tmp_path):
    jobs = []

    def make(*a, **kw):
        d = tmp_path / f"job{len(jobs)}"
        d.mkdir()
        jobs.append(Job(d, *a, **kw))
        return jobs[-1]

    yield make
    for j in jobs:
        j.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_to_torchrun_or_to_one_rank_stops_every_rank_and_delegate_in_seconds_leaving_nothing(job, sig):
    signum = getattr(signal, sig)
    for target in ("torchrun", "rank 1"):
        j = job()
        j.training()
        os.kill(j.proc.pid if target == "torchrun" else j.pids[1][0], signum)
        took = j.ended_within(STOP_S)
        out = j.output()
        assert j.wait_gone(2.0) == [], (target, out[-3000:])
        assert took < STOP_S, (target, took, out[-3000:])
        assert j.proc.returncode != 0, (target, out[-3000:])
        assert _rank_tracebacks(out) == [] and "forcefully" not in out.lower(), (target, out[-5000:])
        lines = _our_lines(out)
        assert 1 <= len(lines) <= WORLD, (target, lines)
        assert any(f"stopped by {sig}" in line for line in lines), (target, lines)
        assert j.left_in_shm() == [], (target, out[-3000:])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_under_the_deepspeed_launcher_stops_every_rank_without_tracebacks_or_leftovers(job):
    """A Ctrl-C in the terminal: SIGINT to the whole foreground process group (launcher, ranks, their
    fork servers and delegates); the launcher then sends SIGTERM to each rank's process tree and
    SIGKILL a few seconds later. DeepSpeed's all-reduce buffers (66 MB each) must go with the rings."""
    j = job(launcher="deepspeed")
    j.training()
    assert any("deepspeed_allreduce_buffer" in f for f in j.shm), j.shm
    os.killpg(j.proc.pid, signal.SIGINT)
    j.ended_within(STOP_S)
    out = j.output()
    assert j.wait_gone(2.0) == [], out[-3000:]
    assert j.proc.returncode != 0
    assert _rank_tracebacks(out) == [], out[-5000:]
    lines = _our_lines(out)
    assert 1 <= len(lines) <= WORLD and all("stopped by SIG" in line for line in lines), lines
    assert j.left_in_shm() == [], out[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_of_a_rank_is_named_by_the_others_and_sigkill_of_torchrun_stops_the_ranks_leaving_nothing(job):
    # torchrun looks at its workers every 60 s here: the ranks, not the launcher, must notice the death.
    j = job(monitor_s=60)
    j.training()
    dead = j.pids[1][0]
    os.kill(dead, signal.SIGKILL)
    assert j.wait_gone(STOP_S) == [], j.output()[-3000:]
    j.proc.send_signal(signal.SIGTERM)  # torchrun itself would notice only at its next look
    j.ended_within(STOP_S)
    lines = _our_lines(j.output())
    died = [line for line in lines if "died" in line]
    assert len(died) == 1 and f"rank 1 (stage 1, pid {dead} on " in died[0], lines
    assert _rank_tracebacks(j.output()) == [], j.output()[-5000:]
    assert j.left_in_shm() == [], j.output()[-3000:]
    # Nothing failed over: no link was taken for a broken one.
    assert "direct path failed" not in j.output() and "restarted it as generation" not in j.output()

    j = job()
    j.training()
    os.kill(j.proc.pid, signal.SIGKILL)
    assert j.wait_gone(STOP_S) == [], j.output()[-3000:]
    lines = _our_lines(j.output())
    assert any("its launcher" in line and "is gone" in line for line in lines), lines
    assert len(lines) <= WORLD, lines
    assert j.left_in_shm() == [], j.output()[-3000:]


@pytest.mark.timeout(600)
def test_a_plain_script_that_returns_exits_in_order_leaving_nothing(job):
    """No helper call at the end: the package stops its workers and releases the process groups at
    exit, before Python tears down (a gloo thread alive then can abort the process)."""
    j = job(steps=3)
    j.proc.wait(timeout=500)
    out = j.output()
    assert j.proc.returncode == 0, out[-3000:]
    assert [(j.dir / f"exit.rank{r}").read_text() for r in range(WORLD)] == ["released"] * WORLD
    assert "terminate called" not in out and _rank_tracebacks(out) == [], out[-3000:]
    j.pids = {r: [int(p) for p in (j.dir / f"rank{r}.pid").read_text().split()] for r in range(WORLD)}
    assert all(len(ps) > 1 for ps in j.pids.values()), j.pids  # delegates ran
    assert j.wait_gone(STOP_S) == [], out[-3000:]
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(tuple(f"pm_{ps[0]}_" for ps in j.pids.values()))]


@pytest.mark.timeout(600)
def test_a_refused_setting_is_one_sentence_at_start_up_before_any_rank_trains(job):
    cases = {"timeline=/proc/no_such_dir/timeline.json":
             "error: pipemorph.timeline: cannot write '/proc/no_such_dir/timeline.json': no file can be created in",
             "no_such_key=1": "error: ds_config pipemorph: unknown key 'no_such_key'"}
    for extra, sentence in cases.items():
        j = job(mode="direct", steps=3, extra=[extra])
        j.proc.wait(timeout=500)
        out = j.output()
        assert j.proc.returncode != 0
        assert _rank_tracebacks(out) == [], out[-5000:]
        errors = [line for line in _our_lines(out) if "error:" in line]
        assert len(errors) == 1 and errors[0].startswith(sentence), out[-3000:]
        assert "exitcode  : 2" in out  # every rank exited 2
        assert not list(j.dir.glob("step*")), "a rank trained"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stopped_rank_is_not_taken_for_a_dead_one_and_the_timeout_it_causes_is_one_sentence(job):
    """SIGSTOP (rank 1 stops itself between two steps): the rank is alive (its kernel answers) but makes
    no progress, as on a host starved of CPU for good. Nobody calls it dead; a neighbour times out after
    timeout_s (5 s) with one sentence, the job stops, and the stopped rank, once continued, stops too
    without a line."""
    j = job(mode="direct", extra=["timeout_s=5", "job.sigstop_rank=1", "job.sigstop_step=3"])
    j.training()
    stopped = j.pids[1][0]
    deadline = time.monotonic() + 120
    while Path(f"/proc/{stopped}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "rank 1 never stopped itself"
        time.sleep(0.05)
    t0 = time.monotonic()
    try:
        others = [j.pids[r][0] for r in (0, 2)]
        deadline = time.monotonic() + 60
        while any(_running(p) for p in others) and time.monotonic() < deadline:
            time.sleep(0.2)
        took = time.monotonic() - t0
    finally:
        os.kill(stopped, signal.SIGCONT)
    assert not any(_running(p) for p in others), j.output()[-3000:]
    assert took < 5 + STOP_S, took
    assert j.wait_gone(STOP_S) == [], j.output()[-3000:]
    j.ended_within(STOP_S)
    out = j.output()
    lines = _our_lines(out)
    assert len(lines) == 1 and lines[0].startswith("error: rank ") and "timed out after 5 s" in lines[0], lines
    assert "died" not in out
    assert _rank_tracebacks(out) == [], out[-5000:]
