"""The re-plan worker process (``control.background``): reads ``(number, policy, costs)`` frames on
stdin, answers each with ``(number, "ok", policy.refine(costs), seconds)`` on stdout, ends at the
end of stdin.

It imports the planner only (no torch), runs at the lowest scheduling priority so the training
processes keep their cores, and turns any failure of a job into an ``("error", sentence)`` answer.
"""
from __future__ import annotations

import os
import sys
import time

from .background import read_frame, write_frame


def main() -> None:
    try:
        os.nice(19)  # training first: the search only uses what the ranks leave idle
    except OSError:
        pass
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on the answer pipe
    while True:
        job = read_frame(stdin)
        if job is None:
            return
        number, policy, costs = job
        t = time.perf_counter()
        try:
            answer = (number, "ok", policy.refine(costs), time.perf_counter() - t)
        except Exception as e:  # noqa: BLE001 - the caller decides what a failed search means
            answer = (number, "error", f"the re-plan search failed: {type(e).__name__}: {e}")
        write_frame(stdout, answer)


if __name__ == "__main__":
    main()
