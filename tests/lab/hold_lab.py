"""Build a 2-node lab with a shaped pair and a process running in node 1, print the lab id and that
process's pid, then wait (the test kills this process) or, with the ``fail`` argument, fail once a line arrives on stdin."""
import signal
import sys
import time

from ds_pipemorph.lab import Lab

# Ctrl-C raises KeyboardInterrupt here even when the runner hands down SIGINT ignored (a background
# job of a shell without job control does): the test is of what a Ctrl-C does, not of the runner.
signal.signal(signal.SIGINT, signal.default_int_handler)

with Lab(nodes=2) as lab:
    lab.shape(0, 1, "10mbit", both=True)
    job = lab.popen(1, ["sleep", "600"])
    print(lab.lab_id, job.pid, flush=True)
    if sys.argv[1:] == ["fail"]:
        sys.stdin.readline()
        raise SystemExit("the job failed")
    time.sleep(600)
