"""Every command README.md shows in a ```bash block or in the "command" column of its Measured table
is exercised: run here, or by a named test, or (a benchmark too long for the suite) checked option by
option against its ``--help``.

``REGISTRY`` maps each command (as written, comments dropped, ``&&`` chains split) to how it is
exercised: ``Here`` runs it in this file against real files; ``Node`` names the test that runs it
(or, for GPU-only launches, its CPU equivalent); ``Options`` checks that every ``--option`` it uses is
in the help of the script or ``pipemorph`` command it runs. A README command missing from the registry
fails.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


@dataclass(frozen=True)
class Here:
    """Run in this file (``test_readme_commands_run_here``), from a scratch copy of what it reads."""
    why: str


@dataclass(frozen=True)
class Node:
    """Exercised by these tests (``path::function``); a GPU-only command by its CPU equivalent."""
    nodes: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class Options:
    """A benchmark too long for the suite: every ``--option`` of the command must be in the ``--help``
    of the script or ``pipemorph`` command it runs (``test_measured_commands_use_only_accepted_options``)."""
    why: str


RUNS = "tests/docs/test_readme_runs.py"
REGISTRY: dict[str, Here | Node | Options] = {
    "bash scripts/setup.sh": Node((
        "tests/docs/test_setup_sh.py::test_dry_run_prints_the_pip_commands_of_each_setting",
        "tests/docs/test_setup_sh.py::test_without_dry_run_the_same_commands_run_from_the_repository_root"),
        "the commands it runs, recorded without reinstalling torch"),
    "PIPEMORPH_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh": Here("dry run"),
    "PIPEMORPH_SKIP_TORCH=1 bash scripts/setup.sh": Here("dry run"),
    "pipemorph demo": Node(("tests/bench/test_demo_end_to_end.py::test_short_demo_shows_progress_prints_the_table_and_writes_results",),
                           "the same demo with two measured iterations per schedule"),
    "pipemorph demo --budget 2": Options("the demo again, with twice stock's activation memory"),
    "DS_ACCELERATOR=cpu python benchmarks/engine/memory_budget.py": Options("six engines on the GPT recipe, minutes"),
    "DS_ACCELERATOR=cpu python benchmarks/engine/rank_memory.py": Node(
        ("tests/bench/test_rank_memory_bench.py::test_both_dispatches_with_the_default_settings_hold_no_more_than_stock_per_rank",),
        "four of its rows (stock, adaptive with its defaults and under ready dispatch, adaptive without the send "
        "window) with 8 MiB activations"),
    "python -m pytest": Node(("tests/docs/test_readme_commands.py::test_every_readme_command_is_in_the_registry",),
                             "the suite itself, of which this file is part"),
    "DS_ACCELERATOR=cpu deepspeed --num_gpus 4 recipes/gpt/train.py --steps 300": Node(
        (f"{RUNS}::test_gpt_recipe_trains_under_the_deepspeed_launcher_on_four_cpu_ranks",), "20 steps instead of 300"),
    "pipemorph plan recipes/profiles/paper_fig4.yaml -o plan.yaml": Here("writes a plan"),
    "pipemorph simulate plan.yaml --links-ms 20,0,0": Here("replays that plan under 20 ms on link 0"),
    "deepspeed --hostfile hostfile recipes/tiny_gpt/train.py --config recipes/gpu_cluster/ds_config.json": Node(
        (f"{RUNS}::test_gpu_cluster_config_trains_under_the_deepspeed_launcher_on_cpu",),
        "GPU only; the CPU equivalent: `--num_gpus 4` on this host (a hostfile needs ssh), gloo, same config"),
    "torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint node-a:29500 "
    "recipes/tiny_gpt/train.py --config recipes/gpu_cluster/ds_config.json": Node(
        (f"{RUNS}::test_gpu_cluster_config_trains_under_torchrun_c10d_rendezvous_on_cpu",),
        "GPU only; the CPU equivalent: one node of 4 ranks through the same c10d rendezvous, gloo, same config"),
    "bash scripts/gpu_check.sh": Node(
        ("tests/scripts/test_gpu_check.py::test_without_cuda_it_says_so_in_one_line_and_exits_0_writing_nothing",),
        "GPU only; here its no-CUDA exit (the report writer is tested in the same file)"),
    "pipemorph --version": Here("prints the package version"),
    # The Measured table's commands: benchmarks of minutes to an hour on this machine.
    "python benchmarks/planner/planner_vs_milp.py --seed S --cases 30": Options("30 MILP solves per seed"),
    "pipemorph paired zb stock-1f1b --pairs 8 --warmup 2 --job-iterations 5 --timeout-s 3600": Options(
        "16 whole jobs of 4 ranks"),
    "DS_ACCELERATOR=cpu python benchmarks/engine/engine_zb_vs_1f1b.py": Options("dozens of 4-rank iterations per runner"),
    "DS_ACCELERATOR=cpu python benchmarks/engine/ready_dispatch.py --workloads heavy,none": Options(
        "one job switching dispatch every iteration per workload"),
    "DS_ACCELERATOR=cpu python benchmarks/engine/real_compute_ab.py --stock-pairs 8": Options(
        "eight training jobs of 44 iterations and 32 whole jobs; tests/bench/test_real_compute_ab_bench.py runs a short form "
        "and one cycle of whole jobs"),
    "DS_ACCELERATOR=cpu python benchmarks/engine/varlen_real.py": Options(
        "twelve jobs of two engines, 6 of them on 4 ranks; tests/bench/test_varlen_real_bench.py runs a short form"),
    "DS_ACCELERATOR=cpu python benchmarks/engine/split_backward.py": Options(
        "15 pairs per row; tests/runtime/test_recompute.py runs its recomputation and split in small"),
    "DS_ACCELERATOR=cpu python benchmarks/engine/ready_vs_stock.py": Options(
        "four sittings, each one `pipemorph bench` job of both engines (its stock rows under --vary are "
        "tests/bench/test_bench_cli.py's)"),
    "DS_ACCELERATOR=cpu python benchmarks/engine/varlen_real.py --ranks 2 --sittings 3": Options(
        "eighteen jobs of two engines; tests/bench/test_varlen_real_bench.py runs a short form"),
    "DS_ACCELERATOR=cpu python benchmarks/engine/ready_vs_stock.py --workload plain-sleep": Node(
        ("tests/bench/test_ready_vs_stock_bench.py::test_ready_vs_stock_plain_sleep_runs_short_and_gives_both_engines_with_their_replays",),
        "one sitting of two iterations"),
    # The lab's rows (root, network namespaces): short runs of the same scripts are tests.
    "python benchmarks/lab/lab_profile_links.py": Options("all pairs of 4 lab nodes at three sizes"),
    "DS_ACCELERATOR=cpu python benchmarks/lab/lab_slow_link.py": Node(
        ("tests/lab/test_lab_slow_link.py::test_pipemorph_reads_a_real_slow_link_re_plans_for_it_and_pays_less_for_it_"
         "than_stock",), "3 measured iterations per row instead of 8"),
    "DS_ACCELERATOR=cpu python benchmarks/lab/lab_rate_trace.py": Options("120 iterations over a two-minute rate trace"),
    "DS_ACCELERATOR=cpu python benchmarks/lab/lab_failover.py --case two": Node(
        ("tests/lab/test_lab_failover.py::test_primary_interface_down_with_two_networks_moves_the_delegates_to_eth1_"
         "and_trains_as_fault_free",), "the same jobs (run_two)"),
    "DS_ACCELERATOR=cpu python benchmarks/lab/lab_failover.py --case one": Node(
        ("tests/lab/test_lab_failover.py::test_interface_down_with_one_network_ends_the_job_with_an_error_naming_the_link",),
        "the same job (run_one)"),
    "DS_ACCELERATOR=cpu python benchmarks/lab/lab_orchestrator.py": Node(
        ("tests/lab/test_lab_orchestrator.py::test_engine_moves_a_measured_slow_data_parallel_link_into_the_pipeline_"
         "and_trains_unchanged",), "a shorter run of the same job"),
    "DS_ACCELERATOR=cpu python benchmarks/control/real_straggler.py": Node(
        ("tests/runtime/test_real_straggler.py::test_burners_on_stage_1s_core_make_the_loop_move_layers_away_and_"
         "training_is_unchanged",), "a short version: 4 burners, 4 micro-batches, 10 iterations"),
    "DS_ACCELERATOR=cpu python benchmarks/lab/lab_slow_link.py --model gpt": Node(
        ("tests/lab/test_lab_slow_link.py::test_gpt_blocks_on_two_nodes_train_the_same_under_every_engine_and_leave_"
         "no_namespace",), "the same rows, fewer iterations"),
    "DS_ACCELERATOR=cpu python benchmarks/control/real_straggler.py --model gpt --rows uniform,rebalance,rebalance-profiled,"
    "best-static": Options("four rows of 24 iterations; the next command's test runs --model gpt"),
    "DS_ACCELERATOR=cpu python benchmarks/control/real_straggler.py --model gpt --burn-from 0 --rows uniform,rebalance,"
    "rebalance-profiled,best-static": Node(
        ("tests/runtime/test_real_straggler.py::test_gpt_blocks_with_burners_from_the_start_report_the_loops_"
         "prediction_and_train_the_same",), "two of the rows, fewer iterations"),
    "DS_ACCELERATOR=cpu python benchmarks/control/rebalance.py --models emulated --slow-from 0 --settle 5": Options(
        "a one-job comparison and six whole runs of 4 ranks"),
    "DS_ACCELERATOR=cpu pipemorph bench --stages 4 --microbatches 4 --op-ms 5 --delays-ms 0 --schedules pipemorph "
    "--iterations 60 --warmup 4": Options("one 4-rank job of 64 iterations"),
    "DS_ACCELERATOR=cpu python benchmarks/transport/startup_cost.py": Node(
        ("tests/bench/test_startup_cost_bench.py::test_startup_benchmark_times_both_jobs_and_the_slow_link_switch",),
        "one round of 16 iterations"),
    "python benchmarks/planner/cli_startup.py --runs 9": Options("starts the CLI and torch dozens of times"),
}


def readme_commands(text: str) -> list[str]:
    """Each command of the ```bash blocks, in order: comments dropped, continuations joined, && split."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                out.append(" ".join(words[:cut]))
                words = words[cut + 1:]
    return out


def measured_commands(text: str) -> list[str]:
    """The first `code` span of each row's "command" cell in the tables under ``## Measured``."""
    section = text.split("\n## Measured\n", 1)[1].split("\n## ", 1)[0]
    out = []
    for table in re.findall(r"(?:^\| .*\n?)+", section, re.M):
        rows = [line.split(" | ") for line in table.splitlines()]
        col = [c.strip(" |") for c in rows[0]].index("command")
        out += [re.search(r"`([^`]+)`", cells[col]).group(1) for cells in rows[2:]]
    return out


COMMANDS = readme_commands(README.read_text())
MEASURED = measured_commands(README.read_text())


def test_every_readme_command_is_in_the_registry():
    assert COMMANDS, "README.md shows no ```bash block"
    missing = [c for c in COMMANDS if c not in REGISTRY]
    assert not missing, f"README.md shows commands no test exercises; add them to REGISTRY: {missing}"


def test_every_measured_command_is_in_the_registry():
    assert len(MEASURED) >= 5, f"the Measured table's command column was not found: {MEASURED}"
    missing = [c for c in MEASURED if c not in REGISTRY]
    assert not missing, f"README.md's Measured table shows commands no test checks; add them to REGISTRY: {missing}"


def test_the_measured_table_extraction_reads_the_command_column():
    text = ("x\n## Measured\n\n| what | command | result |\n| --- | --- | --- |\n"
            "| a `x` row | `tool --a 1` (S = 0) | `not this` |\n| b | `other` | 2 |\n\n## Next\n| x | `no` |\n")
    assert measured_commands(text) == ["tool --a 1", "other"]


def _help(words: list[str], env: dict[str, str]) -> str:
    """The ``--help`` text of the script or ``pipemorph`` command that ``words`` run."""
    if words[0] == "pipemorph":
        from typer.testing import CliRunner
        from ds_pipemorph_cli.app import app

        r = CliRunner().invoke(app, [words[1], "--help"], env={"COLUMNS": "200"}, terminal_width=200)
        assert r.exit_code == 0, r.output
        return r.output
    assert words[0] == "python" and words[1].endswith(".py"), f"no help reader for `{' '.join(words)}`"
    r = subprocess.run([sys.executable, words[1], "--help"], cwd=ROOT, env={**os.environ, **env, "COLUMNS": "200"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", sorted(c for c, how in REGISTRY.items() if isinstance(how, Options)))
def test_measured_commands_use_only_accepted_options(command):
    words = shlex.split(command)
    env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=.*", w))
    words = words[len(env):]
    used = {w.split("=", 1)[0] for w in words if w.startswith("--")}
    offered = set(re.findall(r"--[a-z][a-z0-9-]*", _help(words, env)))
    assert used - offered == set(), f"`{command}` uses options its --help does not list: {sorted(used - offered)}"


def test_the_readme_shows_few_commands():
    assert len(set(COMMANDS)) <= 15


def test_the_extraction_reads_comments_chains_and_continuations():
    text = "x\n```bash\na --b 1 && c   # why\nd \\\n  e\n```\n```python\nnot_a_command()\n```\n"
    assert readme_commands(text) == ["a --b 1", "c", "d e"]


def _defined_tests(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("command", sorted({c for c in COMMANDS if isinstance(REGISTRY.get(c), Node)}))
def test_the_tests_named_for_a_command_exist(command):
    for node in REGISTRY[command].nodes:
        path, _, name = node.partition("::")
        assert name in _defined_tests(ROOT / path), f"{node} (named for `{command}`) does not exist"


def _run(command: str, cwd: Path, **env) -> subprocess.CompletedProcess:
    words = shlex.split(command)
    assigns = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=.*", w))
    argv = [w for w in words if w.split("=", 1)[0] not in assigns]
    if argv[:2] == ["bash", "scripts/setup.sh"]:
        argv[1] = str(ROOT / argv[1])
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PIPEMORPH_")}
    return subprocess.run(argv, cwd=cwd, env={**full_env, **assigns, **env}, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.timeout(600)
def test_readme_commands_run_here(tmp_path):
    """The README's commands marked ``Here``, in README order, in a scratch copy of the files they read."""
    shutil.copytree(ROOT / "recipes" / "profiles", tmp_path / "recipes" / "profiles")
    here = [c for c in dict.fromkeys(COMMANDS) if isinstance(REGISTRY.get(c), Here)]
    assert here
    for command in here:
        if "scripts/setup.sh" in command:
            r = _run(command, tmp_path, PIPEMORPH_DRY_RUN="1")  # prints the pip commands, installs nothing
        else:
            r = _run(command, tmp_path)
        assert r.returncode == 0, f"`{command}`: {r.stderr}"
        check(command, r.stdout, tmp_path)


def check(command: str, stdout: str, cwd: Path) -> None:
    """What each command must have done, from sources other than the code that did it."""
    if command.startswith("PIPEMORPH_TORCH_INDEX_URL="):
        torch_line = shlex.split(stdout.splitlines()[0])
        assert torch_line[-3:] == ["--index-url", "https://download.pytorch.org/whl/cpu", "torch==2.13.0"]
    elif command.startswith("PIPEMORPH_SKIP_TORCH=1"):
        assert not any(w.startswith("torch") for line in stdout.splitlines() for w in shlex.split(line))
        assert "-e" in stdout
    elif command.startswith("pipemorph plan"):
        import yaml

        plan = yaml.safe_load((cwd / "plan.yaml").read_text())
        assert plan["stages"] == 4 and plan["microbatches"] == 12
        for ops in plan["schedule"]:  # every F, B, W of every micro-batch exactly once per stage
            assert sorted(ops) == sorted(f"{k}{m}" for k in "FBW" for m in range(12))
        # PipeMorph Fig. 4: 4 stages x 12 micro-batches of 10 ms ops plan to 390 ms with warm-up 7, 5, 3, 1.
        assert plan["warmup"] == [7, 5, 3, 1] and plan["predicted"]["iteration_ms"] == pytest.approx(390.0)
    elif command.startswith("pipemorph simulate"):
        # PipeMorph Fig. 5: the same fixed plan with 20 ms on link 0 takes 440 ms (README's comment says so).
        row = next(line for line in stdout.splitlines() if re.search(r"\bplan\b", line) and "│" in line)
        assert "440.0" in row
        assert "440 ms" in next(line for line in README.read_text().splitlines() if command in line)
    elif command == "pipemorph --version":
        from importlib.metadata import version

        assert stdout.split() == ["pipemorph", version("ds_pipemorph")]
    else:
        raise AssertionError(f"no check written for `{command}`")


def test_the_cli_table_lists_every_command():
    from ds_pipemorph_cli.app import COMMANDS as CLI

    table = README.read_text().split("## The CLI", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"\| `pipemorph ([a-z-]+)", table)) | set(re.findall(r", `([a-z-]+)(?: [a-z]+)?`", table))
    assert set(CLI) <= listed, f"README's CLI table lacks {sorted(set(CLI) - listed)}"


def test_the_config_in_the_readme_is_accepted():
    from ds_pipemorph.runtime.config import parse_config

    section = re.search(r'```json\n"pipemorph": (\{.*?\})\n```', README.read_text(), re.S).group(1)
    cfg = parse_config(json.loads(section))
    assert cfg.schedule == "adaptive" and cfg.memory.units(4) == [8.0, 6.0, 4.0, 2.0]  # twice stock's S - s
