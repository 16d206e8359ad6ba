"""No Typer command function is called as a Python function: its parameters' defaults are Typer
``OptionInfo`` objects, so a call that leaves one out passes the object on (``pipemorph demo`` once
failed so when ``bench`` gained an option). Command bodies live in plain functions (``run_bench``)."""
import ast
import importlib
from pathlib import Path

import typer

from ds_pipemorph_cli import app as app_module

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "ds_pipemorph_cli"
SEARCHED = ["cli", "ds_pipemorph", "benchmarks", "recipes", "scripts", "tests"]


def _callbacks(t: typer.Typer):
    for c in t.registered_commands:
        yield c.callback
    for g in t.registered_groups:
        yield from _callbacks(g.typer_instance)
    if t.registered_callback is not None:
        yield t.registered_callback.callback


def registered() -> set[tuple[str, str]]:
    """(module, function) of every command: COMMANDS, their sub-apps, and the root app's callback."""
    out = set()
    for module, attr in app_module.COMMANDS.values():
        target = getattr(importlib.import_module(f"{PACKAGE}.{module}"), attr)
        funcs = _callbacks(target) if isinstance(target, typer.Typer) else [target]
        out |= {(f.__module__, f.__name__) for f in funcs}
    out |= {(f.__module__, f.__name__) for f in _callbacks(app_module.app)}
    return out


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "cli":
        parts[0] = PACKAGE
    return ".".join(p for p in parts if p != "__init__")


def _absolute(module: str, level: int, here: str) -> str:
    if level == 0:
        return module or ""
    base = here.split(".")[:-level]
    return ".".join(base + ([module] if module else []))


def calls_of_commands(source: str, here: str, commands: set[tuple[str, str]]) -> list[str]:
    """``file:line name`` of every call in ``source`` (module ``here``) of a command function, by a
    name bound to it (defined here or imported) or as an attribute of its imported module."""
    tree = ast.parse(source)
    funcs: dict[str, str] = {}  # local name -> command module
    mods: dict[str, str] = {}  # local name -> imported module
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and (here, node.name) in commands:
            funcs[node.name] = here
        elif isinstance(node, ast.ImportFrom):
            src = _absolute(node.module or "", node.level, here)
            for a in node.names:
                if (src, a.name) in commands:
                    funcs[a.asname or a.name] = src
                mods[a.asname or a.name] = f"{src}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                mods[a.asname or a.name] = a.name
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in funcs:
            found.append(f"{here}:{node.lineno} {f.id}")
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (mods.get(f.value.id), f.attr) in commands:
            found.append(f"{here}:{node.lineno} {f.value.id}.{f.attr}")
    return found


def test_every_command_is_found():
    commands = registered()
    for name in ("plan", "simulate", "export", "place", "partition", "demo", "bench", "profile_links",
                 "profile_stages", "inspect", "compare", "pipemorph"):
        assert any(f == name for _, f in commands), name


def test_the_finder_sees_the_call_that_broke_demo():
    commands = {(f"{PACKAGE}.bench_cmd", "bench")}
    old_demo = "from .bench_cmd import bench\n\ndef demo(iterations=5):\n    bench(stages=4, iterations=iterations)\n"
    assert calls_of_commands(old_demo, f"{PACKAGE}.demo_cmd", commands) == [f"{PACKAGE}.demo_cmd:4 bench"]
    as_module = "from ds_pipemorph_cli import bench_cmd\nbench_cmd.bench()\n"
    assert calls_of_commands(as_module, "tests.x", commands) == ["tests.x:2 bench_cmd.bench"]
    # A method of the same name is no command.
    assert calls_of_commands("'a=b'.partition('=')\n", "tests.x", {(f"{PACKAGE}.partition_cmd", "partition")}) == []


def test_no_command_function_is_called_from_python_code():
    commands = registered()
    found = []
    for top in SEARCHED:
        for path in sorted((ROOT / top).rglob("*.py")):
            found += calls_of_commands(path.read_text(), _module_name(path), commands)
    assert found == [], "call the plain function the command calls instead: " + ", ".join(found)
