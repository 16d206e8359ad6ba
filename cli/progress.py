"""Progress shown while a command works: a bar that fills with the time a budgeted search may take.

Rich draws it only on a terminal (elsewhere a transient bar prints nothing); forcing a terminal,
e.g. ``TTY_COMPATIBLE=1``, shows it in captured output too.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Iterator

from .common import console

if TYPE_CHECKING:
    from rich.progress import Progress

# A search given less time than this ends before a bar would tell anything.
LONG_S = 2.0


def bar() -> "Progress":
    """The progress display every command uses: description, bar, k/n, elapsed time (rich.progress is
    imported here, when a command shows progress: planning commands start faster without it)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f}"),
                    TimeElapsedColumn(), console=console, transient=True, refresh_per_second=4)


@contextlib.contextmanager
def budget_bar(what: str, seconds: float) -> Iterator[None]:
    """While the block runs: ``what`` with a bar filling over ``seconds`` (shown for long budgets only)."""
    if seconds < LONG_S:
        yield
        return
    stop = threading.Event()
    with bar() as progress:
        task = progress.add_task(f"{what} (budget {seconds:g} s)", total=seconds)
        t0 = time.monotonic()

        def tick() -> None:
            while not stop.wait(0.25):
                progress.update(task, completed=min(seconds, time.monotonic() - t0))

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()
