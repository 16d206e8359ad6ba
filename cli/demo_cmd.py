"""``pipemorph demo``: the main demonstration, ``pipemorph bench`` with the paper's Fig. 5 setting."""
from __future__ import annotations

from pathlib import Path

import typer

from .bench_cmd import BUDGET_HELP, BenchArgs, run_bench


def demo(
    delay_ms: float = typer.Option(20.0, min=0.0, help="Injected delay on link 0 (PipeMorph Fig. 5 uses 20 ms)."),
    iterations: int = typer.Option(5, min=1, help="Measured iterations per schedule."),
    warmup: int = typer.Option(4, min=0, help="Unmeasured iterations per schedule first (PipeMorph measures the "
                                              "slow link and re-plans in them)."),
    budget: str = typer.Option("1", "--budget", help=BUDGET_HELP),
    out: Path = typer.Option(Path("out/demo.json"), "--out", help="Results as JSON."),
) -> None:
    """4 stages x 12 micro-batches, 10 ms ops: stock DeepSpeed 1F1B vs static zb vs PipeMorph, with
    no delay and with a slow link 0, on the real engines (about two minutes on 2 cores)."""
    run_bench(demo_args(delay_ms, iterations, warmup, out, budget))


def demo_args(delay_ms: float, iterations: int, warmup: int, out: Path, budget: str = "1") -> BenchArgs:
    """The demonstration as a benchmark run."""
    return BenchArgs(stages=4, microbatches=12, op_ms=10.0, delays_ms=f"0,{delay_ms:g}", link=(0,),
                     iterations=iterations, warmup=warmup, schedules="stock-1f1b,zb,pipemorph", budget=budget,
                     out=out, command="pipemorph demo")
