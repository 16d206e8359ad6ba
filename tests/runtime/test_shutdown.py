"""``exit_process``: the atexit handlers run, the output is flushed, the process groups are released
(their gloo threads joined) and the process exits with the code given."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from ds_pipemorph.procs import free_port

# The interpreter's own teardown, as users' processes end (not the test session's faster one).
USERS_EXIT = {k: v for k, v in os.environ.items() if k != "PIPEMORPH_TEST_GC_FREEZE"}

SCRIPT = textwrap.dedent("""
    import atexit, os, sys, torch, torch.distributed as dist
    from ds_pipemorph.runtime.shutdown import release_process_groups, exit_process

    def gloo_threads():
        return sum(open(f"/proc/self/task/{t}/comm").read().startswith("pt_gloo") for t in os.listdir("/proc/self/task"))

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    group = dist.new_group([0])
    t = torch.ones(1000)
    dist.all_reduce(t, group=group)
    del group
    before = gloo_threads()
    atexit.register(lambda: print("atexit ran", flush=True))
    release_process_groups()
    print(f"gloo threads {before} -> {gloo_threads()}", end="", flush=True)  # no newline: flushed by exit_process
    sys.stdout.write("; unflushed tail")
    exit_process(3)
""")


@pytest.mark.timeout(120)
def test_exit_process_runs_atexit_flushes_joins_gloo_threads_and_exits_with_the_code(tmp_path):
    port = free_port()
    script = tmp_path / "end.py"
    script.write_text(SCRIPT.replace("{port}", str(port)))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100,
                       env={**USERS_EXIT, "DS_ACCELERATOR": "cpu"})
    assert p.returncode == 3, p.stderr[-3000:]
    assert "terminate called" not in p.stderr
    counts, rest = p.stdout.split(";", 1)
    before, after = (int(x) for x in counts.removeprefix("gloo threads ").split(" -> "))
    assert before > 0 and after == 0  # the threads of both groups are gone before the exit
    assert rest == " unflushed tailatexit ran\n"  # the buffered tail flushed, then the atexit handler's line


C_OUTPUT = textwrap.dedent("""
    import ctypes
    from ds_pipemorph.runtime.shutdown import exit_process

    libc = ctypes.CDLL(None)
    libc.printf(b"from C, no newline")  # stdout is a file: the C library buffers this
    exit_process(0)
""")


@pytest.mark.timeout(120)
def test_exit_process_flushes_what_c_code_printed_to_a_file(tmp_path):
    script, out = tmp_path / "c_out.py", tmp_path / "stdout.txt"
    script.write_text(C_OUTPUT)
    # PYTHONUNBUFFERED would make the C library's stdout unbuffered too: the child runs without it.
    env = {k: v for k, v in USERS_EXIT.items() if k != "PYTHONUNBUFFERED"} | {"DS_ACCELERATOR": "cpu"}
    with open(out, "w") as f:
        p = subprocess.run([sys.executable, str(script)], stdout=f, stderr=subprocess.PIPE, text=True, timeout=100,
                           env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert out.read_text() == "from C, no newline"
