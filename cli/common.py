"""What every command shares: one-sentence errors with exit code 2, list options, outputs checked
before work starts and written atomically, each announced as ``wrote PATH``, and one line and exit
code 130 (143 for SIGTERM) for a command that runs ranks and is stopped (``stopped_by_signal``)."""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Iterator, Optional

import typer
from rich.console import Console

from ds_pipemorph.fileio import BadInput, check_writable, write_atomic

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn bad input into one sentence on stderr and exit code 2."""
    try:
        yield
    except (BadInput, ValueError, ImportError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        err_console.print(f"error: {msg}", markup=False, soft_wrap=True)  # one line, however long
        raise typer.Exit(2) from None


@contextlib.contextmanager
def stopped_by_signal(command: str, *temporary: Path,
                      done: str = "its ranks were stopped and its temporary files removed") -> Iterator[None]:
    """Ctrl-C or SIGTERM while ``command`` runs its ranks: the launcher code stops them on the way out
    (``procs.stop_group``), then ``temporary`` folders are removed, one line says so, and the command
    exits 128 + the signal's number (130 for Ctrl-C)."""
    got: list[int] = []

    def on_term(signum, frame):
        got.append(signum)
        raise KeyboardInterrupt

    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, on_term) if main else None
    try:
        yield
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the clean-up below is not cut short by a second one
        for d in temporary:
            shutil.rmtree(d, ignore_errors=True)
        num = got[0] if got else signal.SIGINT
        err_console.print(f"{command}: stopped by {signal.Signals(num).name}; {done}", markup=False, soft_wrap=True)
        raise typer.Exit(128 + num) from None
    finally:
        if main:
            signal.signal(signal.SIGTERM, old)


def parse_floats(text: Optional[str], what: str) -> Optional[list[float]]:
    if text is None:
        return None
    try:
        vals = [float(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise BadInput(f"{what}: '{text}' is not a comma-separated list of numbers") from None
    for v in vals:
        if v < 0:
            raise BadInput(f"{what}: {v} is negative; times and delays are >= 0 ms")
        if not math.isfinite(v):
            raise BadInput(f"{what}: {v} is not a finite number")
    return vals


def parse_compute(text: Optional[str], stages: int) -> Optional[tuple[list[float], list[float], list[float]]]:
    """``F/B/W`` for every stage, or one ``F/B/W`` per stage separated by commas."""
    if text is None:
        return None
    triples = []
    for part in text.split(","):
        try:
            t = [float(x) for x in part.split("/")]
        except ValueError:
            t = []
        if len(t) != 3 or not all(0 <= v < math.inf for v in t):
            raise BadInput(f"--compute-ms: '{part}' is not F/B/W in ms (three finite numbers >= 0, e.g. 10/10/10)")
        triples.append(t)
    if len(triples) == 1:
        triples = triples * stages
    if len(triples) != stages:
        raise BadInput(f"--compute-ms: expected 1 or {stages} F/B/W triples (one per stage), got {len(triples)}")
    return [t[0] for t in triples], [t[1] for t in triples], [t[2] for t in triples]


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def check_outputs(paths: dict[str, "Path | str | None"], pictures: Optional[dict[str, "Path | str | None"]] = None) -> None:
    """Refuse, before any long work, outputs that cannot be written: ``paths`` maps each option to
    its path (None: not given); ``pictures`` are Gantt pictures, whose suffix must also name a
    format matplotlib writes. Two options naming one file are refused too."""
    given = {opt: p for opt, p in {**paths, **(pictures or {})}.items() if p is not None}
    seen: dict[str, str] = {}
    for opt, p in given.items():
        check_writable(p, opt)
        key = os.path.realpath(p)
        if key in seen:
            raise BadInput(f"{seen[key]} and {opt} both name '{p}'; give each output its own file")
        seen[key] = opt
    for opt, p in (pictures or {}).items():
        if p is not None:
            from ds_pipemorph.trace.gantt import image_format

            image_format(p, opt)


def announce(paths, to_stderr: bool = False) -> None:
    """``wrote PATH`` for each file written (on stderr when stdout carries JSON)."""
    for path in paths:
        (err_console if to_stderr else console).print(f"wrote {path}", markup=False, soft_wrap=True)


def write_outputs(outputs: dict[str, "str | bytes"]) -> None:
    """Write every output only after all of them were computed (no partial results on errors); the
    command says ``announce(outputs)`` once it has printed its results."""
    for path, data in outputs.items():
        write_atomic(path, data)


def timeline_outputs(tl, gantt: Optional[str], chrome: Optional[str], title: str, links_ms=None) -> dict:
    out: dict = {}
    if gantt:
        from ds_pipemorph.trace.gantt import gantt_image, image_format

        out[gantt] = gantt_image(tl, title, links_ms, image_format(gantt))
    if chrome:
        from ds_pipemorph.trace.chrome import chrome_json

        out[chrome] = chrome_json(tl, title)
    return out
