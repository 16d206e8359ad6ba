"""A training script without an ``if __name__ == "__main__"`` guard is not run again inside the delegates:
the fork server's children are told of no main module (``supervision.main_module_hidden``); and they
start where the temporary folder is too long for a socket's path."""
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import os, sys
    with open(sys.argv[1], "a") as f:  # top-level code, run once per execution of this script
        f.write("ran\\n")
    from ds_pipemorph.runtime.transport.delegated.supervision import delegate_context, main_module_hidden
    from multiprocessing import spawn
    real = spawn.get_preparation_data
    ctx = delegate_context()
    with main_module_hidden():
        child = ctx.Process(target=os.getpid)
        child.start()
    child.join(120)
    assert child.exitcode == 0, child.exitcode
    assert sys.modules["__main__"].__file__ == __file__  # the script's own main module, untouched
    assert spawn.get_preparation_data is real  # and multiprocessing as it was, for the script's own workers
    from multiprocessing import util
    print(util.get_temp_dir())  # where multiprocessing made the fork server's socket
''')


def run_script(tmp_path, env=None) -> str:
    """SCRIPT as a training script, run once: what it printed (its marker must say it ran once)."""
    script, marker = tmp_path / "train.py", tmp_path / "runs.txt"
    script.write_text(SCRIPT)
    p = subprocess.run([sys.executable, str(script), str(marker)], capture_output=True, text=True, timeout=170,
                       cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert marker.read_text() == "ran\n"  # not again in the fork server's child
    return p.stdout


@pytest.mark.timeout(180)
def test_a_script_without_a_main_guard_runs_once_when_a_delegate_starts(tmp_path):
    run_script(tmp_path)


@pytest.mark.timeout(180)
def test_delegates_start_under_a_temporary_folder_too_long_for_a_socket_path(tmp_path):
    # A scheduler's job folder as TMPDIR: the fork server's socket, made in a folder of it, would
    # pass the 107 bytes of a socket's path. Multiprocessing's folder goes under /tmp instead, and
    # is removed when the process exits.
    long_tmp = tmp_path / ("job-" + "x" * 100)
    long_tmp.mkdir()
    folder = run_script(tmp_path, env={**os.environ, "TMPDIR": str(long_tmp)}).strip().splitlines()[-1]
    assert os.path.dirname(folder) == "/tmp" and os.path.basename(folder).startswith("pymp-")
    assert not os.path.exists(folder)
    assert list(long_tmp.iterdir()) == []
