"""Reading YAML/JSON files into pydantic models with one-sentence errors; atomic writes."""
from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)
# libyaml's C loader and emitter when PyYAML was built with it (several times faster), else PyYAML's own.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Dumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):
    """Safe YAML; a ``str`` subclass (a text enum such as ``plan.ir.ops.Kind``) is written as its text."""


_Dumper.add_multi_representer(str, lambda dumper, text: dumper.represent_str(str.__str__(text)))


class BadInput(ValueError):
    """User input that cannot be used; the message is one sentence naming what to fix."""


def load_mapping(path: str | os.PathLike) -> dict:
    p = Path(path)
    if p.is_dir():
        raise BadInput(f"{p} is a directory; give the YAML or JSON file in it")
    if not p.is_file():
        raise BadInput(f"{p}: no such file")
    try:
        data = yaml.load(p.read_text(), Loader=_Loader)  # noqa: S506 - a safe loader
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise BadInput(f"{p}: not valid YAML or JSON ({first_line(e)})") from None
    if not isinstance(data, dict):
        raise BadInput(f"{p}: expected a mapping of keys at the top level")
    return data


def load_model(path: str | os.PathLike, model: type[M]) -> M:
    return validate_model(path, load_mapping(path), model)


def validate_model(path: str | os.PathLike, data: dict, model: type[M]) -> M:
    """``data`` (read from ``path``) as ``model``; BadInput naming the file and the first wrong key."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise BadInput(f"{path}: {describe(e)}") from None


# What pydantic puts in an error's location for the member of a Union it tried ("int",
# "list[int]", "function-after[...]"): not a key of the file.
_UNION_MEMBER = re.compile(r"^(int|float|str|bool|none|list|dict|tuple|[a-z-]+\[.*\])$")


def _keys(err) -> tuple:
    return tuple(x for x in err.get("loc", ()) if not (isinstance(x, str) and _UNION_MEMBER.match(x)))


# pydantic's error types for a value of the wrong type (strict models: no conversion was tried; the
# others: it failed), and the type the key takes, in the words of a YAML or JSON file.
_EXPECTED = {"int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
             "float_type": "a number", "float_parsing": "a number",
             "bool_type": "a boolean (true or false)", "bool_parsing": "a boolean (true or false)",
             "string_type": "a string", "list_type": "a list", "dict_type": "a mapping",
             "model_type": "a mapping of keys", "model_attributes_type": "a mapping of keys"}


# pydantic's error types for a value of the right type that is not allowed (a choice not among the
# key's, a number out of its range): its message names what is allowed, ``given`` adds what was given.
_NAMES_THE_VALUE = frozenset({"literal_error", "enum", "greater_than", "greater_than_equal", "less_than",
                              "less_than_equal", "multiple_of"})


def given(value) -> str:
    """A value as an error names it, in the words of YAML and JSON: ``the string '7'``,
    ``the boolean true``, ``null``, ``a list`` (long strings shortened)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {'true' if value else 'false'}"
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {(value if len(value) <= 40 else value[:37] + '...')!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"  # from Python callers: a tuple, a PosixPath, ...


def describe(e: ValidationError) -> str:
    """The first pydantic error as 'key.path: what is wrong' (the path of keys only; of a value
    that may take several forms, the error deepest inside it: ``[1, "x"]`` is wrong at item 1).
    A value of the wrong type is named with the type the key takes: ``memory.max_inflight: expected
    an integer, got the string '7'``; a value not allowed, with what was given: ``backward: Input
    should be 'split' or 'fused', got the string 'whole'``."""
    errors = e.errors()
    first = _keys(errors[0])
    err = max((x for x in errors if _keys(x)[:len(first)] == first), key=lambda x: len(_keys(x)))
    loc = ".".join(str(x) for x in _keys(err))
    msg = err.get("msg", "invalid")
    msg = msg.removeprefix("Value error, ")
    if err.get("type") == "missing":
        return f"missing key '{loc}'"
    if err.get("type") == "extra_forbidden":
        return f"unknown key '{loc}'"
    if err.get("type") in _EXPECTED and "input" in err:
        msg = f"expected {_EXPECTED[err['type']]}, got {given(err['input'])}"
    elif err.get("type") in _NAMES_THE_VALUE and "input" in err:
        msg = f"{msg}, got {given(err['input'])}"
    return f"{loc}: {msg}" if loc else msg


def check_ordered(values, what: str, *, strict: bool = False, unit: str = "") -> None:
    """Raise ValueError (one sentence) at the first of ``values`` (times, iterations of a trace's
    points) that comes down after the one before it, or equals it where ``strict``."""
    for a, b in zip(values, values[1:]):
        if b < a or (strict and b == a):
            rule = "increase" if strict else "not decrease"
            raise ValueError(f"{what} must {rule} ({b:g}{unit} comes after {a:g}{unit})")


def check_writable(path: str | os.PathLike, what: str) -> None:
    """Refuse, before any work, an output path that cannot be written: one sentence naming it.

    The path must not be a directory, its nearest existing ancestor must be a directory, and a file
    must really be creatable there (tried and removed at once: permission bits say nothing for root,
    a read-only mount or ``/proc`` only answer to a real attempt). Missing parents are not created.
    """
    p = Path(path)
    if str(path) == "" or p.is_dir():
        raise BadInput(f"{what}: '{p}' is a directory; give a file name")
    _check_creatable(p, p.parent, what)


def check_writable_dir(path: str | os.PathLike, what: str) -> None:
    """Raise :class:`BadInput` unless ``path`` is, or can be made as, a directory files can be written in.

    The same checks as :func:`check_writable`, for a directory: ``path`` must not be a file, its
    nearest existing ancestor (itself, if it exists) must be a directory where a file can really be
    created. Nothing is created.
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise BadInput(f"{what}: '{p}' is a file; give a directory")
    _check_creatable(p, p, what)


def _check_creatable(p: Path, start: Path, what: str) -> None:
    """The nearest existing ancestor of ``start`` (itself included) must be a directory a file can be created in."""
    anc = start
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise BadInput(f"{what}: cannot write '{p}' because '{anc}' is a file, not a directory")
    try:
        fd, tmp = tempfile.mkstemp(dir=anc, prefix=".pipemorph-check-")
    except OSError as e:
        raise BadInput(f"{what}: cannot write '{p}': no file can be created in '{anc}' ({e.strerror})") from None
    os.close(fd)
    os.unlink(tmp)


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write text or bytes so that readers see the old file or the whole new one, never a part.

    Missing parent directories are created; should the write fail, the ones made here are removed
    again and the error is ``BadInput`` naming the path.
    """
    p = Path(path)
    made = [d for d in reversed(p.parents) if not d.exists()]
    tmp = None
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
        os.replace(tmp, p)
    except BaseException as e:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                pass
        if isinstance(e, OSError):
            raise BadInput(f"cannot write '{p}' ({e.strerror or first_line(e)})") from None
        raise


def dump(data: dict, as_json: bool) -> str:
    if as_json:
        return json.dumps(data, indent=2) + "\n"
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=None, width=120)


def first_line(e: BaseException, with_type: bool = False) -> str:
    """The first line of ``e``'s message (its type's name if it has none): errors quoted in one sentence.
    ``with_type``: prefixed with its type's name, ``"ValueError: ..."`` (just the name if it has none).
    The one such helper of the package."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    if with_type and line:
        return f"{type(e).__name__}: {line}"
    return line or type(e).__name__
