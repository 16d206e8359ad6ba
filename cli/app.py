"""Entry point of the ``pipemorph`` console script.

Each command lives in its own module, imported only when that command runs (or when ``--help``
lists the commands): ``pipemorph plan`` loads the planner and nothing of the benchmark, trace or
profiling tools, and no command module imports torch or deepspeed at import time.
"""
from __future__ import annotations

import atexit
import importlib
import os
import sys
from difflib import get_close_matches
from typing import Optional

import typer
from typer.core import TyperGroup
from typer.main import get_command

# Command name -> (module in this package, attribute): a command function, or a Typer app of subcommands.
COMMANDS = {
    "plan": ("plan_cmd", "plan"),
    "simulate": ("simulate_cmd", "simulate"),
    "export": ("export_cmd", "export"),
    "demo": ("demo_cmd", "demo"),
    "bench": ("bench_cmd", "bench"),
    "profile-links": ("profile_cmd", "profile_links"),
    "profile-stages": ("profile_cmd", "profile_stages"),
    "trace": ("trace_cmd", "app"),
}


# Commands that read and write files only (outputs are written atomically and synced before the
# command returns). Run from the console script, their process ends without the interpreter's
# final teardown of every module and object: ~70 ms of a ~0.5 s planning call.
FILE_ONLY = {"plan", "simulate", "export", "trace"}
_exit_code: Optional[int] = None


def _end_process() -> None:
    """Registered before any other exit handler, so it runs after all of them (atexit is LIFO)."""
    if _exit_code is None:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if "logging" in sys.modules:
        sys.modules["logging"].shutdown()
    os._exit(_exit_code)


atexit.register(_end_process)


class LazyCommands(TyperGroup):
    """A command group that imports a command's module on first use (click's lazy-loading pattern)."""

    def list_commands(self, ctx) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx, cmd_name: str):
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module, attr = COMMANDS[cmd_name]
            target = getattr(importlib.import_module(f".{module}", __package__), attr)
            if not isinstance(target, typer.Typer):
                single = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
                single.command(cmd_name)(target)
                target = single
            cmd = get_command(target)
            cmd.name = cmd_name
            self.commands[cmd_name] = cmd
        return self.commands.get(cmd_name)

    def resolve_command(self, ctx, args: list[str]):
        # Typer suggests names among loaded commands only; suggest among all of them.
        if args and args[0] not in COMMANDS and not args[0].startswith("-") and not ctx.resilient_parsing:
            matches = get_close_matches(args[0], list(COMMANDS))
            hint = f" Did you mean {', '.join(repr(m) for m in matches)}?" if matches else ""
            ctx.fail(f"No such command {args[0]!r}.{hint}")
        return super().resolve_command(ctx, args)


app = typer.Typer(
    name="pipemorph",
    cls=LazyCommands,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def pipemorph() -> None:
    """Plan, simulate and inspect straggler-resilient zero-bubble pipeline schedules."""


def main(args: Optional[list[str]] = None) -> None:
    """The console script (``args`` None: the command line) or a call with explicit arguments."""
    global _exit_code
    argv = sys.argv[1:] if args is None else args
    fast = args is None and (not argv or argv[0] in FILE_ONLY or argv[0] in ("--help", "-h"))
    try:
        app(args)
    except SystemExit as e:
        if fast:
            _exit_code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise


if __name__ == "__main__":
    main()
