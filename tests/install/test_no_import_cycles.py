"""The ``ds_pipemorph`` package has no import cycles: imports point one way.

The graph is read from the source with ``ast``, not by importing anything: a node per module (a
package is its ``__init__``), an edge for every ``import``/``from ... import`` of another module of
the package, relative imports resolved against the importing module. Imports are counted at any
nesting level: inside functions, ``if TYPE_CHECKING:`` blocks and ``try:`` blocks alike, because a
function-local import is the usual way a cycle gets hidden (it only moves the failure from import
time to the first call). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module,
else to ``pkg`` itself; names outside the package are not followed. Importing ``a.b.c`` also runs
``a`` and ``a.b``, but those package edges are not counted: a package's ``__init__`` importing its
own submodules is how packages are built, and counting it would make every submodule that imports a
sibling through the package look cyclic.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "ds_pipemorph"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE


def modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` file of the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join([package, *parts])] = path
    return out


def _base(name: str, path: Path, level: int, module: str | None) -> str:
    """The absolute module a ``from`` import names (``level`` dots, then ``module``)."""
    if level == 0:
        return module or ""
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    pkg = pkg[: len(pkg) - (level - 1)]
    return ".".join(pkg + ([module] if module else []))


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` (source at ``path``) imports, at any depth."""
    out = set()

    def add(target: str) -> None:
        if target in known and target != name:  # else another package's module (or one that is gone)
            out.add(target)

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _base(name, path, node.level, node.module)
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                add(sub if sub in known else base)
    return out


def graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    mods = modules(root, package)
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def components(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative):
    the sets of modules that import each other, directly or through others."""
    index, low, on, stack, comps = {}, {}, set(), [], []
    counter = 0
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        comps.append(sorted(comp))
    return sorted(comps)


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per component (as a closed path ``a -> b -> a``): the shortest one through the
    component's first module."""
    return [_shortest_cycle(g, set(c), c[0]) for c in components(g)]


def _shortest_cycle(g: dict[str, set[str]], comp: set[str], start: str) -> list[str]:
    """The shortest path ``start -> ... -> start`` inside ``comp`` (breadth-first)."""
    prev = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(g[v] & comp):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is on no cycle")  # pragma: no cover


def test_the_package_has_no_import_cycles():
    g = graph()
    assert len(g) > 100, sorted(g)  # the walk found the package
    found = components(g)
    assert not found, "import cycles:\n" + "\n".join(
        f"{' -> '.join(_shortest_cycle(g, set(c), c[0]))}  (modules in the cycle: {', '.join(c)})" for c in found
    )


def test_the_checker_finds_a_cycle_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "a.py").write_text("from .sub.b import thing\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n    return g\nthing = 1\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from .sub import b\nfrom . import a\n")
    g = graph(pkg, "pkg")
    assert g["pkg.sub"] == {"pkg.sub.b"}
    assert g["pkg.a"] == {"pkg.sub.b"}
    assert g["pkg.sub.b"] == {"pkg.c"}
    assert g["pkg.c"] == {"pkg.a"}
    assert g["pkg.d"] == {"pkg.sub.b", "pkg.a"}
    assert components(g) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert cycles(g) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]


def test_the_checker_passes_a_one_way_graph(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import x\n")
    (pkg / "a.py").write_text("from .b import y as x\n")
    (pkg / "b.py").write_text("import os\ny = os.sep\n")
    (pkg / "c.py").write_text("import os.path\nfrom .gone import x\nfrom pkg import b\nfrom . import a as _a\n")
    g = graph(pkg, "pkg")
    assert g == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": set(), "pkg.c": {"pkg.a", "pkg.b"}}
    assert components(g) == [] and cycles(g) == []
