"""Which of the package's files a mapping holds, told by keys only that kind has, so that a command
given another kind of file says what it got and what takes it, in one sentence.

Pure Python: no torch.
"""
from __future__ import annotations

import os
from typing import Optional, TypeVar

from pydantic import BaseModel

from ...fileio import BadInput, load_mapping, validate_model

M = TypeVar("M", bound=BaseModel)

# (kind, its keys, what to run on it); the first kind whose keys are all there is the file's.
_KINDS = (
    ("trace", ("traceEvents",), "read it with pipemorph trace inspect {path}"),
    ("parts file", ("parts",), "it splits a model into stages (docs/partition.md); its plan is what "
                               "pipemorph partition --plan writes"),
    ("plan", ("schedule", "warmup"), "replay it with pipemorph simulate {path}"),
    ("layer profile", ("layers",), "partition it with pipemorph partition {path}"),
    ("profile", ("compute_ms",), "make a plan from it first (pipemorph plan {path} -o plan.yaml)"),
    ("link matrix", ("world_size",), "place ranks on it with pipemorph place {path}"),
)


def kind_of(data) -> Optional[str]:
    """The kind of file ``data`` (a parsed mapping) is, or None when it looks like none of them."""
    if not isinstance(data, dict):
        return None
    for kind, keys, _ in _KINDS:
        if all(k in data for k in keys):
            return kind
    return None


def refuse_other_kind(path, data, expected: str, instead: Optional[dict] = None) -> None:
    """BadInput when ``data``, read from ``path``, is plainly another kind of file than ``expected``;
    the sentence ends with what takes that kind, or with ``instead[kind]`` (``{path}`` filled in)."""
    got = kind_of(data)
    if got is not None and got != expected:
        todo = (instead or {}).get(got) or next(t for k, _, t in _KINDS if k == got)
        raise BadInput(f"{path} is a {got}, not a {expected}: {todo.format(path=path)}")


def load_kind(path: str | os.PathLike, model: type[M], kind: str, *, instead: Optional[dict] = None) -> M:
    """``fileio.load_model`` for a file that should be a ``kind``: another kind is named as such
    (see ``refuse_other_kind``)."""
    data = load_mapping(path)
    refuse_other_kind(path, data, kind, instead)
    return validate_model(path, data, model)
