"""Kinds of JSON values, and a check of a parsed file against the keys its reader uses; and
numbers as a flag, a variable or a header spells them.

One definition for every JSON file read from outside the process: the config files beside a
checkpoint's weights (``convert_side``) and an embed job's manifest and shard ids
(``clients/outputs.py``). A reader's schema lists the keys it reads, each with its kind; a value
of another kind is refused naming the file, the key's path and the value as JSON writes it, before
the reader meets it, so none does arithmetic on a string or reads ``true`` as 1. Keys a schema
does not list are not checked. jax-free.
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

from .errors import is_number, quoted


@dataclass(frozen=True)
class Kind:
    """A kind of single value (lists of them included), told by ``test``."""

    says: str  # what a value must be, as a refusal says it
    many: str  # the same in the plural, for a list's items
    test: Callable[[object], bool]


def _finite(value: object) -> bool:
    return is_number(value) and math.isfinite(value)


def _whole(value: object) -> bool:
    return is_number(value, numbers.Integral)


def _flag(value: object) -> bool:  # numpy's bools too (a config built from arrays' facts)
    kind = type(value)
    return kind is bool or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))


WHOLE = Kind("a whole number", "whole numbers", _whole)
COUNT = Kind("a whole number >= 0", "whole numbers >= 0", lambda v: _whole(v) and v >= 0)
SIZE = Kind("a whole number > 0", "whole numbers > 0", lambda v: _whole(v) and v > 0)
NUMBER = Kind("a finite number", "finite numbers", _finite)
POSITIVE = Kind("a finite number > 0", "finite numbers > 0", lambda v: _finite(v) and v > 0)
TEXT = Kind("a string", "strings", lambda v: isinstance(v, str))
FLAG = Kind("true or false", "flags", _flag)


def list_of(kind: Kind, length: int | None = None) -> Kind:
    says = f"a list of {f'{length} ' if length else ''}{kind.many}"
    return Kind(says, f"lists of {kind.many}",
                lambda v: isinstance(v, (list, tuple)) and (length is None or len(v) == length)
                and all(kind.test(x) for x in v))


def either(*kinds: Kind) -> Kind:
    return Kind(" or ".join(k.says for k in kinds), " or ".join(k.many for k in kinds),
                lambda v: any(k.test(v) for k in kinds))


@dataclass(frozen=True)
class Each:
    """A list whose items are each ``item`` (an object's schema, usually)."""

    item: Node


@dataclass(frozen=True)
class Values:
    """An object of any keys whose values are each ``item``; ``needed`` keys must be there."""

    item: Node
    needed: tuple[str, ...] = ()


@dataclass(frozen=True)
class Needed:
    """A key of an object's schema that must be present."""

    node: Node


# An object's schema: the keys read, each a node (or Needed); {} is any object.
Schema = dict[str, Union["Node", Needed]]
Node = Kind | Each | Values | Schema


def check(data: object, node: Node, file: str, error: type[Exception],
          at: tuple[str | int, ...] = ()) -> None:
    """Raise ``error`` naming ``file`` where ``data`` (parsed JSON) is not of ``node``'s kind."""
    where = ".".join(map(str, at)) or "the file"

    def refuse(what: str) -> None:
        raise error(f"{file}: {where} is {_short(data)}, not {what}")

    if isinstance(node, Kind):
        if not node.test(data):
            refuse(node.says)
    elif isinstance(node, Each):
        if not isinstance(data, list):
            refuse("a list")
        for i, item in enumerate(data):
            check(item, node.item, file, error, (*at, i))
    elif not isinstance(data, dict):
        refuse("a JSON object")
    else:
        listed = node.items() if isinstance(node, dict) else (
            [(k, Needed(node.item)) for k in node.needed]
            + [(k, node.item) for k in data if k not in node.needed])
        for key, child in listed:
            if key not in data:
                if isinstance(child, Needed):
                    raise error(f"{file}: {'.'.join(map(str, (*at, key)))} is missing")
                continue
            check(data[key], child.node if isinstance(child, Needed) else child, file, error,
                  (*at, key))


def _short(value: object, limit: int = 60) -> str:
    text = json.dumps(value)  # as the file has it: true, "four", [1, 2]
    return text if len(text) <= limit else text[: limit - 3] + "..."


class NotANumber(argparse.ArgumentTypeError, ValueError):
    """A text that is not a number as the user means one (argparse shows the message as is)."""


# Digits as a person writes them: Python's int() and float() also read "1_0" as 10 and
# non-ASCII digits ("\uff11" as 1), which a typo or a pasted value should not become.
_WHOLE_TEXT = re.compile(r"[+-]?[0-9]+")
_REAL_TEXT = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?")
MAX_DIGITS = 100  # far past any setting (a 64-bit seed has 20)
_NON_FINITE = ("inf", "+inf", "-inf", "infinity", "+infinity", "-infinity", "nan")


def whole_number(text: str) -> int:
    """An integer in plain digits (surrounding spaces allowed)."""
    if not _WHOLE_TEXT.fullmatch(text.strip()):
        raise NotANumber(f"expected a whole number (plain digits), got {quoted(text)}")
    if len(text.strip()) > MAX_DIGITS:  # int() refuses past 4300 in words of its own
        raise NotANumber(f"expected a whole number of at most {MAX_DIGITS} digits, got "
                         f"{len(text.strip())}")
    return int(text)


def real_number(text: str) -> float:
    """A decimal number in plain digits (``1.5``, ``2e-3``). ``inf`` and ``nan`` are read, so
    that the setting's own check refuses them by its rule."""
    word = text.strip()
    if not (_REAL_TEXT.fullmatch(word) or word.lower() in _NON_FINITE):
        raise NotANumber(f"expected a number (plain digits, as 1.5 or 2e-3), got {quoted(text)}")
    return float(word)
