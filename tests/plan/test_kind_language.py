"""Kinds are ``Kind`` members in the package's code, never text: no comparison of a kind with a
string (``op.kind == "F"``, ``k != "B"``, ``kind in ("F", "B")``), no kind built or taken apart as
text (``"RECV_" + op.kind``, ``f"SEND_{kind}{mb}"``, ``op.kind[-1]``, ``kind.startswith("SEND")``)
and no op made from a kind's text (``Op("W", m)``): ``Kind.F.send``, ``Kind.RECV_B.payload``,
``Kind.is_send``, ``message_op`` and ``parse_op`` / ``str(op)`` say it once (``plan/ir/ops.py``).
Files and the wire keep the text: a ``Kind`` equals and prints as its text.

Read from the source with ``ast`` (nothing is imported). A comparison counts when one side is a
kind's text and the other names a kind: an attribute or variable called ``kind`` (or ``*_kind``,
``k``, ``k2``, ``ka``, ``kb``), possibly through ``.value`` -- so ``sides[i] == "B"`` (an A/B side)
or ``action == "B"`` (torch's action text) are not kinds and pass.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ds_pipemorph"
KIND_TEXTS = {"F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"}
KIND_NAME = re.compile(r"^(kind|\w+_kind|k|k\d|ka|kb)$")
COMM_PREFIX = re.compile(r"^(SEND|RECV)_?$")


def _names_a_kind(node: ast.AST) -> bool:
    """``op.kind``, ``kind``, ``k2``, ``send.kind.value``, ``op.kind[0]`` ... (not ``kinds`` or ``op``)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)) and (
            isinstance(node, ast.Subscript) or node.attr == "value"):
        node = node.value
    if isinstance(node, ast.Attribute):
        return bool(KIND_NAME.match(node.attr))
    return isinstance(node, ast.Name) and bool(KIND_NAME.match(node.id))


def _kind_texts(node: ast.AST) -> bool:
    """A kind's text, or a tuple/list/set of them (the right side of ``in``)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in KIND_TEXTS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_kind_texts(e) for e in node.elts)
    return False


def _comm_text(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and bool(COMM_PREFIX.match(node.value))


def offences(source: str, filename: str = "<source>") -> list[str]:
    """``line: what`` for every use of a kind as text in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for a, b in zip(sides, sides[1:]):
                if (_kind_texts(a) and _names_a_kind(b)) or (_kind_texts(b) and _names_a_kind(a)):
                    out.append(f"{line}: a kind compared with its text ({ast.unparse(node)})")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("startswith", "endswith") \
                and any(_comm_text(a) or (_kind_texts(a) and _names_a_kind(node.func.value)) for a in node.args):
            out.append(f"{line}: a kind's text tested ({ast.unparse(node)}): use Kind.is_send / is_recv")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and (_comm_text(node.left) or _comm_text(node.right)):
            out.append(f"{line}: a kind built from text ({ast.unparse(node)}): use Kind.send / recv")
        elif isinstance(node, ast.JoinedStr) and _fstring_builds_a_kind(node):
            out.append(f"{line}: a kind built in an f-string ({ast.unparse(node)}): use message_op or str(Op(...))")
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, (ast.Constant, ast.UnaryOp, ast.Slice)) \
                and _names_a_kind(node.value) and not isinstance(node.ctx, ast.Store):
            out.append(f"{line}: a kind sliced as text ({ast.unparse(node)}): use Kind.payload")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Op" \
                and node.args and _kind_texts(node.args[0]):
            out.append(f"{line}: an op made from a kind's text ({ast.unparse(node)}): use Kind members")
    return out


def _fstring_builds_a_kind(node: ast.JoinedStr) -> bool:
    """``f"RECV_{kind}{mb}"`` or ``f"{'SEND' if sending else 'RECV'}_{kind}"``."""
    parts = node.values
    for i, part in enumerate(parts):
        nxt = parts[i + 1] if i + 1 < len(parts) else None
        if isinstance(part, ast.Constant) and re.search(r"(^|[^A-Za-z])(SEND|RECV)_$", part.value) \
                and isinstance(nxt, ast.FormattedValue):
            return True
        if isinstance(part, ast.FormattedValue) and any(_comm_text(c) for c in ast.walk(part.value)) \
                and isinstance(nxt, ast.Constant) and nxt.value.startswith("_"):
            return True
    return False


def package_offences() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        out += [f"{rel}:{o}" for o in offences(path.read_text(), str(path))]
    return out


def test_the_package_compares_and_builds_kinds_as_kind_members_never_as_text():
    found = package_offences()
    assert not found, "kinds used as text:\n" + "\n".join(found)


@pytest.mark.parametrize("code", [
    'if op.kind == "F": pass',
    'x = k != "B"',
    'x = "W" == kind',
    'x = send.kind.value == "SEND_F"',
    'x = op.kind in ("F", "B")',
    'x = op.kind.startswith("SEND")',
    'x = kind.endswith("RECV")',
    'x = op.kind.startswith("B")',
    'x = "RECV_" + op.kind',
    'x = Op("SEND_" + recv.kind[-1], recv.mb)',
    'x = op.kind[-1]',
    'x = f"RECV_{kind}{mb}"',
    'x = f"{verb}_{kind}" if 0 else f"{\'SEND\' if sending else \'RECV\'}_{kind}{mb}"',
    'x = Op("W", m)',
])
def test_each_form_of_a_kind_as_text_is_caught(code):
    assert offences(code), code


@pytest.mark.parametrize("code", [
    'if op.kind is Kind.F: pass',
    'x = k == Kind.B',
    'x = sides[i] == "B"',  # an A/B side, not a kind
    'x = action == "B"',  # torch's action text
    'x = len(kinds) == 3',
    'x = Op(Kind.RECV_F, m)',
    'x = op.kind.is_send',
    'x = f"{op.kind}{op.mb}"',
    'x = dur[op.kind]',
    'x = f"stage{s}/F{m}"',
    'x = name.startswith("stage")',
    'x = kind.startswith("torch_")',  # a kind of something else
])
def test_kinds_used_as_kinds_and_other_text_pass(code):
    assert not offences(code), offences(code)
