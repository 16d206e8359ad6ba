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
    "place": ("place_cmd", "place"),
    "partition": ("partition_cmd", "partition"),
    "demo": ("demo_cmd", "demo"),
    "bench": ("bench_cmd", "bench"),
    "profile-links": ("profile_cmd", "profile_links"),
    "profile-stages": ("profile_cmd", "profile_stages"),
    "trace": ("trace_cmd", "app"),
    "lab": ("lab_cmd", "app"),
    "paired": ("paired_cmd", "paired"),
}


# Commands that read and write files only (outputs are written atomically and synced before the
# command returns). From the console script their process ends, once every exit handler has run,
# without the interpreter's final teardown of every module and object: ~70 ms of a planning call.
FILE_ONLY = {"plan", "simulate", "export", "trace", "place", "partition"}


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


def _version(value: bool) -> None:
    if value:
        from ds_pipemorph.version import __version__

        print(f"pipemorph {__version__}")
        raise typer.Exit()


@app.callback()
def pipemorph(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version of ds_pipemorph and exit."),
) -> None:
    """Plan, simulate and inspect straggler-resilient zero-bubble pipeline schedules."""


def main(args: Optional[list[str]] = None) -> None:
    """Run the CLI on ``args`` (the command line when None), as any Typer app: ends in SystemExit."""
    app(args)


def console_main() -> None:
    """The ``pipemorph`` console script: ``main`` on the command line; a file-only command then ends
    the process with its exit code after the exit handlers ran (``FILE_ONLY``)."""
    argv = sys.argv[1:]
    try:
        app()
    except SystemExit as e:
        if argv and argv[0] not in FILE_ONLY and argv[0] not in ("--help", "-h"):
            raise
        code = e.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        atexit._run_exitfuncs()  # what the interpreter would run first at exit
        os._exit(code or 0)


if __name__ == "__main__":
    console_main()
