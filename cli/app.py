"""Entry point of the ``pipemorph`` console script."""
from __future__ import annotations

import typer

from . import bench_cmd, demo_cmd, plan_cmd, profile_cmd, simulate_cmd, trace_cmd

app = typer.Typer(
    name="pipemorph",
    help="Plan, simulate and inspect straggler-resilient zero-bubble pipeline schedules.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("plan")(plan_cmd.plan)
app.command("simulate")(simulate_cmd.simulate)
app.command("demo")(demo_cmd.demo)
app.command("bench")(bench_cmd.bench)
app.command("profile-links")(profile_cmd.profile_links)
app.command("profile-stages")(profile_cmd.profile_stages)
app.add_typer(trace_cmd.app, name="trace")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
