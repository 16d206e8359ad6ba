"""``TextEnum``: an enum whose members are their text (``enum.StrEnum`` of Python 3.11, on 3.9 too).

A member equals, hashes, prints and formats as its string, so files, logs and comparisons with
plain strings read it as the text it stands for.

Pure Python: no torch, no deepspeed.
"""
from __future__ import annotations

from enum import Enum


class TextEnum(str, Enum):
    __str__ = str.__str__
    __format__ = str.__format__
    __hash__ = str.__hash__  # the text's hash (Enum's hashes the name): as fast as a str key, and the same
