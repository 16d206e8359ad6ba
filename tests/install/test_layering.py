"""The runtime never imports the injection plug-in: ``ds_pipemorph.inject`` plugs into the runtime's
hooks (``runtime.hooks``) and imports the runtime, never the other way round. The planner's
subpackages import only those below them (``PLAN_LAYERS``, docs/design.md).

Read from the source with ``ast`` (nothing is imported), at any nesting level: a function-local
import, or one under ``if TYPE_CHECKING:``, counts as much as a top-level one. Relative imports are
resolved against the importing module. (``plan`` and ``control`` importing no torch is checked by
tests/plan/test_plan_torch_free.py and tests/control/test_torch_free.py.)
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "ds_pipemorph" / "runtime"
FORBIDDEN = "ds_pipemorph.inject"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of everything ``path`` imports; ``from a import b`` gives ``a.b``."""
    name = module_name(path, root)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] + ([node.module] if node.module else [])
                base_name = ".".join(base)
            else:
                base_name = node.module or ""
            out += [(node.lineno, f"{base_name}.{alias.name}") for alias in node.names]
    return out


def offending(directory: Path, forbidden: str, root: Path = ROOT) -> list[str]:
    """``file:line imports name`` for every import under ``directory`` of ``forbidden`` or its submodules."""
    found = []
    for path in sorted(directory.rglob("*.py")):
        for line, target in imported(path, root):
            if target == forbidden or target.startswith(forbidden + "."):
                found.append(f"{path.relative_to(root)}:{line} imports {target}")
    return found


def test_no_runtime_module_imports_the_injection_plugin():
    modules = sorted(RUNTIME.rglob("*.py"))
    assert len(modules) > 40 and RUNTIME / "engine.py" in modules  # the walk found the runtime
    found = offending(RUNTIME, FORBIDDEN)
    assert not found, "the runtime must not import the injection plug-in (use runtime.hooks):\n" + "\n".join(found)


def test_the_checker_finds_absolute_relative_and_function_local_imports(tmp_path):
    runtime = tmp_path / "ds_pipemorph" / "runtime"
    (runtime / "transport").mkdir(parents=True)
    (tmp_path / "ds_pipemorph" / "__init__.py").write_text("")
    (runtime / "__init__.py").write_text("")
    (runtime / "clean.py").write_text("from . import hooks\nfrom ..plan.ir import ops\n"
                                      "import ds_pipemorph.injection_free\n")
    (runtime / "a.py").write_text("import ds_pipemorph.inject.delays\n")
    (runtime / "b.py").write_text("def f():\n    from ..inject import plugin\n    return plugin\n")
    (runtime / "transport" / "__init__.py").write_text("")
    (runtime / "transport" / "c.py").write_text("from ...inject.faults import FaultyLink\n")
    (runtime / "transport" / "d.py").write_text("from ... import inject\n")
    found = offending(runtime, FORBIDDEN, tmp_path)
    assert found == [
        "ds_pipemorph/runtime/a.py:1 imports ds_pipemorph.inject.delays",
        "ds_pipemorph/runtime/b.py:2 imports ds_pipemorph.inject.plugin",
        "ds_pipemorph/runtime/transport/c.py:1 imports ds_pipemorph.inject.faults.FaultyLink",
        "ds_pipemorph/runtime/transport/d.py:1 imports ds_pipemorph.inject",
    ]


PLAN = ROOT / "ds_pipemorph" / "plan"
PLAN_LAYERS = ["ir", "sim", "files", "sched", "partition", "place"]  # each imports only those before it


def test_plan_subpackages_import_only_the_ones_below_them():
    assert sorted(p.name for p in PLAN.iterdir() if (p / "__init__.py").is_file()) == sorted(PLAN_LAYERS)
    found = []
    for layer, sub in enumerate(PLAN_LAYERS):
        for path in sorted((PLAN / sub).rglob("*.py")):
            for line, target in imported(path):
                parts = target.split(".")
                if parts[:2] != ["ds_pipemorph", "plan"] or len(parts) < 3 or parts[2] not in PLAN_LAYERS:
                    continue
                if PLAN_LAYERS.index(parts[2]) > layer:
                    found.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not found, "a plan subpackage imports one above it:\n" + "\n".join(found)
