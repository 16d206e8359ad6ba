"""Reading YAML/JSON files into pydantic models with one-sentence errors; atomic writes."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)
# libyaml's C loader and emitter when PyYAML was built with it (several times faster), else PyYAML's own.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class BadInput(ValueError):
    """User input that cannot be used; the message is one sentence naming what to fix."""


def load_mapping(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"{p}: no such file")
    try:
        data = yaml.load(p.read_text(), Loader=_Loader)  # noqa: S506 - a safe loader
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise BadInput(f"{p}: not valid YAML or JSON ({_first_line(e)})") from None
    if not isinstance(data, dict):
        raise BadInput(f"{p}: expected a mapping of keys at the top level")
    return data


def load_model(path: str | os.PathLike, model: type[M]) -> M:
    data = load_mapping(path)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise BadInput(f"{path}: {describe(e)}") from None


def describe(e: ValidationError) -> str:
    """The first pydantic error as 'key.path: what is wrong'."""
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    msg = err.get("msg", "invalid")
    msg = msg.removeprefix("Value error, ")
    if err.get("type") == "missing":
        return f"missing key '{loc}'"
    if err.get("type") == "extra_forbidden":
        return f"unknown key '{loc}'"
    return f"{loc}: {msg}" if loc else msg


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write text or bytes so that readers see the old file or the whole new one, never a part."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def dump(data: dict, as_json: bool) -> str:
    if as_json:
        return json.dumps(data, indent=2) + "\n"
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=None, width=120)


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
