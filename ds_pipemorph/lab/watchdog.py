"""The lab's watchdog: a process in its own session that waits for the lab to close a pipe, then
removes every namespace of the lab. The lab process holds the only write end, so the pipe closes
however it ends (return, exception, Ctrl-C, ``kill -9``); a lab that cleaned up itself writes
``done`` first and the watchdog only exits.

    python -m ds_pipemorph.lab.watchdog PREFIX     (stdin: the pipe)
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

DONE = b"done"


def start(prefix: str) -> subprocess.Popen:
    """Start the watchdog of the lab whose namespaces begin with ``prefix``; keep its stdin open."""
    return subprocess.Popen([sys.executable, "-m", "ds_pipemorph.lab.watchdog", prefix],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def main(prefix: str) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # outlive a Ctrl-C sent to the whole foreground group
    data = b""
    while True:
        chunk = os.read(0, 64)
        if not chunk:
            break
        data += chunk
    if DONE not in data:
        from ds_pipemorph.lab.topology import teardown

        teardown(prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
